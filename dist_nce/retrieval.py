"""Evaluation retrieval: every mention's top-k entities under a trained retriever.

One function, :func:`retrieve`, over either kind of searcher:

* a ``NegativeService`` (Ray shards; the whole KB, e.g. KILT's 5.9M pages). Only mention
  vectors travel; each shard's top k comes back merged. The next batch of mentions is
  encoded while the shards search the previous ones (``in_flight`` requests at a time).
* in process: a :class:`~dist_nce.index.search.ShardIndex`, or several over DISJOINT row
  ranges whose answers are merged (a Zeshel split = its worlds). :func:`build_local_index`
  encodes a store, or one row range of it, into such an index (small KBs, tests).

:func:`serve_model` makes a service's shards serve a given retriever's entity embeddings,
reusing a persisted snapshot only when it was made from the same weights.

Rankings follow :func:`dist_nce.sampling.topk.merge_results`: score descending, ties to the
smaller row; ``-1`` fills slots beyond the number of searchable rows. Mentions are
encoded longest first so a batch trims little padding; results go back to input order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch

from dist_nce.actors.protocols import NegativeSource
from dist_nce.index.config import IndexConfig
from dist_nce.index.encode import encode_rows, state_fingerprint
from dist_nce.index.search import ShardIndex
from dist_nce.modeling.retriever import Retriever
from dist_nce.modeling.scoring import Reps, is_inner_product
from dist_nce.sampling.topk import ShardResult, merge_results
from kb.store import EntityStore


class Mentions(Protocol):
    """What retrieval reads of a mention table (``kb.store.MentionTable`` has it)."""

    lengths: np.ndarray

    def token_ids(self, idx: Any) -> np.ndarray: ...


class Future(Protocol):
    def result(self, timeout: float | None = None) -> ShardResult: ...


class TopkService(Protocol):
    """The part of ``dist_nce.actors.service.NegativeService`` used here."""

    def topk(self, mention_reps: Reps | torch.Tensor, k: int, gold: torch.Tensor | None = None) -> Future: ...


Searcher = ShardIndex | Sequence[ShardIndex] | TopkService


@dataclass(frozen=True)
class Retrieved:
    """Top-k answers for N mentions, in the order they were asked for.

    rows: int64 [N, k] global entity rows, best first, -1 = empty slot.
    scores: float32 [N, k] s(x, y) of those rows (-inf in empty slots).
    versions: the distinct index versions the answers came from (one, unless the index
    was refreshed while retrieving).
    """

    rows: np.ndarray
    scores: np.ndarray
    versions: tuple[int, ...]


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _mask(lengths: np.ndarray, width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(np.asarray(lengths), dtype=torch.int64)[:, None]


def iter_mention_reps(
    retriever: Retriever, mentions: Mentions, indices: np.ndarray | None = None, batch_size: int = 128,
    progress: bool = True, desc: str = "encode mentions",
) -> Iterator[tuple[np.ndarray, Reps]]:
    """Yield ``(idx [b], mention Reps [b, ...] on CPU)`` for ``indices`` (default: all).

    Batches go longest mention first; ``idx`` says which mentions each batch holds.
    """
    from tqdm.auto import tqdm

    lengths = np.asarray(mentions.lengths)
    idx = np.arange(len(lengths)) if indices is None else np.asarray(indices, dtype=np.int64)
    order = idx[np.argsort(-lengths[idx], kind="stable")]
    device = _device(retriever)
    retriever.eval()
    with tqdm(total=len(order), desc=desc, unit="mention", disable=not progress, mininterval=2.0) as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            ids = torch.from_numpy(mentions.token_ids(batch).astype(np.int64))
            with torch.inference_mode():
                reps = retriever.encode_mentions(ids.to(device), _mask(lengths[batch], ids.shape[1]).to(device))
            yield batch, Reps(reps.vecs.float().cpu(), None if reps.mask is None else reps.mask.cpu())
            bar.update(len(batch))


def local_search(indexes: ShardIndex | Sequence[ShardIndex], queries: Reps, k: int) -> ShardResult:
    """Top k over in-process indexes of disjoint row ranges (their merged answers)."""
    parts = [indexes] if isinstance(indexes, ShardIndex) else list(indexes)
    if not parts:
        raise ValueError("local_search: no index to search")
    return merge_results([p.topk(queries, k) for p in parts], k)


def _submitter(searcher: Searcher) -> Callable[[Reps, int], Callable[[], ShardResult]]:
    """searcher -> submit(queries, k), returning a thunk that yields the merged ShardResult."""
    if isinstance(searcher, ShardIndex) or (
        isinstance(searcher, Sequence) and searcher and all(isinstance(s, ShardIndex) for s in searcher)
    ):
        def submit_local(q: Reps, k: int) -> Callable[[], ShardResult]:
            res = local_search(searcher, q, k)
            return lambda: res
        return submit_local
    if not callable(getattr(searcher, "topk", None)):
        raise TypeError(f"searcher must be a ShardIndex, a list of them or a NegativeService, got "
                        f"{type(searcher).__name__}")

    def submit_service(q: Reps, k: int) -> Callable[[], ShardResult]:
        return searcher.topk(q, k).result
    return submit_service


def retrieve(
    retriever: Retriever, mentions: Mentions, searcher: Searcher, k: int = 64, *,
    indices: np.ndarray | None = None, batch_size: int = 128, in_flight: int = 2, progress: bool = True,
    desc: str = "retrieve",
) -> Retrieved:
    """Top k entities for each mention in ``indices`` (default: all), gold NOT excluded.

    searcher: a NegativeService (the whole KB), a ShardIndex, or a list of ShardIndex over
    disjoint row ranges (the union of those ranges). Returns rows/scores [len(indices), k].
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    submit = _submitter(searcher)
    n = len(mentions.lengths) if indices is None else len(indices)
    position = np.full(len(mentions.lengths), -1, dtype=np.int64)
    position[np.arange(len(mentions.lengths)) if indices is None else np.asarray(indices)] = np.arange(n)
    rows = np.full((n, k), -1, dtype=np.int64)
    scores = np.full((n, k), -np.inf, dtype=np.float32)
    versions: set[int] = set()
    pending: deque[tuple[np.ndarray, Callable[[], ShardResult]]] = deque()

    def collect() -> None:
        idx, get = pending.popleft()
        res = get()
        if res.ids.shape != (len(idx), k):
            raise RuntimeError(f"searcher answered ids of shape {tuple(res.ids.shape)}, expected {(len(idx), k)}")
        rows[position[idx]] = res.ids.numpy()
        scores[position[idx]] = res.scores.float().numpy()
        versions.add(int(res.version))

    for idx, reps in iter_mention_reps(retriever, mentions, indices, batch_size, progress, desc):
        pending.append((idx, submit(reps, k)))
        while len(pending) >= in_flight:
            collect()
    while pending:
        collect()
    return Retrieved(rows, scores, tuple(sorted(versions)))


