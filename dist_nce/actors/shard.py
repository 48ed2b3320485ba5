"""EntityShard: the Ray actor that owns KB rows [a, b), their embeddings and their index.

A thin shell around :mod:`dist_nce.index.encode` (re-encoding), :mod:`dist_nce.index.versions`
(persistence) and :class:`dist_nce.index.search.ShardIndex` (search). The class is plain
Python; :func:`start_shard` makes it a threaded Ray actor:

* ``refresh`` runs in its own concurrency group of one thread, so refreshes are serial
  and never take a search thread; searches run in the default group's
  ``max_concurrency`` threads meanwhile, answered from the version being replaced.
* A refresh encodes, builds the new ShardIndex, PERSISTS the embeddings, and only then
  swaps under a lock: a query never sees a half-built index, and every version a query
  has seen can be reloaded after a crash. Every answer carries the version it came from.
* The last ``keep_versions`` versions stay in memory, and older persisted ones are
  loaded on demand, so the service can ask every shard for the SAME version while the
  shards refresh at different moments.
* Ray restarts a dead shard (``max_restarts``) by running ``__init__`` again, which
  reloads the newest persisted version whose manifest matches (rows, store, spec, dim)
  instead of re-encoding; a call that was in flight is re-run (``max_task_retries``).
  ``refresh(state, v)`` is idempotent: a shard already serving v from the same weights
  (e.g. reloaded after dying mid-call) returns at once.
* A KB delta (``apply_delta``, in the refresh group too) encodes only the rows the service
  placed on this shard, with the weights of the version served (checked by fingerprint),
  persists them as a version that points at the files it reuses, and swaps in a
  :class:`~dist_nce.index.live.LiveIndex` sharing the old pieces: removed rows are excluded
  from that version on. Every version records the KB version it encodes, so a restarted
  shard reloads one consistent (pieces, removed rows, KB version) state.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import ray
import torch
from torch import Tensor

from dist_nce.actors.config import ServiceConfig
from dist_nce.cluster.runtime import actor_runtime_env, configure_process
from dist_nce.actors.errors import NoIndexError, VersionUnavailable  # noqa: F401  (raised here; re-exported)
from dist_nce.core.artifacts import ArtifactMismatch
from dist_nce.index.encode import (Precision, compile_wanted, encode_precision, encode_rows, prepare_encoder,
                                   state_fingerprint, store_fingerprint)
from dist_nce.index.live import LiveIndex
from dist_nce.index.load import load_shard_index
from dist_nce.index.search import ShardIndex
from dist_nce.index.versions import PersistedVersions, shard_dir_name, shard_identity
from dist_nce.modeling.retriever import EntityEncoder, RetrieverConfig
from dist_nce.modeling.scoring import Reps, ScoreSpec
from dist_nce.sampling.topk import ShardResult

log = logging.getLogger(__name__)

REFRESH_GROUP = "refresh"


class _Version(NamedTuple):
    index: LiveIndex
    fingerprint: str | None  # of the encoder state that produced it
    source: str  # "encoded" in this process, or "reloaded" from disk
    origin: str | None = None  # fingerprint of the run's initial encoder state (its lineage)
    manifest: dict | None = None  # its persisted manifest (base_in, pieces: what a delta builds on)


def _device(num_gpus: float) -> torch.device:
    """cuda when Ray gave the actor (a share of) a GPU: Ray sets CUDA_VISIBLE_DEVICES for it."""
    if num_gpus > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"service.num_gpus={num_gpus} but torch sees no CUDA device in the shard process")
        return torch.device("cuda")
    return torch.device("cpu")


def _fetch(state: Any) -> dict[str, Any] | None:
    """An entity state passed as ``[ObjectRef]``: Ray resolves an ObjectRef argument before the
    call runs, which would ship and unpickle every weight for each delta even when this shard
    holds them already; inside a list it stays a reference until a call needs it."""
    if isinstance(state, list):
        state = state[0] if state else None
    return ray.get(state) if isinstance(state, ray.ObjectRef) else state


class ScoredSample(NamedTuple):
    """A shard's Gumbel-top-k answer plus the exact scores of requested rows, both from ONE
    index version (the random part of a mixed-p sample; ``negatives.mixed_from_pool``)."""

    sample: ShardResult
    row_scores: Tensor  # [B, r] float32 s(x_b, y) of the requested rows; NaN where not this shard's

    @property
    def version(self) -> int:
        return self.sample.version


class EntityShard:
    """Rows [a, b) of a prepared store: encoder copy, versions, index (module docstring)."""

    def __init__(self, store_dir: str, rows: tuple[int, int], shard: int, num_shards: int,
                 retriever: RetrieverConfig, config: ServiceConfig, shard_root: str, dim: int, kb_version: int = 0):
        configure_process(config.threads)
        from kb.store import EntityStore

        self.store_dir, self.kb_version = str(store_dir), int(kb_version)  # the KB version rows are cut from
        self._dead_cache: dict[int, torch.Tensor] = {}
        self.shard, self.rows, self.config = shard, (int(rows[0]), int(rows[1])), config
        self.spec: ScoreSpec = retriever.spec()
        self.storage_dtype, self.dim = retriever.storage_dtype, int(dim)
        self.device = _device(config.num_gpus)
        self.index_config = dataclasses.replace(config.index, device=str(self.device))
        self.store = EntityStore(store_dir, kb_version=self.kb_version).slice(*self.rows)
        self.versions = PersistedVersions(Path(shard_root) / shard_dir_name(shard, num_shards), shard_identity(
            self.rows, store_fingerprint(store_dir), dataclasses.asdict(self.spec), self.storage_dtype, self.dim))
        self._encoder: EntityEncoder | None = None
        self._attention: str | None = None  # the attention implementation self._encoder runs
        self._encoder_fp: str | None = None  # fingerprint of the weights self._encoder holds
        self._refresh_lock = threading.Lock()  # one refresh at a time, even outside Ray's groups
        self._cond = threading.Condition()  # guards everything below; notified on every swap
        self._held: dict[int, _Version] = {}
        self._served, self._target = -1, None
        self._encodes, self._progress, self._refused = 0, [0, 0], []
        self._reload_latest()

    # ------------------------------------------------------------------ versions
    def _dead(self, kb_version: int) -> torch.Tensor:
        """Rows removed at ``kb_version`` (sorted int64, global), from the store's tombstones."""
        if kb_version not in self._dead_cache:
            from kb.store import EntityStore

            dead = EntityStore(self.store_dir, kb_version=kb_version).tombstones if kb_version else []
            self._dead_cache[kb_version] = torch.as_tensor(dead, dtype=torch.int64)
        return self._dead_cache[kb_version]

    def _load(self, version: int) -> _Version:
        manifest = self.versions.manifest(version)
        base, _ = load_shard_index(self.versions, int(manifest.get("base_in", version)), self.spec, self.rows[0],
                                   self.index_config)
        pieces = [base] + [ShardIndex(self.spec, self.versions.load_piece(p), p["rows"][0], self.index_config, version)
                           for p in manifest.get("pieces", [])]
        kb_version = int(manifest.get("kb_version", 0))
        index = LiveIndex(pieces, self._dead(kb_version), version, kb_version)
        return _Version(index, manifest.get("encoder_fingerprint"), "reloaded", manifest.get("origin_fingerprint"),
                        manifest)

    def _reload_latest(self) -> None:
        """Serve the newest persisted version that matches this shard, up to the ceiling a rerun that went
        back left (``PersistedVersions.ceiling``: above it, a killed run's versions that the rerun makes
        again); refuse the others loudly."""
        ceiling = self.versions.ceiling()
        for version in reversed(self.versions.versions()):
            if ceiling is not None and version > ceiling:
                continue
            try:
                loaded = self._load(version)
            except ArtifactMismatch as e:
                msg = f"shard {self.shard}: refusing persisted version {version}: {e}"
                self._refused.append(msg)
                log.warning(msg)
                continue
            self._install(version, loaded, mark=False)  # a ceiling stays until a version is made or gone back to
            return

    def _install(self, version: int, held: _Version, serve: bool = True, mark: bool = True) -> None:
        with self._cond:
            self._held[version] = held
            if serve:
                self._served = version
            keep = max(self.config.keep_versions, 1)
            for old in sorted(self._held)[:-keep]:
                if old not in (self._served, version):
                    del self._held[old]
            self._cond.notify_all()
        if serve and mark:
            self.versions.mark_served(version)  # the sequencer runs version-making calls one at a time

    def _index(self, version: int | None, wait_s: float = 0.0, ahead: bool = False) -> LiveIndex:
        """The index to answer from: the served one, or exactly ``version``.

        A version being built by the running refresh is waited for up to ``wait_s``; one
        no longer in memory is reloaded from disk, unless it is newer than the one served (only
        with ``ahead``: ``use_version``): such a version on disk was left by a killed run past the
        checkpoint its rerun went back to, and the rerun makes it again (actors.sequencer), so an
        answer from it could mix two encodings under one number.
        """
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if version is None:
                    if self._served < 0:
                        raise NoIndexError(f"shard {self.shard} rows {list(self.rows)} has no index yet; "
                                           "call NegativeService.ensure_encoded or refresh first")
                    return self._held[self._served].index
                if version in self._held:
                    return self._held[version].index
                remaining = deadline - time.monotonic()
                if self._target is None or self._target < version or remaining <= 0:
                    break
                self._cond.wait(remaining)
        if version in self.versions.versions() and (ahead or version <= self._served):
            try:
                loaded = self._load(version)
            except ArtifactMismatch as e:
                raise VersionUnavailable(f"shard {self.shard}: version {version}: {e}") from None
            self._install(version, loaded, serve=False)
            return loaded.index
        raise VersionUnavailable(f"shard {self.shard} does not hold version {version} (serving {self._served}, "
                                 f"in memory {sorted(self._held)}, persisted {self.versions.versions()})")

    # ------------------------------------------------------------------ refresh
    def _encoder_for(self, state: dict[str, Any], fingerprint: str | None = None) -> EntityEncoder:
        """The encoder with ``state``'s weights: built once per actor, then weights swapped in place."""
        if ScoreSpec(**state["spec"]) != self.spec:
            raise ValueError(f"shard {self.shard}: entity state has spec {state['spec']}, the service was "
                             f"created for {self.spec}")
        hidden = state["transformer_config"].get("hidden_size")
        if hidden != self.dim:
            raise ValueError(f"shard {self.shard}: entity state has hidden size {hidden}, the service was "
                             f"created for d={self.dim}")
        fingerprint = fingerprint or state_fingerprint(state)
        if self._encoder is None:
            encoder = EntityEncoder.from_state(state)
            self._attention = prepare_encoder(
                encoder, self._precision(), self.config.encode_attention,
                compile_wanted(self.config.encode_compile, self.device, self.config.encode_pack), self.device,
                pack=self.config.encode_pack)
            self._encoder = encoder
        elif self._encoder_fp != fingerprint:  # same architecture: swap the weights in place (cast to their dtype)
            self._encoder.load_state(state)
        self._encoder_fp = fingerprint
        return self._encoder

    def _precision(self) -> Precision:
        """Weights dtype and autocast of this shard's encodes (service.encode_dtype, encode_weights)."""
        return encode_precision(self.config.encode_dtype, self.config.encode_weights, self.device)

    def _encoder_with(self, fingerprint: str, state: Any) -> EntityEncoder | None:
        """The encoder holding the weights ``fingerprint``: the one this actor holds, else one
        from ``state`` when it has them; None otherwise. ``state`` is fetched only here, and
        only when the held encoder is not already those weights (:func:`_fetch`)."""
        if self._encoder is not None and self._encoder_fp == fingerprint:
            return self._encoder
        state = _fetch(state)
        if state is not None and state_fingerprint(state) == fingerprint:
            return self._encoder_for(state, fingerprint)
        return None

    @ray.method(concurrency_group=REFRESH_GROUP)
    def hold_encoder(self, state: Any, fingerprint: str | None = None) -> str | None:
        """Build (or keep) the encoder of ``state`` without encoding anything: a shard that
        reloaded its versions from disk is then ready to encode a KB delta with the weights it
        serves, as one that encoded them is. ``fingerprint`` (of ``state``) skips the fetch
        when it is held already. Returns the fingerprint of the weights held."""
        with self._refresh_lock:
            if fingerprint is None or self._encoder_fp != fingerprint:
                state = _fetch(state)
                self._encoder_for(state, fingerprint)
            return self._encoder_fp

    @ray.method(concurrency_group=REFRESH_GROUP)
    def refresh(self, state: dict[str, Any], version: int, origin: str | None = None) -> int:
        """Serve ``version`` encoded by ``state`` (``EntityEncoder.state()``); blocks until swapped.

        Reuses a persisted copy made from the same weights; otherwise encodes, persists,
        swaps. ``origin``: the fingerprint of the run's initial encoder state, recorded with
        the version so that a restarted run can tell its own versions from another run's.
        Returns the version now served.
        """
        version = int(version)
        if version < 0:
            raise ValueError(f"shard {self.shard}: versions are >= 0, got {version}")
        with self._refresh_lock:
            with self._cond:
                if version < self._served:
                    raise ValueError(f"shard {self.shard}: refresh to version {version}, but version "
                                     f"{self._served} is served already; versions must increase")
                self._target = version  # queries asking for this version wait instead of failing
                held = self._held.get(self._served)
                self._progress = [0, held.index.num_rows if held else self.store.num_entities]
            try:
                return self._refresh(state, version, origin)
            finally:
                with self._cond:
                    self._target = None
                    self._cond.notify_all()

    def _refresh(self, state: dict[str, Any], version: int, origin: str | None) -> int:
        fp = state_fingerprint(state)
        with self._cond:
            if version == self._served:
                if self._held[version].fingerprint == fp:
                    return version
                # Encoding over it would give one version number two encodings while the other shards
                # still serve the first (a search merged over shards would mix them).
                raise ValueError(f"shard {self.shard}: refresh to version {version}, which it serves already "
                                 "from other weights; versions must increase")
        if self._persisted_with(version, fp):
            self._install(version, self._load(version))
            return version
        index = self._encode(state, version, fp, origin)
        self._encodes += 1
        self._install(version, _Version(index, fp, "encoded", origin, self.versions.manifest(version)))
        return version

    def _persisted_with(self, version: int, fingerprint: str) -> bool:
        if version not in self.versions.versions():
            return False
        try:
            return self.versions.manifest(version).get("encoder_fingerprint") == fingerprint
        except ArtifactMismatch:
            return False

    def _layout(self) -> tuple[int, list[tuple[int, int]]]:
        """(KB version, appended ranges) of the version served: what a full refresh re-encodes."""
        with self._cond:
            held = self._held.get(self._served)
        if held is None:
            return self.kb_version, []
        return held.index.kb_version, [r for r in held.index.ranges if r[0] >= self.rows[1]]

    def _encode_ranges(self, encoder: EntityEncoder, ranges: list[tuple[int, int]], kb_version: int,
                       autocast) -> list[tuple[int, int, Reps]]:
        from kb.store import EntityStore

        store = EntityStore(self.store_dir, kb_version=kb_version)
        # an encoder compiled with static shapes fills a delta's batches up to the refresh's own batch:
        # its graphs, whatever the delta's size (encode_rows' fill_to)
        fill = min(self.config.encode_batch_size, max(1, self.store.num_entities))
        out, done = [], self._progress[0]
        for a, b in ranges:
            reps = encode_rows(encoder, store.slice(a, b), self.config.encode_batch_size, self.device, autocast,
                               self.storage_dtype, progress=lambda k, base=done: self._set_progress(base + k),
                               fill_to=fill)
            out.append((a, b, reps))
            done += b - a
        return out

    def _encode(self, state: dict[str, Any], version: int, fingerprint: str, origin: str | None) -> LiveIndex:
        encoder = self._encoder_for(state, fingerprint)
        precision = self._precision()
        autocast = precision.autocast
        kb_version, appended = self._layout()
        t0 = time.perf_counter()
        reps = encode_rows(encoder, self.store, self.config.encode_batch_size, self.device, autocast,
                           self.storage_dtype, progress=self._set_progress)
        pieces = self._encode_ranges(encoder, appended, kb_version, autocast)
        seconds = time.perf_counter() - t0
        # Persist before the swap: every version a query can see survives a restart.
        self.versions.save(version, reps, pieces, encoder_fingerprint=fingerprint, origin_fingerprint=origin,
                           encode_seconds=round(seconds, 3), kb_version=kb_version,
                           encode_dtype=precision.label,
                           encode_weights=str(precision.weights).removeprefix("torch."),
                           encode_attention=self._attention,
                           device=str(self.device))
        self.versions.prune(self.config.keep_versions, protect=frozenset({self._served, version}))
        del reps  # built from the file just written: one copy of the vectors at the peak (index/load.py)
        base = load_shard_index(self.versions, version, self.spec, self.rows[0], self.index_config)[0]
        extra = [ShardIndex(self.spec, p, a, self.index_config, version) for a, _, p in pieces]
        return LiveIndex([base, *extra], self._dead(kb_version), version, kb_version)

    # ------------------------------------------------------------------ KB deltas
    @ray.method(concurrency_group=REFRESH_GROUP)
    def apply_delta(self, state: Any, version: int, kb_version: int, new_ranges: list[tuple[int, int]]) -> int:
        """Serve ``version``: the served version plus ``new_ranges`` (rows a KB delta added and the
        service placed here), encoded with the served version's weights (the encoder this shard
        holds when it has them, else ``state``: a dict, or ``[ObjectRef]`` fetched only then), and
        the rows removed at ``kb_version`` excluded. Idempotent; returns the version served."""
        version, kb_version = int(version), int(kb_version)
        new_ranges = [(int(a), int(b)) for a, b in new_ranges]
        with self._refresh_lock:
            with self._cond:
                if self._served < 0:
                    raise NoIndexError(f"shard {self.shard}: no version to apply a KB delta to; encode first")
                held = self._held[self._served]
                if self._served == version and held.index.kb_version == kb_version:
                    return version
                if version <= self._served:
                    raise ValueError(f"shard {self.shard}: KB delta as version {version}, but version "
                                     f"{self._served} is served already; versions must increase")
                self._target = version
                self._progress = [0, sum(b - a for a, b in new_ranges)]
            try:
                return self._apply_delta(state, version, kb_version, new_ranges, held)
            finally:
                with self._cond:
                    self._target = None
                    self._cond.notify_all()

    @ray.method(concurrency_group=REFRESH_GROUP)
    def check_delta(self, state: Any, kb_version: int, new_ranges: list[tuple[int, int]]) -> int:
        """Raise what :meth:`apply_delta` would refuse with (no index, an older KB version, rows it owns, no
        encoder with the served weights), changing nothing: the sequencer asks every shard before any applies
        a delta, so a delta is applied on all shards or none (actors.sequencer). An encoder built from
        ``state`` for the check is kept (the delta needs it next). Returns the version served (the one a delta
        that then fails on another shard goes back to)."""
        with self._refresh_lock:
            with self._cond:
                if self._served < 0:
                    raise NoIndexError(f"shard {self.shard}: no version to apply a KB delta to; encode first")
                served, held = self._served, self._held[self._served]
            self._delta_work(state, int(kb_version), [(int(a), int(b)) for a, b in new_ranges], held)
            return served

    def _delta_work(self, state: Any, kb_version: int, new_ranges: list[tuple[int, int]], held: _Version
                    ) -> tuple[EntityEncoder | None, list[tuple[int, int]]]:
        """(the encoder, the rows to encode) of a delta on ``held``; raises what makes it impossible."""
        fp = held.fingerprint
        encoder = self._encoder_with(fp, state) if new_ranges and fp is not None else None
        if new_ranges and encoder is None:  # removals only need no encoder
            raise ValueError(f"shard {self.shard}: a KB delta must be encoded with the weights of the version served "
                             f"({self._served}); pass them (entity_state): the state given is "
                             f"{'another one' if state is not None else 'missing'} and this shard holds no encoder "
                             "with those weights")
        if held.index.kb_version > kb_version:
            raise ValueError(f"shard {self.shard}: serving KB version {held.index.kb_version}, asked for {kb_version}")
        owned = held.index.ranges
        if held.index.kb_version == kb_version and new_ranges and all(tuple(r) in owned for r in new_ranges):
            # Applied already, under an earlier number, by a call that failed on another shard and could not be
            # rolled back here (IndexSequencer._roll_back): asked again, serve it under this number (nothing to
            # encode) so that every shard serves the same one.
            new_ranges = []
        for a, b in new_ranges:
            if a >= b or any(a < y and x < b for x, y in owned):
                raise ValueError(f"shard {self.shard}: new rows [{a}, {b}) overlap the rows it owns {owned}")
        return encoder, new_ranges

    def _apply_delta(self, state: Any, version: int, kb_version: int, new_ranges: list[tuple[int, int]],
                     held: _Version) -> int:
        fp = held.fingerprint
        encoder, new_ranges = self._delta_work(state, kb_version, new_ranges, held)
        if version in self.versions.versions():  # a retry after the version was persisted
            try:
                m = self.versions.manifest(version)
                if m.get("kb_version") == kb_version and m.get("encoder_fingerprint") == fp:
                    self._install(version, self._load(version))
                    return version
            except ArtifactMismatch:
                pass
        autocast = self._precision().autocast
        t0 = time.perf_counter()
        new = self._encode_ranges(encoder, new_ranges, kb_version, autocast) if new_ranges else []
        base = held.manifest or self.versions.manifest(self._served)
        manifest = self.versions.save_delta(version, base, new, encoder_fingerprint=fp, origin_fingerprint=held.origin,
                                            kb_version=kb_version, encode_seconds=round(time.perf_counter() - t0, 3),
                                            delta_rows=[[a, b] for a, b, _ in new], device=str(self.device))
        self.versions.prune(self.config.keep_versions, protect=frozenset({self._served, version}))
        pieces = [*held.index.pieces, *(ShardIndex(self.spec, p, a, self.index_config, version) for a, _, p in new)]
        index = LiveIndex(pieces, self._dead(kb_version), version, kb_version)
        self._encodes += 1
        self._install(version, _Version(index, fp, "encoded", held.origin, manifest))
        return version

    def _set_progress(self, done: int) -> None:
        self._progress = [done, self._progress[1]]

    def use_version(self, version: int) -> int:
        """Serve ``version`` from memory or disk (``NegativeService.ensure_encoded`` aligning
        shards at start-up; may go back to an older version). Returns it."""
        version = int(version)
        self._index(version, ahead=True)  # loads it from disk if needed
        with self._cond:
            if version not in self._held:  # evicted in between: load again
                self._held[version] = self._load(version)
            self._served = version
            for newer in [v for v in self._held if v > version]:  # made again from here on (_index)
                del self._held[newer]
            self._cond.notify_all()
        self.versions.mark_served(version)  # and a restart serves this one, not those (_reload_latest)
        return version

    def lineage(self) -> dict[int, dict[str, str | None]]:
        """Every version held in memory or validly persisted -> ``{"encoder": fingerprint of the
        state that encoded it, "origin": fingerprint of its run's initial state}``."""
        with self._cond:
            out = {v: {"encoder": h.fingerprint, "origin": h.origin} for v, h in self._held.items()}
        for v in self.versions.valid_versions():
            if v not in out:
                try:
                    m = self.versions.manifest(v)
                except ArtifactMismatch:  # pruned or replaced meanwhile
                    continue
                out[v] = {"encoder": m.get("encoder_fingerprint"), "origin": m.get("origin_fingerprint")}
        return out

    # ------------------------------------------------------------------ queries
    def topk(self, queries: Reps | Tensor, k: int, gold: Tensor | None = None, version: int | None = None,
             wait_s: float = 0.0) -> ShardResult:
        """This shard's exact (or backend) top k, gold excluded; see ``ShardIndex.topk``."""
        return self._index(version, wait_s).topk(queries, k, gold)

    def gumbel_topk(self, queries: Reps | Tensor, k: int, gold: Tensor | None, seed: int, query_keys: Tensor,
                    version: int | None = None, wait_s: float = 0.0) -> ShardResult:
        """This shard's part of an exact Gumbel-top-k sample; see ``ShardIndex.gumbel_topk``."""
        return self._index(version, wait_s).gumbel_topk(queries, k, gold, seed, query_keys)

    def gumbel_topk_scored(self, queries: Reps | Tensor, k: int, gold: Tensor | None, seed: int,
                           query_keys: Tensor, rows: Tensor, version: int | None = None,
                           wait_s: float = 0.0) -> ScoredSample:
        """:meth:`gumbel_topk` and :meth:`score_rows` of ``rows`` [B, r] from the same index, so
        a mixed-p sample never needs a version again after the answer (it may be gone by then)."""
        index = self._index(version, wait_s)
        sample = index.gumbel_topk(queries, k, gold, seed, query_keys)
        return ScoredSample(sample, self._owned_scores(index, queries, rows))

    def lse_grad(self, queries: Reps | Tensor, rows: Tensor | None = None, version: int | None = None,
                 wait_s: float = 0.0) -> LseGradPart:
        """This shard's part of d/dq log-sum-exp s(x, .) (the bias monitor, ``dist_nce.bias.gradbias``):
        over all its rows (``rows`` None) or over the rows it owns of global ``rows`` [B, S, K]."""
        index = self._index(version, wait_s)
        part = index.lse_grad(queries, rows)
        return LseGradPart(part.lse, part.grad, index.version)

    def score_rows(self, queries: Reps | Tensor, rows: Tensor, version: int) -> Tensor:
        """Exact s(x_b, y) [B, r] float32 for global ``rows`` [B, r]; NaN where a row is not this shard's."""
        return self._owned_scores(self._index(version), queries, rows)

    def _owned_scores(self, index: LiveIndex, queries: Reps | Tensor, rows: Tensor) -> Tensor:
        owned = index.owns(rows)
        scores = index.score_rows(queries, torch.where(owned, rows, self.rows[0]))
        return scores.masked_fill(~owned, float("nan"))

    # ------------------------------------------------------------------ introspection
    def status(self) -> dict[str, Any]:
        """What the shard holds and how it got it (``source``: encoded / reloaded / none)."""
        with self._cond:
            served = self._held.get(self._served)
            out = {"shard": self.shard, "rows": list(self.rows), "pid": os.getpid(), "device": str(self.device),
                   "served": self._served, "source": served.source if served else "none",
                   "encoder_fingerprint": served.fingerprint if served else None, "held": sorted(self._held),
                   "encoder_held": self._encoder_fp,
                   "refreshing": self._target, "encodes": self._encodes, "progress": list(self._progress),
                   "refused": list(self._refused),
                   "kb_version": served.index.kb_version if served else None,
                   "pieces": [list(r) for r in served.index.ranges] if served else [list(self.rows)],
                   "live": served.index.num_live if served else None}
        out["node"] = ray.get_runtime_context().get_node_id()  # which Ray node holds these rows
        out["persisted"] = self.versions.valid_versions()
        return out


