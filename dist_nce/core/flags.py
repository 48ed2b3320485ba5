"""Command-line flags whose values are checked while argparse reads them.

A job refuses a bad value before it reads any data, loads a model or starts Ray, with one
line on stderr, ``error: --flag: value: why``, and exit status 2 (argparse's own status for a
bad command line). The bounds are the same :class:`~dist_nce.core.config.Range` objects the
config dataclasses declare, so a flag and the config key it sets refuse the same values in the
same words. Here, below ``kb`` and ``dist_nce.cli``, so that both kinds of job share it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, TypeVar

from dist_nce.core.config import Range

T = TypeVar("T")


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose refused values read ``error: --flag: value: why`` on one line."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        # argparse's own wording ("invalid choice: 'x' (choose from ...)") breaks the flag: value: why form.
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, f"{value}: must be one of {', '.join(map(str, action.choices))}")

    def add_help_config(self, kind: type, note: str = "") -> None:
        """``--help-config``: print every field of the config dataclass ``kind`` (type, default, help) and
        exit 0, before any other flag is checked (as ``--help`` does)."""
        from dist_nce.core.config import describe

        class HelpConfig(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
                print(describe(kind))
                parser.exit(0)

        self.add_argument("--help-config", nargs=0, action=HelpConfig,
                          help="print every config field and exit" + (f" ({note})" if note else ""))

    def error(self, message: str) -> None:  # type: ignore[override]
        # "argument --k: 0: must be >= 1" is a refused value: the usage block would only bury it. Other
        # mistakes (a missing required flag, an unknown one) keep argparse's usage reminder.
        if message.startswith("argument "):
            self.exit(2, f"error: {message.removeprefix('argument ')}\n")
        super().error(message)


def checked(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """A ``type=`` function from ``parse(text)``, whose ValueError says why the text is refused."""

    def flag(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text}: {e}") from None

    flag.__name__ = name  # argparse names the type in its fallback messages
    return flag


def number(kind: type = int, bounds: Range | None = None) -> Callable[[str], float]:
    """``type=`` for an int or float flag, optionally within ``bounds``."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"not {what}") from None
        why = bounds.problem(value) if bounds is not None else None
        if why:
            raise ValueError(why)
        return value

    return checked(parse, kind.__name__)


def int_list(bounds: Range | None = None) -> Callable[[str], list[int]]:
    """``type=`` for a comma-separated list of integers (``1,5,10``), each within ``bounds``."""
    one = number(int, bounds)

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise ValueError("expected a comma-separated list of integers")
        out = []
        for item in items:
            try:
                out.append(one(item))
            except argparse.ArgumentTypeError as e:
                raise ValueError(str(e)) from None  # "item: why" names the offending item
        return out

    return checked(parse, "int_list")


def names(allowed: tuple[str, ...] | None = None) -> Callable[[str], list[str]]:
    """``type=`` for a comma-separated list of names (``dev,test``), each in ``allowed`` if given."""

    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        if not items:
            raise ValueError("expected a comma-separated list of names")
        unknown = [t for t in items if allowed is not None and t not in allowed]
        if unknown:
            raise ValueError(f"unknown {', '.join(unknown)}; expected some of {', '.join(allowed)}")
        return items

    return checked(parse, "names")


def choice(*allowed: str) -> Callable[[str], str]:
    """``type=`` for one of ``allowed`` (for a flag whose ``choices=`` would hide a config's default)."""

    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return text

    return checked(parse, "choice")


def existing(kind: str = "any", what: str = "") -> Callable[[str], str]:
    """``type=`` for an input path that must exist: ``"file"``, ``"dir"`` or ``"any"``; returns the text.
    ``what`` names it in the message (``"config file"``: "config file not found")."""

    def parse(text: str) -> str:
        path = Path(text)
        if not path.exists():
            raise ValueError(f"{what} not found".lstrip())
        if kind == "file" and not path.is_file():
            raise ValueError("not a file")
        if kind == "dir" and not path.is_dir():
            raise ValueError("not a directory")
        return text

    return checked(parse, f"existing {kind}")


def missing_input(args: argparse.Namespace, kinds: dict[str, str]) -> int | None:
    """Input-path flags (flag -> ``existing`` kind) checked after parsing, for parsers whose command
    lines are also parsed where the paths do not exist (the README's examples, a config's lines):
    the exit status after reporting the first missing one, else None."""
    for flag, kind in kinds.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        for text in value if isinstance(value, list) else [value]:
            if text is None:
                continue
            try:
                existing(kind)(text)
            except argparse.ArgumentTypeError as e:
                print(f"error: {flag}: {e}", file=sys.stderr)
                return 2
    return None


def occupied(path: str) -> str | None:
    """Why ``path`` cannot be a fresh output directory (it exists and holds something), or None."""
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        return "not empty; give a new or empty directory"
    return None


def refuse(flag: str, value: object, why: str) -> int:
    """Report a value that only a check across flags can refuse, as argparse reports the others."""
    print(f"error: {flag}: {value}: {why}", file=sys.stderr)
    return 2
