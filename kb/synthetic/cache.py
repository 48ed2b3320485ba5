"""Synthetic data directories that jobs generate once and reuse: reused only when they
hold exactly what the settings ask for.

A job configured with ``synthetic_*`` settings writes its data into a directory and
finds it there next time. Reusing it on the strength of ``manifest.json`` existing
would train on stale data after any change of size, seed, knobs or generator version,
so the manifest's ``settings`` (:func:`kb.synthetic.kilt.kilt_settings`,
:func:`kb.synthetic.zeshel.zeshel_settings`) are compared with the requested ones, and a
directory generated with other settings is regenerated: its files are a pure function
of those settings, so regenerating loses nothing that cannot be made again.

A directory is only ever overwritten when it is provably synthetic data: it has a
synthetic manifest of the right kind, or the in-progress marker this module writes
before generating (so an interrupted generation is redone). Anything else that already
holds files of the same names (a user's real AIDA or Zeshel files, say) is refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

from dist_nce.core.artifacts import MANIFEST, atomic_write_json
from kb.synthetic import kilt as _kilt
from kb.synthetic import zeshel as _zeshel
from kb.synthetic.lexicon import load_lexicon
from kb.synthetic.universe import Knobs

IN_PROGRESS = ".synthetic-in-progress.json"


class SyntheticDataError(ValueError):
    """A synthetic data directory that must not be written to."""


def settings_differences(old: Mapping | None, new: Mapping) -> list[str]:
    """Top-level keys whose values differ (all of them when ``old`` records no settings)."""
    if not old:
        return ["settings (none recorded: written by an older dist-nce)"]
    return [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def ensure_generated(out: str | os.PathLike, kind: str, settings: dict, files: Sequence[str],
                     generate: Callable[[], object], log: Callable[[str], None] = print) -> bool:
    """Make ``out`` hold the synthetic data ``settings`` describe; True if it was (re)generated.

    ``files``: every data file (relative path) ``generate`` may write; ``generate`` writes
    them, except mention files that would be empty, and the manifest (recording
    ``settings`` and the ``files`` it wrote) into ``out``.
    """
    out = Path(out)
    manifest_path = out / MANIFEST
    marker = out / IN_PROGRESS
    old: dict | None = None
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise SyntheticDataError(f"{manifest_path}: not valid JSON ({e}); not overwriting {out}") from None
        if old.get("kind") != kind:
            raise SyntheticDataError(f"{out} holds a '{old.get('kind')}' artifact, not '{kind}' synthetic data; "
                                     "not overwriting it: point the synthetic directory elsewhere")
        written = old.get("files") or files  # a split with no mentions has no file
        missing = [f for f in written if not (out / f).is_file()]
        differs = settings_differences(old.get("settings"), settings)
        if not differs and not missing:
            return False
        why = (f"generated with other settings (differs in: {', '.join(differs)})" if differs
               else f"incomplete (missing {', '.join(missing)})")
        log(f"{out}: synthetic data {why}; regenerating it")
    elif marker.exists():
        log(f"{out}: an earlier generation was interrupted; generating again")
    else:
        present = [f for f in files if (out / f).exists()]
        if present:
            raise SyntheticDataError(
                f"{out} already holds {', '.join(present)} but no synthetic manifest: it may be real data, so it "
                "is not overwritten; point the synthetic directory elsewhere (or delete those files)")
    out.mkdir(parents=True, exist_ok=True)
    # The marker goes down before the old manifest goes away, so that at every moment the
    # directory is recognisably synthetic; without a manifest it reads as incomplete.
    atomic_write_json(marker, {"kind": kind, "settings": settings})
    manifest_path.unlink(missing_ok=True)
    generate()
    keep = set(json.loads(manifest_path.read_text(encoding="utf-8")).get("files", files)) | {MANIFEST}
    for stale in sorted((set((old or {}).get("files", {})) | set(files)) - keep):
        (out / stale).unlink(missing_ok=True)
    marker.unlink()
    return True


def ensure_kilt(out: str | os.PathLike, num_entities: int, num_train: int, num_dev: int, num_test: int,
                seed: int = 0, *, blink: bool = False, title_drift: float = 0.03, missing_gold: float = 0.0,
                knobs: Knobs = Knobs(), vocab_path: str | os.PathLike | None = None, workers: int = 1,
                progress: bool | None = None, log: Callable[[str], None] = print) -> dict[str, Path]:
    """:func:`kb.synthetic.kilt.write_kilt` into ``out`` unless it already holds exactly that
    data; returns the same paths."""
    settings = _kilt.kilt_settings(num_entities, num_train, num_dev, num_test, seed, blink=blink,
                                   title_drift=title_drift, missing_gold=missing_gold, knobs=knobs,
                                   lexicon_sha256=load_lexicon(vocab_path).sha256)

    def generate() -> None:
        log(f"generating a synthetic KILT KB of {num_entities:,} entities and AIDA {num_train}/{num_dev}/{num_test} "
            f"mentions (seed {seed}) in {out}")
        _kilt.write_kilt(out, num_entities, num_train, num_dev, num_test, seed, blink=blink,
                         title_drift=title_drift, missing_gold=missing_gold, knobs=knobs, vocab_path=vocab_path,
                         workers=workers, progress=progress)

    ensure_generated(out, _kilt.MANIFEST_KIND, settings, _kilt.kilt_files(blink), generate, log)
    counts = {"train": num_train, "dev": num_dev, "test": num_test}
    paths = {"kb": Path(out) / _kilt.KB_FILE,
             **{s: Path(out) / f for s, f in _kilt.AIDA_FILES.items() if counts[s] > 0}}
    if blink:
        paths["blink"] = Path(out) / _kilt.BLINK_FILE
    paths["manifest"] = Path(out) / MANIFEST
    return paths


def ensure_zeshel(out: str | os.PathLike, worlds: Sequence[str] | None = None,
                  entities_per_world: int | Mapping[str, int] = 1000,
                  mentions_per_world: int | Mapping[str, int] = 500, seed: int = 0, *,
                  heldout_seen: float = 0.08, heldout_unseen: float = 0.08, knobs: Knobs = _zeshel.ZESHEL_KNOBS,
                  vocab_path: str | os.PathLike | None = None, log: Callable[[str], None] = print) -> Path:
    """:func:`kb.synthetic.zeshel.write_zeshel` into ``out`` unless it already holds exactly
    that tree; returns ``out``."""
    settings = _zeshel.zeshel_settings(worlds, entities_per_world, mentions_per_world, seed,
                                       heldout_seen=heldout_seen, heldout_unseen=heldout_unseen, knobs=knobs,
                                       lexicon_sha256=load_lexicon(vocab_path).sha256)

    def generate() -> None:
        log(f"generating synthetic Zeshel: {len(settings['worlds'])} worlds, documents per world "
            f"{sorted(set(settings['entities_per_world'].values()))}, mentions per world "
            f"{sorted(set(settings['mentions_per_world'].values()))} (seed {seed}) in {out}")
        _zeshel.write_zeshel(out, worlds, entities_per_world, mentions_per_world, seed, heldout_seen=heldout_seen,
                             heldout_unseen=heldout_unseen, knobs=knobs, vocab_path=vocab_path)

    ensure_generated(out, _zeshel.MANIFEST_KIND, settings, _zeshel.zeshel_files(worlds), generate, log)
    return Path(out)
