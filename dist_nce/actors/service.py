"""NegativeService: negatives and top-k over the whole KB from S EntityShard actors.

The driver creates the service once (:meth:`NegativeService.create`); the object holds
only actor handles and small metadata, so it pickles into Ray Train's
``train_loop_config`` and every worker calls the same shards. Calls return futures at
once, so a trainer keeps several requests in flight; the cross-shard merge
(``topk.merge_results``) and the samplers of :mod:`dist_nce.sampling.negatives` run in
``result()``, in the caller's process. Each answer is consistent with ONE index version
(:mod:`dist_nce.actors.calls`), which it reports.

Mining: the service is a ``SampleSource`` (:mod:`dist_nce.sampling.samplers`): ``draw(sampler,
...)`` hands it to a sampler of :mod:`dist_nce.sampling.modes`, which asks :meth:`gumbel` for
the exact sample; ``mine`` picks the sampler from K-1 = n_hard + n_random negatives per mention:

* random (n_hard = 0): uniform without the gold, drawn in the caller; no shard is asked
  and the reported version is -1;
* hard (n_random = 0): the exact Gumbel-top-k sample of the whole KB minus the gold,
  each shard drawing from its rows with the same counter-based noise;
* mixed: ``negatives.mixed_from_pool`` with the per-draw MIXTURE proposal. The random part
  comes from a pool of K-1 uniform rows drawn in the caller BEFORE the shards answer, sent
  with the Gumbel query (``EntityShard.gumbel_topk_scored``): each shard scores the pool
  rows it owns from the same index version as its sample, so ``result()`` needs no second
  round trip and no version that a refresh may have retired in between.

KB deltas (:meth:`NegativeService.apply_delta`): after ``kb.delta`` wrote KB version v of the
store, the service places the new rows on the least-loaded shards in whole grid blocks
(``actors.placement``), and every shard serves a new index version holding its new rows,
encoded with the weights it serves, and excluding every row removed at v, without
stopping: searches keep being answered from the previous version until the swap. From
that version on, random negatives are uniform over the live rows (``dist_nce.sampling.live_rows``).
A service object copied elsewhere (a Train worker's) follows with :meth:`sync_kb`.

Example (driver)::

    service = NegativeService.create("data/prepared/aida", retriever_config, service_config, run_dir)
    service.ensure_encoded(retriever.entity_encoder_state())
    fut = service.mine(mention_reps, gold, n_hard=32, n_random=31, seed=step, query_keys=keys)
    negs = fut.result().negatives          # ids [B, 63], log_q, hard
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError
from torch import Tensor

from dist_nce.actors.calls import FanOut, RetryPolicy, ShardCall, cause
from dist_nce.actors.config import ServiceConfig
from dist_nce.actors.placement import place_rows
from dist_nce.actors.sequencer import start_sequencer
from dist_nce.actors.shard import LseGradPart, ScoredSample, VersionUnavailable, start_shard
from dist_nce.bias.gradbias import merge as merge_lse_grad
from dist_nce.modeling.retriever import RetrieverConfig
from dist_nce.modeling.scoring import Reps, ScoreSpec, is_inner_product
from dist_nce.sampling.live_rows import LiveRows
from dist_nce.sampling.modes import sampler_for_split
from dist_nce.sampling.negatives import num_hard
from dist_nce.sampling.samplers import GumbelDraw, MineResult, Pending, Sampler, Then
from dist_nce.sampling.topk import merge_results


class MineFuture(Then):
    """``result() -> GumbelDraw`` (merged over shards; the samplers finish it into a MineResult)."""


class TopkFuture(Then):
    """``result() -> ShardResult`` (merged over shards, with its version)."""


class LseGradFuture(Then):
    """``result() -> LseGradPart`` (lse, grad merged over shards, version)."""


class RefreshHandle:
    """Shards re-encoding for one version, numbered by the service's sequencer (``version``).
    ``done()`` never blocks; ``wait()`` returns the version now served (raises what a shard
    failed with); ``progress()`` gives (rows encoded, rows) per shard."""

    def __init__(self, service: "NegativeService", ticket: dict[str, Any], state_ref: Any):
        self._service, self._state_ref = service, state_ref
        self.version = int(ticket["version"])
        self._ref = service._sequencer.wait.remote(ticket["ticket"])
        self._served: int | None = None

    def done(self) -> bool:
        return self._served is not None or bool(ray.wait([self._ref], num_returns=1, timeout=0)[0])

    def wait(self, timeout: float | None = None) -> int:
        if self._served is None:
            try:
                self._served = int(ray.get(self._ref, timeout=timeout))
            except GetTimeoutError as e:
                raise TimeoutError(f"refresh to index version {self.version}: not done within {timeout} s "
                                   "(still running; call wait() again)") from e
            self._state_ref = None
        return self._served

    def progress(self) -> list[tuple[int, int]]:
        """(rows done, rows) per shard; a shard that reused a persisted version counts as done."""
        out = []
        for status, (a, b) in zip(self._service.status(), self._service.ranges):
            if status["served"] >= self.version:
                out.append((b - a, b - a))
            elif status["refreshing"] == self.version:
                out.append((status["progress"][0], b - a))
            else:
                out.append((0, b - a))
        return out


def even_ranges(n: int, parts: int, grid: int = 1) -> list[tuple[int, int]]:
    """[a_i, b_i) contiguous ranges covering [0, n): sizes differing by at most one (``grid`` 1),
    or every inner boundary on the ``grid`` (the nearest multiple to the even split).

    The block sampler (``IndexConfig.row_grid``) needs shards to start on its block grid for
    sharded == flat bit for bit (``sampling.block_gumbel``, "Sharded == flat"). Raises when the
    grid leaves a range empty (n too small for ``parts`` ranges of at least one grid step).
    """
    if grid < 1:
        raise ValueError(f"even_ranges: grid must be >= 1, got {grid}")
    cuts = [0] + [min(n, (i * n // parts + grid // 2) // grid * grid) for i in range(1, parts)] + [n]
    ranges = list(zip(cuts[:-1], cuts[1:]))
    if any(a >= b for a, b in ranges):
        raise ValueError(f"{n} rows cannot be split into {parts} non-empty ranges on a grid of {grid} rows "
                         f"(lower index.block_rows or the shard count): {ranges}")
    return ranges


def entity_dim(config: RetrieverConfig) -> int:
    """The vector width the shards are created with when the caller gives none: the hidden size in the
    config.json of ``config``'s entity model (its mention model, else the default model)."""
    return _hidden_size(_model_dir(config))


