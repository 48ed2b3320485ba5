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

The exact mode's sampler (``IndexConfig.sampler``): ``dense`` adds one Gumbel to every
score (the reference); ``block`` draws each ``block_rows`` block's maximum from its
logsumexp, keeps the K-1 best blocks and draws only their rows' keys, conditioned on the
block maximum (``block_gumbel``): the same law with noise for N/b + (K-1) b rows per query.
Its sharded answer equals the flat one bit for bit when every shard starts on the
``block_rows`` grid (a shard starting inside a block samples its piece as a block of its
own: exact, but another draw than flat); ``NegativeService`` puts its shard boundaries on
that grid (``IndexConfig.row_grid``).

Scoring precision (``IndexConfig.score_dtype``, torch backend): ``bf16`` keeps the entity
rows in bf16 (half the bytes) and rounds queries to bf16; scores are fp32 sums of the exact
bf16 products (what a bf16 GEMM with fp32 accumulation computes), within 2^-7 sum_i |q_i e_i|
of fp32 scoring. The torch path upcasts each chunk and runs the fp32 GEMM (torch's CPU bf16
GEMM rounds its output to bf16); the block sampler over single-vector rows runs the native
kernel instead where the CPU has AVX512-BF16 (``IndexConfig.kernel``, ``block_native``),
which sums the same products in its own fixed order.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
from typing import Literal, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, Range, check_fields
from dist_nce.index import faiss_backend
from dist_nce.sampling import block_native
from dist_nce.sampling.topk import ShardResult, isin_rows, merge_results
from dist_nce.modeling.scoring import Reps, ScoreSpec, flatten_for_mips, is_inner_product, score_all, \
    score_candidates
from dist_nce.sampling.block_gumbel import BlockStream, block_log_mass, rows_from_blocks
from dist_nce.sampling.negatives import gumbel_topk_dense
from dist_nce.sampling.noise import gumbel_noise
from dist_nce.sampling.topk import mask_gold_

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_TAIL_SALT = 0x7A11_5A3D
log = logging.getLogger(__name__)
_TOLD: set[str] = set()


def _help(text: str, default, bounds: Range | None = None):
    """A field with its help string and, for numbers, its admissible range (dist_nce.core.config)."""
    return dataclasses.field(default=default, metadata={"help": text, **({"range": bounds} if bounds else {})})


