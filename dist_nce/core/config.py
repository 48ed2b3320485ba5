"""Typed configuration: dataclasses loaded from YAML, with unknown keys rejected.

Every experiment config is a tree of dataclasses. ``load_config(Cls, path)`` reads a
YAML file and builds ``Cls``; a key that the dataclass does not declare, or a value
of the wrong type, raises :class:`ConfigError` naming the file and the dotted key
(``configs/aida/tiny.yaml: train.lr_warmup: unknown key; expected one of ...``); a key
repeated within one mapping (two ``optim:`` sections) is refused as well, naming the
line (``configs/aida/tiny.yaml:14: duplicate key 'optim' (first at line 3)``).
Help strings live in ``field(metadata={"help": ...})`` so ``describe(Cls)`` can
print them.

Every numeric field also declares its admissible values next to its help string,
``metadata={"range": Range(ge=1)}`` (for a list or dict: each item), and a field may
add ``metadata={"check": fn}``, ``fn(value) -> reason or None``. The loader checks both
for every field, defaults included, before the dataclass's own cross-field
``validate()`` runs, and refuses a value as ``file: dotted.key: value: why``.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or dict does not match its dataclass."""


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclasses.dataclass(frozen=True)
class Range:
    """Admissible values of a numeric field: any of ``ge`` (>=), ``gt`` (>), ``le`` (<=),
    ``lt`` (<); ``why`` says what the bound protects, for the error message."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def describe(self) -> str:
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return "any number"

    def problem(self, value: float) -> str | None:
        """Why ``value`` is refused, or None."""
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        if ok and value == value:  # NaN compares false to everything but is no number a config wants
            return None
        return f"must be {self.describe()}" + (f" ({self.why})" if self.why else "")


AT_LEAST_0 = Range(ge=0)
AT_LEAST_1 = Range(ge=1)
POSITIVE = Range(gt=0)
FRACTION = Range(ge=0, le=1)


def plain_name(value: str) -> str | None:
    """A ``check`` for names that become one directory level (run names): no separators, no ``..``."""
    if not value:
        return "must not be empty"
    if "/" in value or "\\" in value or os.sep in value or ".." in value or "\0" in value:
        return "must be a plain name (no '/' or '\\', no '..'): it names one directory under the run's storage"
    return None


def _leaves(value: Any, where: str):
    """(where, scalar) for a value, each list item or each dict value."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield f"{where}.{k}", v
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield f"{where}[{i}]", v
    else:
        yield where, value


def _check_fields(obj: Any, where: str, given: Mapping[str, Any] | None = None) -> None:
    """Check every field's ``range`` and ``check`` metadata. Nested dataclasses that were
    given as data were checked when they were built; defaulted ones are walked here."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = _join(where, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if given is None or f.name not in given:
                _check_fields(value, key)
            continue
        bounds, check = f.metadata.get("range"), f.metadata.get("check")
        for leaf_key, leaf in _leaves(value, key):
            if leaf is None or isinstance(leaf, bool):
                continue
            why = None
            if bounds is not None and isinstance(leaf, (int, float)):
                why = bounds.problem(leaf)
            if why is None and check is not None:
                why = check(leaf)
            if why:
                raise ConfigError(f"{leaf_key}: {leaf!r}: {why}")


def check_fields(obj: Any, prefix: str = "") -> None:
    """Range and ``check`` metadata of every field of dataclass ``obj`` (and nested ones), for
    objects built without the loader; raises :class:`ConfigError` ``prefix.key: value: why``."""
    _check_fields(obj, prefix)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check (and minimally coerce) ``value`` against the annotation ``tp``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: value {value!r} matches none of {', '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML reads "1e-5" (no dot) as a string; accept numeric strings for floats.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _join(where: str, key: str) -> str:
    # ``where`` is "file: dotted.path" or "file: " at the top level.
    return f"{where}{key}" if where.endswith(" ") or not where else f"{where}.{key}"


def _build(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"{_join(where, str(unknown[0]))}: unknown key for {cls.__name__}; expected one of {sorted(fields)}"
        )
    kwargs = {name: _coerce(value, hints[name], _join(where, name)) for name, value in data.items()}
    label = where.strip().rstrip(":") or cls.__name__
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{label}: {e}") from None
    # Ranges first: a cross-field validate() may divide by, or index with, a field.
    _check_fields(obj, where, data)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except (ValueError, AssertionError) as e:
            raise ConfigError(f"{label}: {e}") from None
    return obj


def from_dict(cls: type[T], data: Mapping[str, Any] | None, source: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping, rejecting unknown keys.

    ``source`` (a file name) prefixes every error message.
    """
    where = f"{source}: " if source else ""
    return _build(cls, data or {}, where)


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"override {dotted}: {k} is not a mapping")
    cur[keys[-1]] = value


