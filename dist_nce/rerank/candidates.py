"""The reranker's candidate sets: training rows with the gold first, candidate files by format.

Training (paper, section 5; the authors' data loader does the same): the reranker is
trained with the NCE loss over a mention's C retrieved candidates, gold at index 0
(``losses.nce_loss``). A gold the retriever missed is inserted: it takes the place of the
LOWEST-ranked candidate, or an empty slot when the list is shorter than C, so every
training example still has C candidates at most and the retriever's best ones are kept.

Evaluation never inserts the gold: a mention whose gold is not among its candidates is
simply wrong (unnormalized accuracy) and outside the normalized-accuracy denominator.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from dist_nce.eval.metrics import PAD
from dist_nce.eval.zeshel import CANDIDATES_KEY, CANDIDATES_KIND, TFIDF_KEY, CandidateFileError, read_candidates

Format = Literal["retriever", "tfidf"]


def gold_first(rows: np.ndarray, gold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Training candidates: the gold in column 0, the others in their retrieved order.

    Args:
        rows: int [N, C] candidate entity rows, best first, -1 = empty slot.
        gold: int [N] gold rows, all >= 0 (mentions without a gold in the KB are not trained on).

    Returns:
        (cands int64 [N, C], inserted bool [N]): ``cands[:, 0] == gold``; where the gold was
        missing (``inserted``) it displaced the last real candidate of a full row, or filled
        an empty slot. Empty slots stay -1 and go last.
    """
    rows = np.asarray(rows, dtype=np.int64)
    gold = np.asarray(gold, dtype=np.int64)
    if rows.ndim != 2 or gold.shape != (rows.shape[0],):
        raise ValueError(f"expected rows [N, C] and gold [N], got {rows.shape} and {gold.shape}")
    if rows.shape[1] < 2:
        raise ValueError(f"need C >= 2 candidates per mention (gold + a negative), got {rows.shape[1]}")
    if (gold < 0).any():
        raise ValueError(f"gold row -1 at mention {int(np.flatnonzero(gold < 0)[0])}: mentions without a gold "
                         "in the KB cannot be trained on; filter them first")
    inserted = ~(rows == gold[:, None]).any(axis=1)
    others = (rows != gold[:, None]) & (rows != PAD)
    # A stable sort on "not an other" keeps the others in retrieved order, in front.
    order = np.argsort(~others, axis=1, kind="stable")[:, : rows.shape[1] - 1]
    picked = np.take_along_axis(rows, order, axis=1)
    picked = np.where(np.take_along_axis(others, order, axis=1), picked, PAD)
    return np.concatenate([gold[:, None], picked], axis=1), inserted


def candidates_path(directory: str | Path, split: str, fmt: Format) -> Path:
    """``candidates_<split>.json`` (jobs/zeshel_retriever.py) or Zeshel's ``tfidf_candidates/<split>.json``."""
    return Path(directory) / (f"candidates_{split}.json" if fmt == "retriever" else f"{split}.json")


def written_by(fmt: Format) -> str:
    """Where the candidates of format ``fmt`` come from: said wherever a file is missing, so the
    error names the command that makes it (the reranker creates no candidates itself)."""
    if fmt == "retriever":
        return ("written by jobs/zeshel_retriever.py into <its run.output_dir>/candidates, e.g. "
                "runs/zeshel_tiny/candidates by --config configs/zeshel/retriever_tiny_cpu.yaml (make zeshel), "
                "or by a jobs/zeshel_grid.py row into <out>/<row>-<key>/candidates")
    return "Zeshel's own tfidf_candidates/ directory, from the Zeshel download"


def retriever_manifest(directory: str | Path) -> dict | None:
    """The manifest a retriever run wrote in its candidates ``directory`` (zeshel.evaluate), or None: no
    manifest (written by hand, or before manifests) or another kind's."""
    import json

    manifest = Path(directory) / "manifest.json"
    if not manifest.is_file():
        return None
    m = json.loads(manifest.read_text(encoding="utf-8"))
    return m if m.get("kind") == CANDIDATES_KIND else None