class LseGradPart(NamedTuple):
    """A shard's (lse, grad) for the bias monitor (``dist_nce.bias.gradbias.LseGrad``) and its version."""

    lse: Tensor
    grad: Tensor
    version: int


def actor_options(config: ServiceConfig) -> dict[str, Any]:
    """Ray options of a shard actor, all from ``config``."""
    return {
        "num_cpus": config.num_cpus,
        "num_gpus": config.num_gpus,
        "resources": dict(config.resources),
        "max_restarts": config.max_restarts,
        "max_task_retries": config.max_task_retries,
        "max_concurrency": config.max_concurrency,  # the default group: searches, status
        "runtime_env": actor_runtime_env(),
        # Shards hold large embedding matrices and encode in parallel: spread them over nodes.
        "scheduling_strategy": "SPREAD",
    }


def start_shard(store_dir: str, rows: tuple[int, int], shard: int, num_shards: int, retriever: RetrieverConfig,
                config: ServiceConfig, shard_root: str, dim: int, kb_version: int = 0):
    """An :class:`EntityShard` actor handle (creation is asynchronous; call ``status`` to wait)."""
    # Concurrency groups can only be declared here, not in .options().
    actor = ray.remote(concurrency_groups={REFRESH_GROUP: 1})(EntityShard).options(**actor_options(config))
    return actor.remote(str(store_dir), rows, shard, num_shards, retriever, config, str(shard_root), dim, kb_version)