def ranked_source_ids(store: EntityStore, rows: np.ndarray) -> list[list[str]]:
    """[N, k] entity rows (-1 = empty) -> per mention the KB source ids (KILT wikipedia_id,
    Zeshel document_id), best first, empty slots dropped."""
    rows = np.asarray(rows)
    n, k = rows.shape
    ids = store.source_ids(np.where(rows >= 0, rows, 0).ravel())
    return [[s for s, r in zip(ids[i * k:(i + 1) * k], rows[i]) if r >= 0] for i in range(n)]


# --------------------------------------------------------------------------- in-process index


def default_index_config(retriever: Retriever) -> IndexConfig:
    """Exact search: faiss flat for inner-product presets (dual, multi-m) where faiss is installed, the exact
    torch backend otherwise (the same ranking: a GPU machine with torch alone evaluates and links too)."""
    from dist_nce.cluster.runtime import faiss_installed

    return IndexConfig(backend="flat" if is_inner_product(retriever.spec) and faiss_installed() else "torch")


def build_local_index(
    retriever: Retriever, store: EntityStore, config: IndexConfig | None = None, rows: tuple[int, int] | None = None,
    batch_size: int = 256, progress: bool = True, version: int = 0,
) -> ShardIndex:
    """An in-process ShardIndex over ``store`` rows ``[a, b)`` (default: all), global row ids.

    The rows are encoded by the shards' own loop (``index.encode.encode_rows``, fp32,
    stored in the retriever's storage dtype), so a local index holds what a shard would.
    """
    from tqdm.auto import tqdm

    a, b = (0, len(store)) if rows is None else rows
    retriever.eval()
    with tqdm(total=b - a, desc=f"encode entities [{a}, {b})", unit="entity", disable=not progress,
              mininterval=2.0) as bar:
        reps = encode_rows(retriever.entity_side, store.slice(a, b), batch_size, _device(retriever), None,
                           retriever.config.storage_dtype, progress=lambda done: bar.update(done - bar.n))
    dead = getattr(store, "tombstones", None)  # rows a KB delta removed: never retrieved
    return ShardIndex(retriever.spec, reps, a, config or default_index_config(retriever), version,
                      dead=None if dead is None else torch.as_tensor(dead))