def _model_dir(config: RetrieverConfig) -> str:
    from dist_nce.core.models import default_model_dir

    return config.entity_model or config.mention_model or default_model_dir()


def _hidden_size(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir, local_files_only=True).hidden_size)


class NegativeService:
    """S shard handles + what the caller needs to validate and merge (see module docstring)."""

    def __init__(self, handles: list, ranges: list[tuple[int, int]], spec: ScoreSpec, dim: int,
                 config: ServiceConfig, store_dir: str | None = None, live: LiveRows | None = None,
                 kb_version: int = 0, sequencer: Any = None):
        self._handles, self.ranges, self.spec, self.dim, self.config = list(handles), list(ranges), spec, dim, config
        self.num_entities = ranges[-1][1]  # the row space (removed rows included: row ids never move)
        self.num_shards = len(handles)
        self.store_dir, self.kb_version = store_dir, int(kb_version)
        self.live = live if live is not None else LiveRows.full(self.num_entities)
        self.pieces: list[list[tuple[int, int]]] = [[r] for r in self.ranges]  # each shard's row ranges
        self._state_ref: Any = None  # the entity weights last encoded (this process only; not pickled)
        self._policy = RetryPolicy(config.max_task_retries, config.call_timeout_s, config.call_timeout_s)
        # Every version-making call (refresh, KB delta) goes through this one actor (actors.sequencer).
        self._sequencer = sequencer
        # Fingerprint of the run's initial entity-encoder state (set by ensure_encoded): every
        # version this service encodes records it, so a restarted run recognises its versions.
        self._origin: str | None = None

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, store_dir: str, retriever_config: RetrieverConfig, config: ServiceConfig, run_dir: str, *,
               dim: int | None = None, tokenizer_sha256: str | None = None) -> "NegativeService":
        """Start ``config.num_shards`` shards over an even contiguous split of the store (driver only).

        Shards persist versions under ``config.shard_dir`` (default ``<run_dir>/shards``);
        shards that find persisted versions there reload the newest matching one. The
        entity dimension d and the tokenizer the store must have been prepared with are
        read from the retriever config's model directory unless given (``dim``,
        ``tokenizer_sha256``: e.g. for a saved retriever directory).
        """
        from kb.store import EntityStore

        from dist_nce.core.text import load_tokenizer, tokenizer_fingerprint

        config.validate()
        retriever_config.validate()
        spec = retriever_config.spec()
        if config.index.backend != "torch" and not is_inner_product(spec):
            raise ValueError(f"service.index.backend={config.index.backend!r} serves inner-product scores only; "
                             f"preset {retriever_config.preset!r} ({spec}) needs backend 'torch'")
        model_dir = _model_dir(retriever_config) if dim is None or tokenizer_sha256 is None else None
        if tokenizer_sha256 is None:
            tokenizer_sha256 = tokenizer_fingerprint(load_tokenizer(model_dir))["sha256"]
        store = EntityStore(store_dir, tokenizer_sha256=tokenizer_sha256)
        # Shards own even ranges of the lineage's version-0 rows, whatever deltas came since: the layout
        # (and so every persisted version) stays the same across deltas and driver restarts. Rows added
        # later are pieces placed by apply_delta (ensure_encoded catches a fresh run up to the store).
        n = int(store.manifest["entities"]["count"])
        if store.num_live < config.num_shards + 1:
            raise ValueError(f"{store_dir}: {n} entities cannot be split into {config.num_shards} shards "
                             "with negatives to spare")
        ranges = even_ranges(n, config.num_shards, config.index.row_grid(n, config.num_shards))
        shard_root = Path(config.shard_dir or Path(run_dir) / "shards")
        dim = _hidden_size(model_dir) if dim is None else int(dim)
        handles = [start_shard(str(store_dir), r, i, config.num_shards, retriever_config, config, str(shard_root),
                               dim) for i, r in enumerate(ranges)]
        sequencer = start_sequencer(handles, RetryPolicy(config.max_task_retries, config.call_timeout_s,
                                                         config.call_timeout_s))
        service = cls(handles, ranges, spec, dim, config, str(store_dir), sequencer=sequencer)
        service.sync_kb()  # surfaces a shard that failed to start; follows a reloaded version's KB version
        return service

    # ------------------------------------------------------------------ versions
    def status(self) -> list[dict]:
        """Each shard's ``EntityShard.status()`` (served version, how obtained, progress, ...)."""
        calls = [ShardCall(h, i, "status", (), {}, self._policy) for i, h in enumerate(self._handles)]
        return [c.get() for c in calls]

    def version(self) -> int:
        """The version every shard can answer from consistently (-1 before the first encode)."""
        served = [s["served"] for s in self.status()]
        return -1 if min(served) < 0 else min(served)

    def refresh(self, entity_state: dict | Any, version: int | None = None, wait: bool = False,
                after: int = -1) -> RefreshHandle:
        """Every shard re-encodes its rows with ``entity_state`` (``Retriever.entity_encoder_state()``
        or an ObjectRef of it) as ``version``; queries keep being answered from the previous
        version meanwhile. Shards already holding ``version`` from the same weights skip it.

        ``version`` None (a trainer's refresh): the sequencer numbers it past every version a shard
        serves or builds, every one it numbered (a KB delta's too) and ``after``; ``handle.version``
        says which.
        Refreshes and deltas reach every shard in the order they were numbered (actors.sequencer)."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"refresh: version must be None or an int >= 0, got {version!r}")
        if isinstance(entity_state, dict):
            self._check_state(entity_state)
            state_ref = ray.put(entity_state)
        elif isinstance(entity_state, ray.ObjectRef):
            state_ref = entity_state
        else:
            raise TypeError(f"refresh: entity_state must be a dict (Retriever.entity_encoder_state()) or an "
                            f"ObjectRef of one, got {type(entity_state).__name__}")
        ticket = ray.get(self._sequencer.submit_refresh.remote([state_ref], self._origin, version, int(after)))
        handle = RefreshHandle(self, ticket, state_ref)
        self._state_ref = state_ref
        if wait:
            handle.wait()
        return handle

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_state_ref"] = None  # the weights stay with the driver; copies re-read nothing big
        return state

    # ------------------------------------------------------------------ KB deltas
    def apply_delta(self, kb_version: int | None = None, entity_state: dict | Any = None) -> int:
        """Serve KB version ``kb_version`` of the store (default: its current one) as a new index
        version, without stopping (module docstring); returns that index version.

        Only the rows added since the served KB version are encoded, with ``entity_state`` or,
        by default, the weights this service last encoded (a shard that encoded the served
        version itself also keeps them); they must be the weights of the version served.
        Waits until every shard serves the new version; searches meanwhile answer from the old one.
        """
        from kb.store import EntityStore

        if self.store_dir is None:
            raise ValueError("apply_delta: this service was not created from a store directory")
        self.sync_kb()  # what the shards serve: a resumed run may have gone back to an older KB version
        store = EntityStore(self.store_dir, kb_version=kb_version)
        if store.kb_version < self.kb_version:
            raise ValueError(f"apply_delta: the service serves KB version {self.kb_version}; cannot go back to "
                             f"{store.kb_version}")
        if store.kb_version == self.kb_version:
            return self.version()
        live = LiveRows(store.num_entities, torch.as_tensor(store.tombstones, dtype=torch.int64))
        if live.num_live < self.num_shards + 1:
            raise ValueError(f"apply_delta: KB version {store.kb_version} leaves {live.num_live} live entities for "
                             f"{self.num_shards} shards")
        first, count = self.num_entities, store.num_entities
        loads = [sum(b - a for a, b in rs) - sum(int(((live.dead >= a) & (live.dead < b)).sum()) for a, b in rs)
                 for rs in self.pieces]
        tail = next((i for i, rs in enumerate(self.pieces) for a, b in rs if a < first <= b), None)
        grid = self.config.index.row_grid(self.ranges[-1][1], self.num_shards)  # the grid create() split on
        placed = place_rows(first, count, loads, grid, tail)
        state = self._state_ref if entity_state is None else entity_state
        if isinstance(state, dict):
            self._check_state(state)
            state = ray.put(state)
        # Boxed: a shard already holding the served weights never fetches them (EntityShard._fetch).
        boxed = None if state is None else [state]
        # Numbered and run in order with the trainer's refreshes (actors.sequencer): a delta never takes a
        # refresh's number. Checked on every shard first, it is applied on all or none; one that failed on some
        # shards after the checks was rolled back on every shard (the sequencer), and may be asked for again.
        ticket = ray.get(self._sequencer.submit_delta.remote(boxed, store.kb_version, placed))
        served = int(ray.get(self._sequencer.wait.remote(ticket["ticket"])))
        self.pieces = [rs + new for rs, new in zip(self.pieces, placed)]
        self.num_entities, self.live, self.kb_version = count, live, store.kb_version
        return served

    def sync_kb(self, kb_version: int | None = None) -> int:
        """Follow the KB version the shards serve (a copy of the service in another process, after
        the driver's :meth:`apply_delta`); returns it. ``kb_version``: follow that one instead, where it is
        not above the one served (a resumed worker that had not yet used a delta's negatives at its
        checkpoint: its random negatives stay on the live rows it drew them from, train.kb_follow)."""
        from kb.store import EntityStore

        status = self.status()
        if any(s["kb_version"] is None for s in status):  # nothing served yet: the store's version stands
            return self.kb_version
        served = min(s["kb_version"] for s in status)
        want = served if kb_version is None else min(int(kb_version), served)
        if want != self.kb_version and self.store_dir is not None:
            store = EntityStore(self.store_dir, kb_version=want)
            self.live = LiveRows(store.num_entities, torch.as_tensor(store.tombstones, dtype=torch.int64))
            self.num_entities, self.kb_version = store.num_entities, want
            if want == served:  # the driver's placement of the rows (apply_delta); a follower's copy needs none
                self.pieces = [[tuple(r) for r in s["pieces"]] for s in status]
        return self.kb_version

    def _check_state(self, state: dict) -> None:
        hidden = (state.get("transformer_config") or {}).get("hidden_size")
        if hidden != self.dim:
            raise ValueError(f"refresh: entity state has hidden size {hidden}, the service was created for "
                             f"d={self.dim}")
        if ScoreSpec(**state.get("spec", {})) != self.spec:
            raise ValueError(f"refresh: entity state has spec {state.get('spec')}, the service serves {self.spec}")

    def ensure_encoded(self, entity_state: dict | Any, version: int = 0) -> int:
        """Make every shard serve one version consistent with ``entity_state`` (the run's
        initial entity encoder), encoding only what no shard holds; return that version.

        1. every shard holds ``version`` encoded from exactly these weights: serve it;
        2. else, if the shards share a NEWER version descended from these weights (a resumed
           run: the trainer encoded it from later weights of the same run): serve the newest;
        3. else encode ``entity_state``, as ``version`` if no shard holds it (or holds it from
           these same weights: an interrupted encode, which is reused) and nothing newer,
           otherwise as one past the newest version any shard holds, so versions never go
           back and a version number never names two different encodings. Versions left by
           another model or run in the same shard directory are thus never served.
        """
        from dist_nce.index.encode import state_fingerprint

        state = ray.get(entity_state) if isinstance(entity_state, ray.ObjectRef) else entity_state
        if not isinstance(state, dict):
            raise TypeError(f"ensure_encoded: entity_state must be a dict (Retriever.entity_encoder_state()) or an "
                            f"ObjectRef of one, got {type(state).__name__}")
        self._check_state(state)
        fp = state_fingerprint(state)
        calls = [ShardCall(h, i, "lineage", (), {}, self._policy) for i, h in enumerate(self._handles)]
        lineage = [c.get() for c in calls]
        common = set.intersection(*(set(versions) for versions in lineage))

        def all_say(v: int, key: str) -> bool:
            return all(versions[v][key] == fp for versions in lineage)

        if version in common and all_say(version, "encoder"):
            target = version
        else:
            descendants = [v for v in common if v > version and all_say(v, "origin")]
            target = max(descendants, default=None)
        these_weights = target is None or all_say(target, "encoder")
        self._origin = fp
        state_ref = entity_state if isinstance(entity_state, ray.ObjectRef) else ray.put(state)
        self._state_ref = state_ref  # what apply_delta encodes new rows with, until a refresh
        if target is not None:
            served = self._serve(target)
            if these_weights:
                # Reloaded shards hold no encoder. Build it now, in the background (searches go on),
                # rather than inside the first KB delta, whose cost should be that of its rows.
                for h in self._handles:
                    h.hold_encoder.remote([state_ref], fp)
        else:
            newest = max((v for versions in lineage for v in versions), default=-1)
            reusable = newest <= version and all(versions[version]["encoder"] == fp
                                                 for versions in lineage if version in versions)
            served = self.refresh(state_ref, version if reusable else newest + 1, wait=True).wait()
        if these_weights:
            # A run starting on a store changed by deltas: serve its current version (only the rows added
            # since version 0 are encoded). A resumed run (a descendant version) stays on the KB version
            # it trained with, so it replays; a delta is then asked for (train.kb_control).
            caught_up = self.serve_current_kb(state_ref)
            served = served if caught_up is None else caught_up
        else:
            self.sync_kb()
        return served

    def serve_current_kb(self, entity_state: dict | Any = None) -> int | None:
        """Where the store's current KB version is newer than the one the shards serve (an index encoded
        before ``jobs/update_kb.py``), serve it with :meth:`apply_delta`: the rows added since encoded with
        ``entity_state``, which must be the weights of the version served, the removed rows never
        returned. Returns the new index version; None when the shards already serve the current KB."""
        from kb.store import EntityStore

        self.sync_kb()  # the version served may encode an earlier KB version than the store's current one
        if self.store_dir is None or EntityStore(self.store_dir).kb_version <= self.kb_version:
            return None
        return self.apply_delta(entity_state=entity_state)

    def same_weights(self, a: int, b: int) -> bool:
        """Every shard holds versions ``a`` and ``b``, encoded from the same entity-encoder weights (e.g. a
        KB delta served on top of version ``a``: only the KB differs)."""
        calls = [ShardCall(h, i, "lineage", (), {}, self._policy) for i, h in enumerate(self._handles)]
        lineage = [c.get() for c in calls]
        return all(a in v and b in v and v[a]["encoder"] is not None and v[a]["encoder"] == v[b]["encoder"]
                   for v in lineage)

    def use_version(self, version: int) -> bool:
        """Serve ``version`` again on every shard (from memory or disk), if every shard still
        holds it from this run's lineage; False (nothing changed) otherwise.

        A run restarted from a checkpoint replays its next steps against the index they
        used before, instead of one built later from weights the checkpoint never had.
        """
        calls = [ShardCall(h, i, "lineage", (), {}, self._policy) for i, h in enumerate(self._handles)]
        lineage = [c.get() for c in calls]
        if not all(version in versions and versions[version]["origin"] == self._origin for versions in lineage):
            return False
        try:
            self._serve(version)
        except RayTaskError as e:  # pruned from disk in between: the others are then ahead of it
            if isinstance(cause(e), VersionUnavailable):
                return False
            raise
        self.sync_kb()  # an older index version may encode an older KB version: sample from its live rows
        return True

    def _serve(self, version: int) -> int:
        """Every shard serves ``version`` again, in order with the deltas and refreshes (actors.sequencer): a
        delta under way is not applied to the version this replaces. Returns the version served."""
        ticket = ray.get(self._sequencer.submit_use.remote(int(version)))
        return int(ray.get(self._sequencer.wait.remote(ticket["ticket"])))

    # ------------------------------------------------------------------ queries
    def _reps(self, mention_reps: Reps | Tensor) -> Reps:
        """Validate mention reps against the score spec and d; detach to CPU."""
        reps = Reps(mention_reps) if isinstance(mention_reps, Tensor) else mention_reps
        if not isinstance(reps, Reps) or not isinstance(reps.vecs, Tensor):
            raise TypeError(f"mention_reps must be a Tensor or Reps, got {type(mention_reps).__name__}")
        vecs, mask = reps
        reduction, count = self.spec.mention_side
        if reduction == "all":
            want, ok = f"[B, T, {self.dim}] (+ mask [B, T] bool)", vecs.dim() == 3
        elif count == 1:
            want, ok = f"[B, {self.dim}]", vecs.dim() == 2
        else:
            want, ok = f"[B, {count}, {self.dim}]", vecs.dim() == 3 and vecs.shape[1] == count
        ok = ok and vecs.shape[-1] == self.dim
        if not ok or not vecs.is_floating_point():
            raise ValueError(f"mention_reps for {self.spec} must be floating {want}, got {vecs.dtype} "
                             f"{list(vecs.shape)}")
        if mask is not None and (reduction != "all" or mask.dtype != torch.bool or mask.shape != vecs.shape[:2]):
            want = f"bool {list(vecs.shape[:2])}" if reduction == "all" else "no mask"
            raise ValueError(f"mention_reps mask for {self.spec}: expected {want}, got {mask.dtype} "
                             f"{list(mask.shape)}")
        return Reps(vecs.detach().cpu(), None if mask is None else mask.detach().cpu())

    def _int_rows(self, what: str, x: Tensor | None, batch: int, dims: tuple[int, ...],
                  bounds: tuple[int, int] | None = None) -> Tensor | None:
        if x is None:
            return None
        if not isinstance(x, Tensor) or x.dtype != torch.int64 or x.dim() not in dims or x.shape[0] != batch:
            shape = " or ".join(["[B]", "[B, e]"][d - 1] for d in dims)
            got = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{what} must be an int64 tensor {shape} with B={batch}, got {got}")
        x = x.detach().cpu()
        if bounds is not None and x.numel() and (int(x.min()) < bounds[0] or int(x.max()) >= bounds[1]):
            raise ValueError(f"{what} values must be in [{bounds[0]}, {bounds[1]}), got "
                             f"[{int(x.min())}, {int(x.max())}]")
        return x

    def _queries(self, mention_reps: Reps | Tensor, gold: Tensor, query_keys: Tensor,
                 num_negatives: int) -> tuple[Reps, Tensor, Tensor]:
        """Validated (reps, gold, query_keys) of a mining request for K-1 = ``num_negatives``."""
        reps = self._reps(mention_reps)
        batch = reps.vecs.shape[0]
        if gold is None or query_keys is None:
            raise ValueError("mine: gold and query_keys are required (int64 [B])")
        gold = self._int_rows("gold", gold, batch, (1, 2), (-1, self.num_entities))
        query_keys = self._int_rows("query_keys", query_keys, batch, (1,))
        room = self.live.num_live - (1 if gold.dim() == 1 else gold.shape[1])
        if not 1 <= num_negatives <= room:
            raise ValueError(f"n_hard + n_random = {num_negatives} negatives: need 1 <= K-1 <= N - golds = {room}")
        return reps, gold, query_keys

    def draw(self, sampler: Sampler, mention_reps: Reps | Tensor, gold: Tensor, seed: int,
             query_keys: Tensor) -> Pending[MineResult]:
        """``sampler``'s K-1 negatives per mention, drawn from the shards; returns at once.

        mention_reps: [B, d] (dual, multi-m), [B, m, d] (poly, genpoly), [B, T, d] + mask (som);
        gold: [B] (or [B, e]) int64 rows, -1 = none; query_keys: [B] int64 (Gumbel noise keys).
        """
        reps, gold, query_keys = self._queries(mention_reps, gold, query_keys, sampler.num_negatives)
        return sampler.draw(self, reps, gold, int(seed), query_keys)

    def mine(self, mention_reps: Reps | Tensor, gold: Tensor, n_hard: int, n_random: int, seed: int,
             query_keys: Tensor, p_mixed: float | None = None) -> Pending[MineResult]:
        """K-1 = n_hard + n_random negatives per mention (module docstring): :meth:`draw` with the
        random, hard or mixed sampler that split gives. p_mixed: optional; when given it must give
        n_hard by ``negatives.num_hard``."""
        for name, v in (("n_hard", n_hard), ("n_random", n_random)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        total = n_hard + n_random
        if p_mixed is not None and total and num_hard(p_mixed, total) != n_hard:
            raise ValueError(f"p_mixed={p_mixed} gives {num_hard(p_mixed, total)} hard of {total} "
                             f"(negatives.num_hard), but n_hard={n_hard}")
        reps, gold, query_keys = self._queries(mention_reps, gold, query_keys, total)
        return sampler_for_split(n_hard, n_random).draw(self, reps, gold, int(seed), query_keys)

    def gumbel(self, reps: Reps, k: int, gold: Tensor, seed: int, query_keys: Tensor,
               pool: Tensor | None = None) -> Pending[GumbelDraw]:
        """The :class:`SampleSource` face: the exact Gumbel-top-k of the KB minus the gold, each shard
        drawing from its rows with the same counter-based noise, merged over shards; with ``pool``
        [B, P], each shard also scores the pool rows it owns from the same index version."""
        reps_ref = ray.put(reps)
        if pool is None:
            fan = FanOut(self._handles, "gumbel_topk", (reps_ref, k, gold, seed, query_keys), {}, self._policy)
            return MineFuture(fan, lambda parts: GumbelDraw(merge_results(parts, k), None))
        fan = FanOut(self._handles, "gumbel_topk_scored", (reps_ref, k, gold, seed, query_keys, pool), {},
                     self._policy)

        def finish(parts: list[ScoredSample]) -> GumbelDraw:
            scores = torch.full(pool.shape, math.nan, dtype=torch.float32)
            for part in parts:  # each pool row is scored by exactly one shard, the others give NaN
                scores = torch.where(torch.isnan(scores), part.row_scores, scores)
            return GumbelDraw(merge_results([part.sample for part in parts], k), scores)

        return MineFuture(fan, finish)

    def topk(self, mention_reps: Reps | Tensor, k: int, gold: Tensor | None = None) -> TopkFuture:
        """The k best entities by s(x, y) over the KB (gold excluded); for evaluation."""
        reps = self._reps(mention_reps)
        gold = self._int_rows("gold", gold, reps.vecs.shape[0], (1, 2), (-1, self.num_entities))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.live.num_live:
            raise ValueError(f"k must be an int in [1, {self.live.num_live}], got {k!r}")
        fan = FanOut(self._handles, "topk", (ray.put(reps), k, gold), {}, self._policy)
        return TopkFuture(fan, lambda parts: merge_results(parts, k))

    def lse_grad(self, mention_reps: Reps | Tensor, rows: Tensor | None = None, version: int | None = None
                 ) -> LseGradFuture:
        """d/dq log-sum-exp of s(x, .) over the whole KB (``rows`` None) or over candidate sets
        ``rows`` [B, S, K] of global rows, merged over shards (``dist_nce.bias.gradbias``); for the
        bias monitor. ``version``: the index version to answer from (e.g. the one a mined
        sample came from); default: the one the shards agree on."""
        reps = self._reps(mention_reps)
        batch = reps.vecs.shape[0]
        if rows is not None:
            if not isinstance(rows, Tensor) or rows.dtype != torch.int64 or rows.dim() != 3 or rows.shape[0] != batch:
                raise ValueError(f"rows must be an int64 tensor [B={batch}, S, K], got "
                                 f"{getattr(rows, 'dtype', type(rows).__name__)} {list(getattr(rows, 'shape', []))}")
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.num_entities):
                raise ValueError(f"rows must be in [0, {self.num_entities}), got [{int(rows.min())}, "
                                 f"{int(rows.max())}]")
            rows = rows.detach().cpu()
        kwargs = {} if version is None else {"version": int(version)}
        fan = FanOut(self._handles, "lse_grad", (ray.put(reps), rows), kwargs, self._policy)

        def finish(parts: list[LseGradPart]) -> LseGradPart:
            merged = merge_lse_grad(parts)
            return LseGradPart(merged.lse, merged.grad, parts[0].version)

        return LseGradFuture(fan, finish)

    def shutdown(self) -> None:
        """Kill the shard actors and the sequencer (persisted versions stay on disk)."""
        for h in [*self._handles, *([self._sequencer] if self._sequencer is not None else [])]:
            ray.kill(h, no_restart=True)
        self._handles, self._sequencer = [], None