def check_listed(directory: Path, split: str, path: Path) -> None:
    """Refuse (CandidateFileError) a retriever's candidates file that its directory's manifest does not list: a
    later retriever run over fewer splits (``zeshel.candidate_splits``) rewrote the manifest and left an
    earlier run's file, which would otherwise be read as if that run had written it. A directory without a
    manifest (written by hand, or before manifests) is read as it is."""
    manifest = directory / "manifest.json"
    m = retriever_manifest(directory)
    if m is None:
        return
    if m.get("complete") is False:
        raise CandidateFileError(f"{path}: the retriever run writing {directory} stopped before it wrote every "
                                 f"candidates file ({manifest} lists none): run it again to the end")
    listed = m.get("splits") or {}
    if split not in listed or listed[split].get("file") != path.name:
        raise CandidateFileError(f"{path}: not written by the retriever run that {manifest} describes (it lists "
                                 f"{', '.join(sorted(listed)) or 'no split'}): an earlier run's file. Run the "
                                 f"retriever with {split} in zeshel.candidate_splits, or use that earlier run's "
                                 "directory")


def store_problem(directory: str | Path, split: str, store_dir: str, key: str) -> str | None:
    """Why the retriever's candidates of ``split`` in ``directory`` were not made over the prepared store
    ``store_dir`` (config key ``key``), or None (also where the manifest cannot say).

    Why: candidates over another store name other mentions and documents. The natural slip, a reranker
    pointed at a retriever's candidates with its stores left at their defaults, passed ``--dry-run`` and
    then failed once training began ("no candidates for 4755 of 5045 mentions"), or, where the ids agreed
    by chance, would train on another data set's lists. The manifest records each split's store by its
    identity (``index.encode.store_fingerprint``); one written before that records its mention count."""
    import json

    from dist_nce.index.encode import store_fingerprint

    manifest = Path(directory) / "manifest.json"
    m = retriever_manifest(directory)
    entry = (m.get("splits") or {}).get(split) if m is not None else None
    store_manifest = Path(store_dir) / "manifest.json"
    if not entry or not store_manifest.is_file():
        return None
    made_over = f"the candidates of {split} in {directory} were made over {entry.get('store', 'another store')}"
    fix = f"set {key} to that store, or run the retriever over this one"
    if "store_fingerprint" in entry:
        if entry["store_fingerprint"] != store_fingerprint(store_dir):
            return f"{key}: {store_dir} is not the store {made_over} ({manifest}); {fix}"
        return None
    count = (json.loads(store_manifest.read_text(encoding="utf-8")).get("mentions", {}).get(split) or {}).get("count")
    if "mentions" in entry and count is not None and int(entry["mentions"]) != int(count):
        return (f"{key}: {store_dir} has {count} mentions of {split}, but {made_over}, which has "
                f"{entry['mentions']} ({manifest}); {fix}")
    return None


def read_split_candidates(directory: str | Path, split: str, fmt: Format) -> tuple[dict[str, list[str]], Path]:
    """mention_id -> ranked document ids of ``split``, and the file read."""
    path = candidates_path(directory, split, fmt)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {fmt} candidates for split {split!r} ({written_by(fmt)})")
    if fmt == "retriever":
        check_listed(Path(directory), split, path)
    return read_candidates(path, CANDIDATES_KEY if fmt == "retriever" else TFIDF_KEY), path


def num_candidates_problem(lists: dict[str, list[str]], path: str | Path, num_candidates: int) -> str | None:
    """Why ``data.num_candidates`` cannot be used with the lists of ``path``, or None.

    A C larger than every list would train and evaluate on padding while summaries still say
    "C = <num_candidates>" and ``candidate_recall@<num_candidates>``: refused. The longest list
    is the bound (lists shorter than C end in empty slots, as a retriever's can when the KB
    lacks some ids); a smaller C is fine: the top C of each list are used.
    """
    longest = max(map(len, lists.values()), default=0)
    if num_candidates <= longest:
        return None
    return (f"data.num_candidates: {num_candidates}: {path} holds at most {longest} candidates per mention "
            f"(longest of its {len(lists)} lists); C must be {longest} or fewer (a smaller C uses each list's top C)")