@dataclasses.dataclass
class IndexConfig:
    """How a shard searches its entities."""

    backend: Literal["torch", "flat", "ivf", "hnsw"] = _help(
        "torch: exact, any preset; flat: faiss exact MIPS; ivf/hnsw: faiss approximate MIPS", "flat")
    storage: Literal["fp32", "fp16", "bf16"] = _help(
        "dtype the entity vectors are kept in (faiss: fp32 or fp16 only)", "fp32")
    compute: Literal["fp32", "fp16", "bf16"] = _help(
        "torch matmul dtype of the exact path (bf16/fp16 are for GPUs; bf16 is also fast on recent CPUs)", "fp32")
    score_dtype: Literal["fp32", "bf16"] = _help(
        "exact scoring precision. bf16: entity vectors stored bf16 (half the bytes), queries rounded to "
        "bf16, products summed in fp32 (each product of two bf16 values is exact in fp32) and scores kept "
        "fp32; sets storage and compute (leave those at fp32). torch backend only", "fp32")
    device: str = _help("torch device of the exact path: auto (cuda if available), cpu, cuda, cuda:1", "auto")
    faiss_gpu: Literal["auto", "on", "off"] = _help(
        "put the faiss flat/IVF index on the GPU: auto = when faiss sees a GPU and device is cuda", "auto")
    gumbel: Literal["auto", "exact", "candidates"] = _help(
        "Gumbel-top-k: exact brute force over all rows, or within the backend's top `candidates`", "auto")
    sampler: Literal["dense", "block"] = _help(
        "exact Gumbel-top-k sampler: dense draws one Gumbel per (query, row) (the reference); block draws "
        "each block's maximum, keeps the K-1 best blocks and draws rows only inside them (same law, noise "
        "for N/block_rows + (K-1)*block_rows rows per query; dist_nce/sampling/block_gumbel.py)", "dense")
    kernel: Literal["auto", "native", "torch"] = _help(
        "block sampler over bf16 dual reps (score_dtype bf16): native = the fused AVX512-BF16 kernel "
        "(dist_nce/index/native), scores never leave the core; torch = chunked GEMM then reductions; auto = "
        "native where the CPU and a C compiler allow. Same law, different float rounding, so runs that must "
        "repeat draws bit for bit across machines should pin it", "auto")
    block_rows: int = _help(
        "rows per block of the block sampler, on a global grid; must divide chunk_rows. sqrt(N/(K-1)) "
        "minimises the noise drawn. Sharded == flat bit for bit when every shard starts on this grid", 128,
        AT_LEAST_1)
    candidates: int = _help("N, rows retrieved per query before Gumbel in candidates mode", 1024, AT_LEAST_1)
    tail_sample: int = _help("rows sampled uniformly to estimate the softmax mass outside the candidates", 1024,
                             AT_LEAST_1)
    chunk_rows: int = _help(
        "entities per block on the exact path; blocks follow a global grid, so keep it equal across shards "
        "for bit-identical Gumbel samples (SOM: a block materialises chunk_rows x T x d)", 8192, AT_LEAST_1)
    nlist: int = _help("IVF lists", 1024, AT_LEAST_1)
    nprobe: int = _help("IVF lists probed per query", 32, AT_LEAST_1)
    ivf_train_rows: int = _help("rows IVF k-means trains on (0 = all)", 0, AT_LEAST_0)
    hnsw_m: int = _help("HNSW graph degree", 32, AT_LEAST_1)
    ef_construction: int = _help("HNSW build beam", 200, AT_LEAST_1)
    ef_search: int = _help("HNSW search beam (raised to the fetch size when smaller)", 128, AT_LEAST_1)
    seed: int = _help("seed of index construction (IVF training sample)", 0, AT_LEAST_0)

    def validate(self) -> None:
        check_fields(self, "index")  # the loader did already; direct constructions did not
        if self.backend != "torch" and self.storage == "bf16":
            raise ValueError("index.storage bf16 is torch-only; faiss stores fp32 or fp16")
        if self.score_dtype == "bf16":
            if self.backend != "torch":
                raise ValueError(f"index.score_dtype bf16 needs backend 'torch' (faiss stores fp32 or fp16), got "
                                 f"{self.backend!r}")
            if self.storage not in ("fp32", "bf16") or self.compute != "fp32":
                raise ValueError("index.score_dtype bf16 sets the storage (bf16) and the GEMM (bf16 values, fp32 "
                                 f"sums): leave index.storage and index.compute at fp32, got {self.storage}/"
                                 f"{self.compute}")
        if self.sampler == "block" and self.chunk_rows % self.block_rows:
            raise ValueError(f"index.block_rows ({self.block_rows}) must divide index.chunk_rows "
                             f"({self.chunk_rows}) with sampler 'block'")

    def storage_dtype(self) -> torch.dtype:
        """dtype the entity vectors are held in (``score_dtype`` bf16 overrides ``storage``)."""
        return torch.bfloat16 if self.score_dtype == "bf16" else _DTYPES[self.storage]

    def row_grid(self) -> int:
        """Rows a shard boundary must be a multiple of: ``block_rows`` for the block sampler
        (its blocks must not straddle shards for sharded == flat bit for bit), else 1."""
        return self.block_rows if self.sampler == "block" else 1

    def gumbel_mode(self) -> str:
        if self.gumbel != "auto":
            return self.gumbel
        return "candidates" if self.backend in ("ivf", "hnsw") else "exact"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _check_batch(what: str, x: Tensor | None, batch: int, dims: tuple[int, ...]) -> None:
    if x is None:
        return
    if x.dtype != torch.int64 or x.dim() not in dims or x.shape[0] != batch:
        shapes = " or ".join(["[B]", "[B, e]"][d - 1] for d in dims)
        raise ValueError(f"{what} must be int64 {shapes} with B={batch}, got {x.dtype} {list(x.shape)}")


