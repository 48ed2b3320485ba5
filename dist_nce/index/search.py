"""Search one shard of the KB: exact top-k and exact Gumbel-top-k, faiss or torch.

A shard owns the entity rows [row_start, row_start + n). Its answers use GLOBAL row
ids, exclude the gold (a gold outside the shard is simply absent) and merge across
shards with :func:`dist_nce.sampling.topk.merge_results` into the global answer.

Backends (``IndexConfig.backend``):

* ``torch``: any score preset (dual, poly-m, multi-m, SOM, genpoly-m) through
  ``scoring.score_all`` in chunks of rows, on CPU or GPU, fp32/bf16/fp16 compute.
* ``flat``: faiss exact maximum inner product, fp32 or fp16 storage, faiss-gpu when a
  GPU is present and ``faiss_gpu`` allows (dual and multi-m; the spec must be an inner
  product).
* ``ivf`` / ``hnsw``: faiss approximate maximum inner product.

Gumbel-top-k (hard negatives, docs/design.md section 5), ``IndexConfig.gumbel``:

* ``exact``: brute force over every row (torch, chunked): keys s + G with the
  counter-based noise of ``negatives.gumbel_noise``; ``log_z`` is exact. Sharded and
  flat searches return the same sample bit for bit (same ``chunk_rows``, device, dtype
  and thread count; see :func:`exact_search`).
* ``candidates``: the backend's top N (``candidates``) by score, then Gumbel-top-k
  within them; ``log_z`` covers those N and ``tail_log_z`` ESTIMATES the gold-excluded
  mass of the other rows from R = ``tail_sample`` rows drawn uniformly (with replacement)
  and scored exactly: sum_{y outside} e^s ~= (n / R) sum_{sampled y outside} e^s, unbiased
  for the sum (exact when R >= n, which scores every row). ``ShardResult.truncation()``
  turns it into the estimated softmax mass outside the candidates.
* ``auto``: exact for torch/flat, candidates for ivf/hnsw.

The exact mode's sampler (``IndexConfig.sampler``; the default ``auto`` is ``block`` wherever it
applies, ``IndexConfig.resolved_sampler``): ``dense`` adds one Gumbel to every score (the
reference); ``block`` draws each ``block_rows`` block's maximum from its logsumexp, keeps the
K-1 best blocks and draws only their rows' keys, conditioned on the block maximum
(``block_gumbel``): the same law with noise for N/b + (K-1) b rows per query.
Its sharded answer equals the flat one bit for bit when every shard starts on the
``block_rows`` grid (a shard starting inside a block samples its piece as a block of its
own: exact, but another draw than flat); ``NegativeService`` puts its shard boundaries on
that grid (``IndexConfig.row_grid``).

Scoring precision (``IndexConfig.score_dtype``, torch backend): ``bf16`` keeps the entity
rows in bf16 (half the bytes) and rounds queries to bf16; scores are fp32 sums of the exact
bf16 products (what a bf16 GEMM with fp32 accumulation computes), within 2^-7 sum_i |q_i e_i|
of fp32 scoring. The torch path upcasts each chunk and runs the fp32 GEMM (torch's CPU bf16
GEMM rounds its output to bf16). Over single-vector rows the block sampler and the top-k run
a native kernel instead (``IndexConfig.kernel``, ``block_native``): AVX512-BF16 where the CPU
has it, else AVX2+FMA, which also serves fp32 rows; each sums the products in its own fixed
order, the two the same order on bf16 rows.

On a GPU (``kernel: auto`` on a CUDA device, or ``triton``) the block sampler and the exact
top-k over single-vector rows run ``block_fused``: per chunk one GEMM (bf16 with fp32 output
for ``score_dtype: bf16``), one fused Triton reduction to block maxima and log-masses, and a
few small operations, nothing read back to the host before the end; chunks of ~512 MB of
scores (``chunk_rows: 0``, ``exact.auto_chunk_rows``). Same law, counters and tie rules.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from dist_nce.index import faiss_backend
from dist_nce.index.config import DTYPES, IndexConfig
from dist_nce.index.exact import exact_search
from dist_nce.modeling.scoring import Reps, ScoreSpec, flatten_for_mips, is_inner_product, score_all, score_candidates
from dist_nce.sampling.noise import gumbel_noise
from dist_nce.sampling.topk import ShardResult, isin_rows, merge_results

_TAIL_SALT = 0x7A11_5A3D
log = logging.getLogger(__name__)


def _check_batch(what: str, x: Tensor | None, batch: int, dims: tuple[int, ...]) -> None:
    if x is None:
        return
    if x.dtype != torch.int64 or x.dim() not in dims or x.shape[0] != batch:
        shapes = " or ".join(["[B]", "[B, e]"][d - 1] for d in dims)
        raise ValueError(f"{what} must be int64 {shapes} with B={batch}, got {x.dtype} {list(x.shape)}")


class ShardIndex:
    """One shard's entity reps and search structure; immutable once built.

    A refresh builds a new ShardIndex and swaps the reference (the Ray actor guards the
    swap), so a search always sees one consistent (reps, index, version).

    Memory: the exact Gumbel path, the truncation estimate and ``score_rows`` read the
    torch reps (in ``config.storage``) directly. Where the faiss index keeps the rows
    in row order and in that dtype -- a CPU flat or HNSW index (Flat or SQfp16 codes)
    over single-vector (dual) reps -- the torch reps ARE a zero-copy view of the faiss
    storage, so the vectors are held once (plus 8 bytes per row of faiss owners).
    Elsewhere a second copy remains: IVF (its lists reorder and interleave the rows),
    multi-vector reps (faiss holds only the unpadded vectors), faiss on a GPU.
    """

    def __init__(self, spec: ScoreSpec, entities: Reps, row_start: int, config: IndexConfig | None = None,
                 version: int = 0, faiss_index=None, dead: Tensor | None = None):
        self.config = config = config or IndexConfig()
        config.validate()
        if entities.vecs.dim() not in (2, 3) or not entities.vecs.is_floating_point():
            raise ValueError(f"ShardIndex: entity reps must be floating [n, d] or [n, m, d], "
                             f"got {entities.vecs.dtype} {list(entities.vecs.shape)}")
        self.spec, self.row_start, self.version = spec, int(row_start), int(version)
        # Rows a KB delta removed (sorted int64, global), excluded from every answer unless a call passes
        # its own (dist_nce.index.live); in-process indexes over a changed store carry them.
        self.dead = None if dead is None or not len(dead) else torch.as_tensor(dead, dtype=torch.int64).cpu()
        self.device = config.torch_device()
        self.compute = DTYPES[config.compute]
        self.entities = Reps(entities.vecs.to(self.device, config.storage_dtype()),
                             None if entities.mask is None else entities.mask.to(self.device))
        self.num_rows, self.dim = entities.vecs.shape[0], entities.vecs.shape[-1]
        self._faiss = self._gpu_res = self._owners = None
        self._on_gpu = False
        if faiss_index is not None:  # from ShardIndex.filled: the reps are a view of its codes
            self._faiss, self._owners = faiss_index, torch.arange(self.num_rows)
        elif config.backend != "torch":
            self._build_faiss()

    @classmethod
    def filled(cls, spec: ScoreSpec, shape: tuple[int, ...], source_dtype: torch.dtype, fill,
               row_start: int, config: IndexConfig | None = None, version: int = 0) -> "ShardIndex":
        """A ShardIndex over single-vector reps of ``shape`` [n, d] that ``fill(out)`` writes into
        ``out`` (an empty contiguous CPU tensor of ``shape`` and ``source_dtype``).

        Memory: for a CPU faiss flat index whose codes have the source dtype (fp32 Flat, fp16
        SQfp16) over dual reps, ``out`` IS the preallocated faiss storage, so the vectors are
        held once at every moment of the build (the constructor holds the caller's reps and
        faiss's copy together: 2x at its peak). Any other configuration fills a torch tensor
        and builds as the constructor does.
        """
        config = config or IndexConfig()
        config.validate()
        n, dim = int(shape[0]), int(shape[-1])
        direct = (len(shape) == 2 and n > 0 and config.backend == "flat" and is_inner_product(spec)
                  and config.torch_device().type == "cpu" and config.faiss_gpu != "on"
                  and config.storage_dtype() == source_dtype and config.storage in ("fp32", "fp16"))
        if not direct:
            out = torch.empty(shape, dtype=source_dtype)
            fill(out)
            return cls(spec, Reps(out), row_start, config, version)
        index = faiss_backend.preallocated_flat(n, dim, config.storage)
        view = faiss_backend.faiss_storage_view(index, n, dim, source_dtype)
        fill(view)
        return cls(spec, Reps(view), row_start, config, version, faiss_index=index)

    # ------------------------------------------------------------------ faiss
    def _build_faiss(self) -> None:
        cfg = self.config
        if not is_inner_product(self.spec):
            raise ValueError(f"ShardIndex: backend {cfg.backend!r} needs an inner-product score, {self.spec} "
                             f"is not one; use backend 'torch'")
        from dist_nce.cluster.runtime import faiss_has_gpu

        want_gpu = cfg.faiss_gpu == "on" or (cfg.faiss_gpu == "auto" and self.device.type == "cuda")
        if want_gpu and not faiss_has_gpu():
            if cfg.faiss_gpu == "on":
                raise ValueError("index.faiss_gpu is 'on' but faiss sees no GPU (faiss-cpu build or no device)")
            want_gpu = False
        mips = flatten_for_mips(self.spec, Reps(self.entities.vecs.float().cpu(),
                                                None if self.entities.mask is None else self.entities.mask.cpu()))
        gpu_device = (self.device.index or 0) if want_gpu else None
        self._faiss, self._gpu_res = faiss_backend.build_index(
            mips.vecs.contiguous().numpy(), cfg.backend, cfg.storage, nlist=cfg.nlist, hnsw_m=cfg.hnsw_m,
            ef_construction=cfg.ef_construction, train_rows=cfg.ivf_train_rows, seed=cfg.seed,
            gpu_device=gpu_device)
        self._on_gpu = self._gpu_res is not None
        if self._on_gpu and cfg.backend == "ivf":
            faiss_backend.set_gpu_nprobe(self._faiss, cfg.nprobe)
        self._owners = mips.owners.cpu()
        del mips
        if cfg.backend in ("flat", "hnsw") and not self._on_gpu and self.entities.vecs.dim() == 2:
            self._share_faiss_storage()

    def _share_faiss_storage(self) -> None:
        """Replace the torch reps by a view of the faiss codes when they hold the same values."""
        view = faiss_backend.faiss_storage_view(self._faiss, self.num_rows, self.dim, self.entities.vecs.dtype)
        if view is None or not torch.equal(view, self.entities.vecs):
            log.warning("ShardIndex: faiss %s storage is not a row-ordered copy of the reps; keeping both "
                        "(2x memory)", self.config.backend)
            return
        self.entities = Reps(view, None)

    def _local_dead(self, dead: Tensor | None) -> Tensor | None:
        """Sorted global ``dead`` rows -> those of this index as local rows (None when none)."""
        if dead is None or not dead.numel():
            return None
        a, b = torch.searchsorted(dead, torch.tensor([self.row_start, self.row_start + self.num_rows])).tolist()
        return dead[a:b] - self.row_start if b > a else None

    def _faiss_topk(self, queries: Reps, k: int, gold: Tensor | None, dead: Tensor | None = None) -> ShardResult:
        cfg = self.config
        q = queries.vecs
        if q.dim() != 2 or q.shape[1] != self.dim:
            raise ValueError(f"ShardIndex({cfg.backend}): queries must be [B, {self.dim}], got {list(q.shape)}")
        gold2 = torch.empty((q.shape[0], 0), dtype=torch.int64) if gold is None else \
            (gold[:, None] if gold.dim() == 1 else gold).cpu()
        local_gold = torch.where(gold2 >= 0, gold2 - self.row_start, -1)
        ents, scores = faiss_backend.search_entities(
            self._faiss, q.detach().float().cpu().contiguous().numpy(), k, self._owners, local_gold,
            params_for=lambda fetch: faiss_backend.search_params(cfg.backend, self._on_gpu, cfg.nprobe,
                                                                 cfg.ef_search, fetch),
            max_fetch=faiss_backend.FAISS_GPU_MAX_K if self._on_gpu else None, dead=self._local_dead(dead))
        ids = torch.where(ents >= 0, ents + self.row_start, -1)
        # Canonical order (score desc, id asc) through the one-part merge.
        return merge_results([ShardResult(ids, scores, scores.double(), version=self.version)], k)

    # ------------------------------------------------------------------ public
    def _prepare(self, queries: Reps | Tensor, k: int, gold: Tensor | None) -> Reps:
        if isinstance(queries, Tensor):
            queries = Reps(queries)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if queries.vecs.shape[-1] != self.dim or not queries.vecs.is_floating_point():
            raise ValueError(f"queries must be floating with last dim d={self.dim}, got {queries.vecs.dtype} "
                             f"{list(queries.vecs.shape)}")
        _check_batch("gold", gold, queries.vecs.shape[0], (1, 2))
        vecs = queries.vecs.to(self.device)
        if self.config.score_dtype == "bf16":
            # bf16 values held in fp32: with the bf16 entity rows (upcast per chunk by
            # _padded_block) every product q_i e_i is exact in fp32 and the GEMM sums in fp32,
            # what a bf16 GEMM with fp32 accumulation and output computes, up to summation order.
            # torch's CPU bf16 matmul would round its output to bf16 (~2^-9 relative); the native
            # block kernel takes these values as bf16 without loss.
            vecs = vecs.to(torch.bfloat16).float()
        return Reps(vecs, None if queries.mask is None else queries.mask.to(self.device))

    def _exact(self, queries: Reps, k: int, gold: Tensor | None, seed: int | None = None,
               query_keys: Tensor | None = None, dead: Tensor | None = None) -> ShardResult:
        res = exact_search(self.spec, queries, self.entities, self.row_start, k,
                           None if gold is None else gold.to(self.device), self.config.chunk_rows, self.compute,
                           seed, None if query_keys is None else query_keys.to(self.device), self.version,
                           self.config.resolved_sampler(), self.config.block_rows, dead, self.config.kernel)
        return ShardResult(*(x.cpu() if isinstance(x, Tensor) else x for x in res))

    def topk(self, queries: Reps | Tensor, k: int, gold: Tensor | None = None, dead: Tensor | None = None
             ) -> ShardResult:
        """Top k entities of this shard by s(x, y), gold excluded.

        queries: mention Reps (a Tensor [B, d] for single-vector mentions); gold: [B] or
        [B, e] int64 global rows; dead: sorted int64 global rows removed from the KB (never
        returned; ``dist_nce.index.live``). torch backend: ``log_z`` exact; faiss: ``log_z`` None.
        """
        queries = self._prepare(queries, k, gold)
        dead = self.dead if dead is None else dead
        if self._faiss is None:
            return self._exact(queries, k, gold, dead=dead)
        return self._faiss_topk(queries, k, gold, dead)

    def gumbel_topk(self, queries: Reps | Tensor, k: int, gold: Tensor | None, seed: int,
                    query_keys: Tensor, dead: Tensor | None = None) -> ShardResult:
        """k entities of this shard without replacement proportional to exp(s), gold excluded.

        query_keys: [B] int64, one integer per query (the noise is a function of seed,
        query key and global row); see the module docstring for exact vs candidates. dead:
        as in :meth:`topk` (never sampled, not in ``log_z`` nor in the tail estimate).
        """
        queries = self._prepare(queries, k, gold)
        _check_batch("query_keys", query_keys, queries.vecs.shape[0], (1,))
        dead = self.dead if dead is None else dead
        if self.config.gumbel_mode() == "exact":
            return self._exact(queries, k, gold, seed, query_keys, dead)
        return self._gumbel_candidates(queries, k, gold, seed, query_keys, dead)

    def _gumbel_candidates(self, queries: Reps, k: int, gold: Tensor | None, seed: int,
                           query_keys: Tensor, dead: Tensor | None = None) -> ShardResult:
        n_cand = max(k, min(self.config.candidates, self.num_rows))
        cand = self.topk(queries, n_cand, gold, dead)
        valid = cand.ids >= 0
        scores = cand.scores.double().masked_fill(~valid, float("-inf"))
        keys = scores + gumbel_noise(seed, query_keys.cpu(), cand.ids.clamp(min=0))
        log_z = torch.logsumexp(scores, dim=1)
        tail = self._tail_log_z(queries, cand.ids, gold, seed, dead)
        res = ShardResult(cand.ids, cand.scores, keys.masked_fill(~valid, float("-inf")), log_z, tail,
                          self.version)
        return merge_results([res], k)

    def _tail_log_z(self, queries: Reps, covered: Tensor, gold: Tensor | None, seed: int,
                    dead: Tensor | None = None) -> Tensor:
        """[B] estimate of log sum_{rows not covered, not gold, not dead} exp(s) (module docstring):
        a dead row drawn contributes 0, which keeps the estimate unbiased for the live rows' sum."""
        n, r = self.num_rows, min(self.config.tail_sample, self.num_rows)
        if r == n:  # every row: the "estimate" is exact
            local = torch.arange(n)
        else:  # iid uniform rows (with replacement: O(r), and still unbiased)
            gen = torch.Generator().manual_seed((int(seed) ^ _TAIL_SALT) & 0x7FFF_FFFF_FFFF_FFFF)
            local = torch.randint(0, n, (r,), generator=gen).sort().values
        sample = Reps(self.entities.vecs[local.to(self.device)].to(self.compute),
                      None if self.entities.mask is None else self.entities.mask[local.to(self.device)])
        q = Reps(queries.vecs.to(self.compute), queries.mask)
        s = score_all(self.spec, q, sample).double().cpu()
        rows = (local + self.row_start).expand(s.shape[0], r)
        out = isin_rows(rows, covered)
        if gold is not None:
            out |= isin_rows(rows, (gold[:, None] if gold.dim() == 1 else gold).cpu())
        if dead is not None and dead.numel():
            out |= torch.isin(rows, dead.cpu())
        return math.log(n / r) + torch.logsumexp(s.masked_fill(out, float("-inf")), dim=1)

    def score_rows(self, queries: Reps | Tensor, rows: Tensor) -> Tensor:
        """Exact s(x_b, y) [B, r] float32 for global ``rows`` [B, r] owned by this shard."""
        queries = self._prepare(queries, 1, None)
        _check_batch("rows", rows, queries.vecs.shape[0], (2,))
        local = rows.to(self.device) - self.row_start
        if bool(((local < 0) | (local >= self.num_rows)).any()):
            raise ValueError(f"score_rows: rows outside this shard [{self.row_start}, "
                             f"{self.row_start + self.num_rows})")
        ent = Reps(self.entities.vecs[local].to(self.compute),
                   None if self.entities.mask is None else self.entities.mask[local])
        q = Reps(queries.vecs.to(self.compute), queries.mask)
        return score_candidates(self.spec, q, ent).float().cpu()