# --------------------------------------------------------------------------- service snapshot


@dataclass(frozen=True)
class SnapshotPlan:
    """Which version the shards should serve for a model, and whether they already do."""

    version: int
    reused: bool


def plan_snapshot(statuses: Sequence[Mapping[str, Any]], fingerprint: str) -> SnapshotPlan:
    """Pick the version at which the shards serve the entity encoder with ``fingerprint``.

    ``statuses``: ``NegativeService.status()`` (per shard: ``served``, ``held``,
    ``persisted``, ``encoder_fingerprint`` of the served version). Shards reload their
    newest persisted version at start whatever weights made it, so a snapshot is reused
    only where its fingerprint matches. If the newest version anywhere is this model's
    (all shards, or some: an interrupted encode), that version is completed; otherwise
    the model gets a new version one past every existing one (versions never go back).
    """
    newest = max((max([s["served"], *s["held"], *s["persisted"]]) for s in statuses), default=-1)
    ours = [s["served"] for s in statuses if s["served"] >= 0 and s["encoder_fingerprint"] == fingerprint]
    version = newest if ours and max(ours) == newest else newest + 1
    reused = all(s["served"] == version and s["encoder_fingerprint"] == fingerprint for s in statuses)
    return SnapshotPlan(version, reused)


def serve_model(service: NegativeSource, retriever: Retriever, progress: bool = True,
                poll_s: float = 1.0) -> SnapshotPlan:
    """Make every shard of ``service`` serve ``retriever``'s entity embeddings.

    Reuses a persisted snapshot of the same weights, else encodes (``refresh``; shards that
    already hold the planned version from these weights return at once). Shows a progress
    bar over all shards' rows while they encode.
    """
    import time

    from tqdm.auto import tqdm

    state = retriever.entity_encoder_state()
    plan = plan_snapshot(service.status(), state_fingerprint(state))
    if plan.reused:
        _serve_current_kb(service, state)
        return plan
    handle = service.refresh(state, plan.version)
    with tqdm(total=service.num_entities, desc=f"encode KB (version {plan.version}, {service.num_shards} shards)",
              unit="entity", disable=not progress, mininterval=2.0) as bar:
        while not handle.done():
            if progress:
                bar.update(sum(d for d, _ in handle.progress()) - bar.n)
            time.sleep(poll_s)
        served = handle.wait()
        bar.update(service.num_entities - bar.n)
    if served != plan.version:
        raise RuntimeError(f"shards serve version {served} after refreshing to {plan.version}")
    _serve_current_kb(service, state)
    return plan


def _serve_current_kb(service: NegativeSource, state: dict) -> None:
    """A store changed by KB deltas since the version the shards serve (a run's persisted index, encoded
    before ``jobs/update_kb.py``): serve its current KB version, as a training run does on start
    (``NegativeService.serve_current_kb``). A source without KB deltas serves what it has."""
    catch_up = getattr(service, "serve_current_kb", None)
    if catch_up is not None:
        catch_up(state)