class Piece(NamedTuple):
    """Entity reps [n, ...] of the contiguous global rows [row_start, row_start + n)."""

    row_start: int
    reps: Reps


def _grid_blocks(row_start: int, n: int, grid: int):
    """(block start, lo, hi): the global blocks [j*grid, (j+1)*grid) meeting rows [row_start, row_start+n)."""
    for b0 in range(row_start // grid * grid, row_start + n, grid):
        yield b0, max(b0, row_start), min(b0 + grid, row_start + n)


def _grid_plan(pieces: Sequence[Piece], grid: int) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """(block start, [(piece, lo, hi), ...]) per global block meeting any piece, ascending.

    Pieces are disjoint; a block met by several pieces (a shard that got the rows filling its
    last partial block in a KB delta) is scored once, as one block, like a flat search does."""
    blocks: dict[int, list[tuple[int, int, int]]] = {}
    for i, piece in enumerate(pieces):
        for b0, lo, hi in _grid_blocks(piece.row_start, piece.reps.vecs.shape[0], grid):
            blocks.setdefault(b0, []).append((i, lo, hi))
    return [(b0, sorted(blocks[b0], key=lambda p: p[1])) for b0 in sorted(blocks)]


def _padded_block(entities: Reps, a: int, b: int, offset: int, grid: int, dtype: torch.dtype) -> Reps:
    """Local rows [a, b) placed at ``offset`` in a zero block of ``grid`` rows."""
    vecs = entities.vecs[a:b].to(dtype)
    mask = None if entities.mask is None else entities.mask[a:b]
    if b - a == grid:
        return Reps(vecs, mask)
    full = vecs.new_zeros((grid, *vecs.shape[1:]))
    full[offset:offset + b - a] = vecs
    if mask is not None:  # padding rows: zero vectors with real positions, scored and dropped
        full_mask = mask.new_ones((grid, *mask.shape[1:]))
        full_mask[offset:offset + b - a] = mask
        mask = full_mask
    return Reps(full, mask)


def _padded_chunk(pieces: Sequence[Piece], parts: list[tuple[int, int, int]], b0: int, grid: int,
                  dtype: torch.dtype) -> Reps:
    """The block at ``b0`` of ``grid`` rows holding each part's rows at their global offset."""
    if len(parts) == 1:
        i, lo, hi = parts[0]
        start = pieces[i].row_start
        return _padded_block(pieces[i].reps, lo - start, hi - start, lo - b0, grid, dtype)
    blocks = [_padded_block(pieces[i].reps, lo - pieces[i].row_start, hi - pieces[i].row_start, lo - b0, grid,
                            dtype) for i, lo, hi in parts]
    vecs = blocks[0].vecs.clone()
    mask = None if blocks[0].mask is None else blocks[0].mask.clone()
    for (i, lo, hi), block in zip(parts[1:], blocks[1:]):
        vecs[lo - b0:hi - b0] = block.vecs[lo - b0:hi - b0]
        if mask is not None:
            mask[lo - b0:hi - b0] = block.mask[lo - b0:hi - b0]
    return Reps(vecs, mask)


def _exclude_(scores: Tensor, parts: list[tuple[int, int, int]], dead: Tensor | None, first: int) -> Tensor:
    """Set to -inf, in place, the columns of ``scores`` [B, w] (global rows [first, first + w)) that
    no part covers (rows of other shards between this shard's pieces) and the ``dead`` rows
    (sorted int64 global rows: removed entities, excluded exactly as the gold is)."""
    width = scores.shape[1]
    last = first + width
    if sum(hi - lo for _, lo, hi in parts) < width:  # parts lie inside [first, last)
        own = torch.zeros(width, dtype=torch.bool, device=scores.device)
        for _, lo, hi in parts:
            own[lo - first:hi - first] = True
        scores[:, ~own] = float("-inf")
    if dead is not None and dead.numel():
        a, b = torch.searchsorted(dead, torch.tensor([first, last], device=dead.device)).tolist()
        if b > a:
            scores[:, (dead[a:b] - first).to(scores.device)] = float("-inf")
    return scores


def exact_search(spec: ScoreSpec, queries: Reps, entities: Reps, row_start: int, k: int, gold: Tensor | None,
                 chunk_rows: int, compute: torch.dtype = torch.float32, seed: int | None = None,
                 query_keys: Tensor | None = None, version: int = 0, sampler: str = "dense",
                 block_rows: int = 128, dead: Tensor | None = None, kernel: str = "auto") -> ShardResult:
    """Exact top-k (``seed`` None) or Gumbel-top-k over entity rows [row_start, row_start+n).

    queries: mention Reps [B, ...]; entities: entity Reps [n, ...] (as ``scoring.entity_reps``
    makes them); gold: [B] or [B, e] int64 global rows (-1 = none); dead: sorted int64 global
    rows removed from the KB (never returned, never sampled, not in ``log_z``). Scores are
    computed in ``compute`` and returned as float32; ``log_z`` is exact.

    Rows are scored in blocks of a GLOBAL grid of ``chunk_rows`` rows, a partial block
    being zero-padded at its global offset: BLAS picks kernels by matrix shape (MKL gives
    ulp-different dot products for a 9-row and a 200-row slice), so identical block
    shapes are what makes every score, hence every Gumbel key, identical whichever shard
    computes it (same chunk_rows, device, dtype and thread count). The cost is at most
    two padded blocks per shard.

    ``sampler`` (Gumbel only): "dense" adds a Gumbel to every score; "block" samples top-down
    over blocks of ``block_rows`` rows (``block_gumbel``; ``block_rows`` must divide
    ``chunk_rows``), keeping the K-1 best blocks across chunks; ``kernel`` as
    ``IndexConfig.kernel``.
    """
    return exact_search_pieces(spec, queries, [Piece(int(row_start), entities)], k, gold, chunk_rows, compute, seed,
                               query_keys, version, sampler, block_rows, dead, kernel)


def exact_search_pieces(spec: ScoreSpec, queries: Reps, pieces: Sequence[Piece], k: int, gold: Tensor | None,
                        chunk_rows: int, compute: torch.dtype = torch.float32, seed: int | None = None,
                        query_keys: Tensor | None = None, version: int = 0, sampler: str = "dense",
                        block_rows: int = 128, dead: Tensor | None = None, kernel: str = "auto") -> ShardResult:
    """:func:`exact_search` over the disjoint contiguous ``pieces`` a shard owns (its base range
    plus the row segments KB deltas gave it), as one search: every global block is scored once
    with all of this shard's rows in it, so the answer is the one a flat search over the same
    rows gives (bit for bit, both samplers, when the shards' pieces tile whole ``block_rows``
    blocks, as ``NegativeService`` places them)."""
    if sampler not in ("dense", "block"):
        raise ValueError(f"exact_search: sampler must be 'dense' or 'block', got {sampler!r}")
    q = Reps(queries.vecs.to(compute), queries.mask)
    pieces = [p for p in pieces if p.reps.vecs.shape[0]] or list(pieces[:1])
    if seed is not None and sampler == "block":
        if kernel != "torch":
            why = block_native.usable(_is_dot(spec, q, pieces), q.vecs, pieces[0].reps.vecs, block_rows)
            if why is None:
                return _native_block_gumbel(q, pieces, k, gold, chunk_rows, seed, query_keys, version, block_rows,
                                            dead)
            if kernel == "native":
                raise ValueError(f"index.kernel 'native': {why}")
            if why not in _TOLD:  # say once per process why the fast path is not taken
                _TOLD.add(why)
                log.info("index.kernel auto: the block sampler runs on torch here: %s", why)
        return _exact_block_gumbel(spec, q, pieces, k, gold, chunk_rows, compute, seed, query_keys, version,
                                   block_rows, dead)
    result = None
    for b0, parts in _grid_plan(pieces, chunk_rows):
        lo, hi = parts[0][1], parts[-1][2]
        block = _padded_chunk(pieces, parts, b0, chunk_rows, compute)
        scores = score_all(spec, q, block)[:, lo - b0:hi - b0].float()
        scores = _exclude_(scores, parts, dead, lo)
        part = gumbel_topk_dense(scores, k, gold, seed, query_keys, row_start=lo, version=version)
        result = part if result is None else merge_results([result, part], k)
    if result is None:  # empty shard
        row_start = pieces[0].row_start if pieces else 0
        result = gumbel_topk_dense(q.vecs.new_zeros((q.vecs.shape[0], 0), dtype=torch.float32), k, gold, seed,
                                   query_keys, row_start=row_start, version=version)
    return result


def _exact_block_gumbel(spec: ScoreSpec, q: Reps, pieces: Sequence[Piece], k: int, gold: Tensor | None,
                        chunk_rows: int, compute: torch.dtype, seed: int, query_keys: Tensor, version: int,
                        block_rows: int, dead: Tensor | None = None) -> ShardResult:
    """The block sampler over the score grid of :func:`exact_search` (see block_gumbel).

    Each chunk is scored in its full padded grid layout [B, chunk_rows]; rows outside the
    shard, dead rows and the gold are set to -inf and the chunk is viewed as [B, chunk_rows / b, b]
    blocks, so a block's scores, log mass and maximum are computed on the same tensor shapes
    whichever shard (or the flat search) holds it: identical bits. Only the blocks meeting
    the shard's rows take part; a block the shard owns only partly is a piece with its own
    counter (its first row), exact but not the flat draw (block_gumbel docstring).
    """
    if block_rows < 1 or chunk_rows % block_rows:
        raise ValueError(f"exact_search: block_rows ({block_rows}) must divide chunk_rows ({chunk_rows})")
    batch = q.vecs.shape[0]
    stream = BlockStream(k, seed, query_keys, block_rows)
    for b0, parts in _grid_plan(pieces, chunk_rows):
        lo, hi = parts[0][1], parts[-1][2]
        block = _padded_chunk(pieces, parts, b0, chunk_rows, compute)
        scores = score_all(spec, q, block)
        scores = mask_gold_(scores if scores.dtype == torch.float32 else scores.float(), gold, b0)  # no copy
        scores = _exclude_(scores, parts, dead, b0)  # rows of no part, dead rows
        j0, j1 = (lo - b0) // block_rows, -(-(hi - b0) // block_rows)  # blocks meeting [lo, hi)
        blocks = scores.view(batch, chunk_rows // block_rows, block_rows)
        counters = (b0 + block_rows * torch.arange(j0, j1, device=scores.device)).clamp(min=lo)
        log_mass = block_log_mass(blocks)[:, j0:j1]  # reduced on the same shapes on every shard
        stream.add(blocks[:, j0:j1], log_mass, counters)
    return rows_from_blocks(stream.finish(), k, seed, query_keys, stream.log_z, version)


def _is_dot(spec: ScoreSpec, q: Reps, pieces: Sequence[Piece]) -> bool:
    """s(x, y) is the plain dot product of one mention and one entity vector."""
    return (spec.mention_side.count == 1 and spec.entity_side.count == 1 and q.mask is None
            and all(p.reps.mask is None and p.reps.vecs.dim() == 2 for p in pieces))


def _native_calls(pieces: Sequence[Piece], chunk_rows: int, block_rows: int, parts_wanted: int
                  ) -> list[block_native.Call]:
    """Kernel calls over the shard's rows on the grid of :func:`_exact_block_gumbel`.

    A chunk holding one piece is read in place (consecutive ones merged up to about 1 /
    ``parts_wanted`` of the rows, so each thread gets a few long calls); a chunk several
    pieces meet is copied into its padded grid layout, the rows between them excluded. A
    block's counter is max(block start, the call's first row), as on the torch path.
    """
    # the kernel walks rows of d contiguous values (a strided view is copied once)
    pieces = [p if p.reps.vecs.is_contiguous() else Piece(p.row_start, Reps(p.reps.vecs.contiguous(), p.reps.mask))
              for p in pieces]
    total = sum(p.reps.vecs.shape[0] for p in pieces)
    target = max(chunk_rows, -(-total // max(1, parts_wanted) // chunk_rows) * chunk_rows)
    calls: list[block_native.Call] = []
    empty = torch.empty(0, dtype=torch.int64)

    def counters(lo: int, j0: int, j1: int) -> Tensor:
        return (block_rows * torch.arange(j0, j1)).clamp(min=lo)

    for b0, parts in _grid_plan(pieces, chunk_rows):
        lo, hi = parts[0][1], parts[-1][2]
        j0, j1 = lo // block_rows, -(-hi // block_rows)
        if len(parts) == 1:
            piece = pieces[parts[0][0]]
            last = calls[-1] if calls else None
            # the piece's previous chunk (a copied multi-piece chunk holds another tensor)
            if last is not None and last.ent is piece.reps.vecs and last.hi == lo and last.hi - last.lo < target:
                calls[-1] = last._replace(hi=hi, j1=j1, counters=counters(last.lo, last.j0, j1))
            else:
                calls.append(block_native.Call(piece.reps.vecs, piece.row_start, lo, hi, j0, j1, empty,
                                               counters(lo, j0, j1)))
            continue
        chunk = _padded_chunk(pieces, parts, b0, chunk_rows, torch.bfloat16).vecs
        own = torch.zeros(hi - lo, dtype=torch.bool)
        for _, a, z in parts:
            own[a - lo:z - lo] = True
        calls.append(block_native.Call(chunk, b0, lo, hi, j0, j1, (~own).nonzero().squeeze(1) + lo,
                                       counters(lo, j0, j1)))
    return calls


def _native_block_gumbel(q: Reps, pieces: Sequence[Piece], k: int, gold: Tensor | None, chunk_rows: int, seed: int,
                         query_keys: Tensor, version: int, block_rows: int, dead: Tensor | None) -> ShardResult:
    """:func:`_exact_block_gumbel` with steps 1-2 in the native kernel (``block_native``)."""
    if block_rows < 1 or chunk_rows % block_rows:
        raise ValueError(f"exact_search: block_rows ({block_rows}) must divide chunk_rows ({chunk_rows})")
    threads = max(1, torch.get_num_threads())
    calls = _native_calls(pieces, chunk_rows, block_rows, threads)
    kept, log_z = block_native.run_calls(calls, q.vecs.to(torch.bfloat16), k, gold, dead, seed, query_keys,
                                         block_rows, threads)
    return rows_from_blocks(kept, k, seed, query_keys, log_z, version)


def faiss_storage_view(index, n: int, d: int, dtype: torch.dtype) -> Tensor | None:
    """Zero-copy [n, d] ``dtype`` tensor over a CPU faiss index's own row-ordered codes.

    Flat (fp32 codes) and SQfp16 (fp16 codes) store row i at bytes [i*c, (i+1)*c), c the
    code size; HNSW keeps such an index as its ``storage``. Returns None for any other
    layout. The tensor keeps ``index`` alive (tensor -> numpy -> ctypes buffer -> index;
    pass the index object that owns the C++ index), so it stays valid even if the caller
    drops the index first.
    """
    import faiss

    owner = index  # the Python object that owns the C++ index (a downcast proxy does not)
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexHNSW):
        index = faiss.downcast_index(index.storage)
    if isinstance(index, faiss.IndexScalarQuantizer):
        if index.sq.qtype != faiss.ScalarQuantizer.QT_fp16 or dtype != torch.float16:
            return None
    elif not (isinstance(index, faiss.IndexFlat) and dtype == torch.float32):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if n == 0 or index.ntotal != n or index.d != d or index.codes.size() != n * d * itemsize:
        return None
    address = faiss.rev_swig_ptr(index.codes.data(), 1).ctypes.data
    buffer = (ctypes.c_uint8 * (n * d * itemsize)).from_address(address)
    buffer.owner = owner  # the numpy array below references buffer, the tensor the array
    numpy_dtype = np.float16 if dtype == torch.float16 else np.float32
    return torch.from_numpy(np.frombuffer(buffer, dtype=numpy_dtype).reshape(n, d))


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
        self.compute = _DTYPES[config.compute]
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
        view = faiss_storage_view(index, n, dim, source_dtype)
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
        view = faiss_storage_view(self._faiss, self.num_rows, self.dim, self.entities.vecs.dtype)
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
                           self.config.sampler, self.config.block_rows, dead, self.config.kernel)
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