def parse_overrides(items: list[str] | None) -> dict:
    """``["train.lr=2e-5", "negatives.mode=hard"]`` -> nested dict (values parsed as YAML)."""
    out: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_dotted(out, key.strip(), yaml.safe_load(raw))
    return out


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


_MERGE = "tag:yaml.org,2002:merge"


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated within one mapping, as a :class:`ConfigError`
    ``file:line: duplicate key 'optim.epochs' (first at line 3)``.

    Plain ``safe_load`` keeps the last of two ``optim:`` sections and silently drops the first one's
    keys. Merge keys (``<<: *base``) keep their YAML meaning: an explicit key may override a merged one.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        # Checked on the composed tree, before construction: SafeConstructor.flatten_mapping splices
        # merged pairs into a mapping node in place (sometimes before that node's own construction),
        # after which a merged key and its explicit override would look like a duplicate.
        _refuse_duplicate_keys(self, node, "", set())
        return super().construct_document(node)


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: its node was checked where its anchor stands (and may be recursive)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(loader, item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = "<<" if key_node.tag == _MERGE else \
                loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}.{key}" if path else str(key)
            try:
                earlier = first.setdefault(key, key_node) if key is not None else None
            except TypeError:  # an unhashable key: SafeLoader refuses it itself
                earlier = None
            if earlier is not None and earlier is not key_node:
                mark = key_node.start_mark
                raise ConfigError(f"{mark.name}:{mark.line + 1}: duplicate key {dotted!r} "
                                  f"(first at line {earlier.start_mark.line + 1})")
            _refuse_duplicate_keys(loader, value_node, dotted, seen)


def load_yaml(path: str | os.PathLike) -> Any:
    """The one YAML document in file ``path``, read with :class:`UniqueKeyLoader`; invalid YAML or a
    duplicate key is a :class:`ConfigError` naming the file."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:  # an open file gives the loader's marks, so the errors, its name
        try:
            return yaml.load(f, Loader=UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None


def load_config(cls: type[T], path: str | os.PathLike, overrides: list[str] | None = None) -> T:
    """Read YAML ``path`` into dataclass ``cls``; ``overrides`` are ``key.path=value`` strings."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    data = load_yaml(path) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    merged = _deep_merge(dict(data), parse_overrides(overrides))
    try:
        return from_dict(cls, merged, source=path)
    except ConfigError as e:
        if not overrides:
            raise
        try:  # the file alone is valid: what is wrong came with an override, so the message names --set
            from_dict(cls, data, source=path)
        except ConfigError:
            raise e from None
        raise ConfigError(str(e).replace(f"{path}: ", f"--set (over {path}): ", 1)) from None


def absolute_paths(cfg: T, fields: tuple[str, ...], base: str | None = None) -> T:
    """A copy of ``cfg`` whose local paths at the dotted ``fields`` are absolute (relative to ``base``, default
    the cwd): Ray Train workers and job drivers run in other directories. URIs (``s3://...``) and unset
    paths are left alone."""
    out = copy.deepcopy(cfg)
    base = base or os.getcwd()
    for dotted in fields:
        *parents, name = dotted.split(".")
        holder = out
        for p in parents:
            holder = getattr(holder, p)
        value = getattr(holder, name)
        if value and "://" not in value and not os.path.isabs(value):
            setattr(holder, name, os.path.normpath(os.path.join(base, value)))
    return out


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dict (YAML/JSON-serialisable)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def describe(cls: type, indent: str = "") -> str:
    """One line per field with its type, default and help string."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        help_ = f.metadata.get("help", "")
        if dataclasses.is_dataclass(tp):
            lines.append(f"{indent}{f.name}:  # {help_}".rstrip(" #"))
            lines.append(describe(tp, indent + "  "))
        else:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>")
            bounds = f.metadata.get("range")
            limits = f" ({bounds.describe()})" if bounds is not None else ""
            lines.append(f"{indent}{f.name}: {default!r}  # {_type_name(tp)}{limits}. {help_}".rstrip())
    return "\n".join(lines)
