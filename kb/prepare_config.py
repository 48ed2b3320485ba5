"""What ``kb.prepare`` is asked to do: :class:`PrepareConfig`, one field per command-line flag."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dist_nce.core.config import AT_LEAST_1, FRACTION, Range, check_fields


class PrepareError(ValueError):
    """Invalid prepare request (bad combination of sources, existing output, empty input, ...)."""


def _h(text: str, bounds: Range | None = None) -> dict:
    return {"help": text, **({"range": bounds} if bounds else {})}


@dataclass
class PrepareConfig:
    out: str = field(default="", metadata=_h("output directory of the prepared store"))
    kilt_ks: str | None = field(default=None, metadata=_h("kilt_knowledgesource.json (entities)"))
    aida_dir: str | None = field(default=None, metadata=_h(
        "directory with aidayago2-{train,dev,test_without_answers}-kilt.jsonl (mentions; with --kilt-ks "
        "or --blink-entities)"))
    zeshel_root: str | None = field(default=None, metadata=_h("Zeshel root with documents/ and mentions/"))
    blink_entities: str | None = field(default=None, metadata=_h("BLINK entity.jsonl (entities)"))
    model_dir: str | None = field(default=None, metadata=_h("tokenizer directory (default: shipped MiniLM)"))
    mention_max_len: int = field(default=32, metadata=_h(
        "mention tokens (32 in BLINK, 128 in the paper)",
        Range(ge=5, why="[CLS], [SEP] and the two mention markers take 4")))
    entity_max_len: int = field(default=128, metadata=_h(
        "entity tokens", Range(ge=4, why="[CLS], [SEP] and the title marker take 3")))
    zeshel_strip_title: bool = field(default=False, metadata=_h(
        "drop the title that starts every Zeshel document from the description"))
    zeshel_worlds: str | None = field(default=None, metadata=_h(
        "comma-separated Zeshel worlds whose documents become the entities (a split name train/val/test "
        "stands for its worlds); default: every documents/<world>.json. Mentions whose gold is in another "
        "world are kept and counted as missing gold"))
    zeshel_splits: str | None = field(default=None, metadata=_h(
        "comma-separated Zeshel mention splits to read, each of which must exist (default: those of train, "
        "val, test and the heldout splits that mentions/ holds; the log says which)"))
    workers: int = field(default=1, metadata=_h("parallel worker processes", AT_LEAST_1))
    chunk_size: str = field(default="32M", metadata=_h("bytes of input per chunk (suffix K/M/G allowed)"))
    rows_per_part: int = field(default=1 << 18, metadata=_h("entity rows per Arrow part file", AT_LEAST_1))
    on_bad_record: Literal["error", "skip"] = field(default="error", metadata=_h(
        "error: stop at the first malformed line; skip: count, report and record them"))
    allow_empty: bool = field(default=False, metadata=_h(
        "accept an entity file or a mention split with no records (by default an error naming the file)"))
    min_gold_resolution: float = field(default=0.9, metadata=_h(
        "warn loudly when a split resolves the gold entity of fewer than this fraction of its labelled "
        "mentions (the rate is recorded in the manifest either way)", FRACTION))
    overwrite: bool = field(default=False, metadata=_h(
        "replace an existing store prepared from other inputs (the new one is built beside it and swapped in "
        "only when complete)"))
    keep_chunks: bool = field(default=False, metadata=_h("keep the per-chunk files after assembly"))
    progress: bool = field(default=True, metadata=_h("progress bar on stderr (--no-progress hides it)"))

    def validate(self) -> None:
        if not self.out:
            raise ValueError("out: an output directory is required")
        kb_sources = [n for n in ("kilt_ks", "zeshel_root", "blink_entities") if getattr(self, n)]
        if len(kb_sources) != 1:
            raise ValueError("give exactly one of --kilt-ks, --zeshel-root, --blink-entities "
                             f"(got {len(kb_sources)})")
        if self.aida_dir and self.zeshel_root:
            raise ValueError("--aida-dir goes with --kilt-ks or --blink-entities, not --zeshel-root")
        for name in ("zeshel_strip_title", "zeshel_worlds", "zeshel_splits"):
            if getattr(self, name) and not self.zeshel_root:
                raise ValueError(f"--{name.replace('_', '-')} applies to --zeshel-root only")
        self.zeshel_world_list, self.zeshel_split_list  # noqa: B018 - validates the names
        check_fields(self)
        self.chunk_bytes  # noqa: B018 - validates the size string

    @property
    def chunk_bytes(self) -> int:
        return parse_size(self.chunk_size)

    @property
    def zeshel_world_list(self) -> list[str] | None:
        """The selected worlds (split names expanded, order kept, no repeats), or None for all."""
        from kb.zeshel import ZESHEL_WORLDS

        if self.zeshel_worlds is None:
            return None
        worlds: list[str] = []
        for item in items(self.zeshel_worlds, "zeshel_worlds"):
            for w in ZESHEL_WORLDS.get(item, [item]):
                if w not in worlds:
                    worlds.append(w)
        return worlds

    @property
    def zeshel_split_list(self) -> list[str] | None:
        from kb.zeshel import ZESHEL_SPLITS

        if self.zeshel_splits is None:
            return None
        splits = list(dict.fromkeys(items(self.zeshel_splits, "zeshel_splits")))
        unknown = [s for s in splits if s not in ZESHEL_SPLITS]
        if unknown:
            raise ValueError(f"zeshel_splits: unknown split(s) {unknown}; expected some of {list(ZESHEL_SPLITS)}")
        return splits


def items(text: str, what: str) -> list[str]:
    """The non-empty items of a comma-separated option."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise ValueError(f"{what}: expected a comma-separated list, got {text!r}")
    return out


def parse_size(text: str | int) -> int:
    """``"32M"`` -> 33554432; plain integers are bytes."""
    s = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        value = int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise ValueError(f"chunk_size: expected bytes like 33554432 or 32M, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"chunk_size must be positive, got {text!r}")
    return value
