"""Exact search over one shard's rows on a global grid: top-k and Gumbel-top-k (dense or block
sampler), in torch or the native block kernel.

Scores are computed in chunks of ``chunk_rows`` rows laid on ONE global grid, whichever shard
holds them, so a sharded search scores every row exactly as the flat search does and the merged
answer equals the flat one bit for bit (docs/design.md section 5; the options are described in
:mod:`dist_nce.index.search`).
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from dist_nce.modeling.scoring import Reps, ScoreSpec, score_all
from dist_nce.sampling import block_native
from dist_nce.sampling.block_gumbel import BlockStream, block_log_mass, block_rows_of, rows_from_blocks
from dist_nce.sampling.negatives import gumbel_topk_dense
from dist_nce.sampling.topk import ShardResult, mask_gold_, merge_results, result_from_keys

log = logging.getLogger(__name__)
_TOLD: set[str] = set()


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
    (sorted int64 global rows on the host: removed entities, excluded exactly as the gold is)."""
    out = _left_out(parts, dead, first, scores.shape[1])
    if out is not None:
        scores.index_fill_(1, out.to(scores.device, non_blocking=True), float("-inf"))
    return scores


# bytes of one score chunk on a GPU: large enough that the per-chunk launches are noise next
# to the GEMM, small enough to sit beside 12 GB of KILT embeddings and the trainer
_GPU_CHUNK_BYTES = 1 << 29
# bytes of the entity rows a chunk may copy on a GPU: a chunk a shard holds only in part is copied into
# its full padded layout, every call. Four times the score chunk: the KILT benchmark's grids (1M rows of
# 1024 bf16 at B = 128) stay as they were measured.
_GPU_ENTITY_CHUNK_BYTES = 1 << 31
_CPU_CHUNK_ROWS = 8192


def auto_chunk_rows(device: torch.device | str, batch: int, block_rows: int, vectors_per_row: int = 1,
                    vector_bytes: int | None = None) -> int:
    """``index.chunk_rows: 0`` (auto): 8192 rows on a CPU (the chunk stays in cache); on a GPU
    the power of two that keeps a [B, chunk] float32 score chunk near 512 MB (1M rows at
    B = 128, 128k at B = 1024) and, given ``vector_bytes`` (one stored entity vector), the chunk's
    entity vectors within 2 GB, between 64k and 4M rows. Divided by ``vectors_per_row`` (T for
    SOM, m for multi-m) and rounded up to a multiple of ``block_rows``: a shard's partial blocks
    are zero-padded to the full grid and scored, which for SOM's 32 token vectors per row made
    a 500-row world cost 8192 rows of GEMM, and a training batch of 8 mentions made each of two
    GPU shards of 500k BERT-base rows copy and score a 4M-row chunk (6.4 GB) every call. It
    depends on the device type, B and the entity reps' shape and dtype only, so the shards and
    the flat search of one call use the same grid."""
    if torch.device(device).type != "cuda":
        rows = _CPU_CHUNK_ROWS
    else:
        bits = (_GPU_CHUNK_BYTES // (4 * max(batch, 1))).bit_length() - 1
        if vector_bytes:
            bits = min(bits, (_GPU_ENTITY_CHUNK_BYTES // max(int(vector_bytes), 1)).bit_length() - 1)
        rows = 1 << max(16, min(22, bits))
    rows = max(1, rows // max(int(vectors_per_row), 1))
    return -(-rows // block_rows) * block_rows


def exact_search(spec: ScoreSpec, queries: Reps, entities: Reps, row_start: int, k: int, gold: Tensor | None,
                 chunk_rows: int, compute: torch.dtype = torch.float32, seed: int | None = None,
                 query_keys: Tensor | None = None, version: int = 0, sampler: str = "dense",
                 block_rows: int = 128, dead: Tensor | None = None, kernel: str = "auto",
                 share_queries: bool = True) -> ShardResult:
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
                               query_keys, version, sampler, block_rows, dead, kernel, share_queries)


def exact_search_pieces(spec: ScoreSpec, queries: Reps, pieces: Sequence[Piece], k: int, gold: Tensor | None,
                        chunk_rows: int, compute: torch.dtype = torch.float32, seed: int | None = None,
                        query_keys: Tensor | None = None, version: int = 0, sampler: str = "dense",
                        block_rows: int = 128, dead: Tensor | None = None, kernel: str = "auto",
                        share_queries: bool = True) -> ShardResult:
    """:func:`exact_search` over the disjoint contiguous ``pieces`` a shard owns (its base range
    plus the row segments KB deltas gave it), as one search: every global block is scored once
    with all of this shard's rows in it, so the answer is the one a flat search over the same
    rows gives (bit for bit, both samplers, when the shards' pieces tile whole ``block_rows``
    blocks, as ``NegativeService`` places them). On torch, repeated queries are scored once
    (:func:`shared_queries`; ``share_queries`` False scores every row, the benchmark's baseline)."""
    if sampler not in ("dense", "block"):
        raise ValueError(f"exact_search: sampler must be 'dense' or 'block', got {sampler!r}")
    q = Reps(queries.vecs.to(compute), queries.mask)
    pieces = [p for p in pieces if p.reps.vecs.shape[0]] or list(pieces[:1])
    dead = dead.cpu() if dead is not None and dead.numel() else None  # the chunk loops look it up on the host
    if not chunk_rows:
        ents = pieces[0].reps.vecs if pieces else None  # a shard that owns no rows has no piece
        per_row = ents.shape[1] if ents is not None and ents.ndim == 3 else 1
        chunk_rows = auto_chunk_rows(q.vecs.device, q.vecs.shape[0], block_rows, per_row,
                                     None if ents is None else ents.shape[-1] * ents.element_size())
    if (seed is None or sampler == "block") and kernel in ("auto", "triton"):
        why = _fused_usable(spec, q, pieces, chunk_rows, block_rows, kernel)
        if why is None:
            return _fused_search(q, pieces, k, gold, chunk_rows, seed, query_keys, version, block_rows, dead)
        if kernel == "triton":
            raise ValueError(f"index.kernel 'triton': {why}")
        if q.vecs.is_cuda:
            _say_once(f"index.kernel auto: the exact search on the GPU runs on torch here: {why}")
    if (seed is None or sampler == "block") and kernel in ("auto", "native"):
        name, why = block_native.choose(_is_dot(spec, q, pieces), q.vecs, pieces[0].reps.vecs, block_rows)
        if name is not None:
            return _native_search(q, pieces, k, gold, chunk_rows, seed, query_keys, version, block_rows, dead, name)
        if kernel == "native":
            raise ValueError(f"index.kernel 'native': {why}")
        _say_once(f"index.kernel auto: the {'top-k' if seed is None else 'block sampler'} runs on torch here: {why}")
    if seed is not None and sampler == "block":
        return _exact_block_gumbel(spec, q, pieces, k, gold, chunk_rows, compute, seed, query_keys, version,
                                   block_rows, dead, share_queries)
    result = None
    distinct, inverse = shared_queries(q) if share_queries else (q, None)
    for b0, parts in _grid_plan(pieces, chunk_rows):
        lo, hi = parts[0][1], parts[-1][2]
        block = _padded_chunk(pieces, parts, b0, chunk_rows, compute)
        scores = _expand(score_all(spec, distinct, block), inverse)[:, lo - b0:hi - b0].float()
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
                        block_rows: int, dead: Tensor | None = None, share_queries: bool = True) -> ShardResult:
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
    distinct, inverse = shared_queries(q) if share_queries else (q, None)
    for b0, parts in _grid_plan(pieces, chunk_rows):
        lo, hi = parts[0][1], parts[-1][2]
        block = _padded_chunk(pieces, parts, b0, chunk_rows, compute)
        scores = _expand(score_all(spec, distinct, block), inverse)
        scores = mask_gold_(scores if scores.dtype == torch.float32 else scores.float(), gold, b0)  # no copy
        scores = _exclude_(scores, parts, dead, b0)  # rows of no part, dead rows
        j0, j1 = (lo - b0) // block_rows, -(-(hi - b0) // block_rows)  # blocks meeting [lo, hi)
        blocks = scores.view(batch, chunk_rows // block_rows, block_rows)
        counters = (b0 + block_rows * torch.arange(j0, j1, device=scores.device)).clamp(min=lo)
        log_mass = block_log_mass(blocks)[:, j0:j1]  # reduced on the same shapes on every shard
        stream.add(blocks[:, j0:j1], log_mass, counters)
    return rows_from_blocks(stream.finish(), k, seed, query_keys, stream.log_z, version)


def shared_queries(q: Reps) -> tuple[Reps, Tensor | None]:
    """(the distinct rows of ``q``, inverse [B] int64 mapping each row to its distinct row), or
    (``q``, None) when every row differs.

    The bias monitor asks for ``bias.draws`` candidate sets of each probe mention in one request:
    the same query repeated with different Gumbel keys. Scored once per distinct query, the r
    draws share one scoring pass (on SOM that pass was ~16x the work of the probe itself); the
    noise, a function of each row's own key, still makes every draw independent.
    """
    batch = q.vecs.shape[0]
    if batch < 2:
        return q, None
    key = q.vecs.reshape(batch, -1)
    if q.mask is not None:
        key = torch.cat([key, q.mask.reshape(batch, -1).to(key.dtype)], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    if distinct.shape[0] == batch:
        return q, None
    first = torch.full((distinct.shape[0],), batch, dtype=torch.int64, device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(batch, device=inverse.device), "amin")
    return Reps(q.vecs[first], None if q.mask is None else q.mask[first]), inverse


def _expand(scores: Tensor, inverse: Tensor | None) -> Tensor:
    """Scores [U, C] of the distinct queries -> [B, C], one row per query (a copy: callers mask it)."""
    return scores if inverse is None else scores.index_select(0, inverse)


def _say_once(why: str) -> None:
    """Log once per process why a fast path is not taken."""
    if why not in _TOLD:
        _TOLD.add(why)
        log.info("%s", why)


def _fused_usable(spec: ScoreSpec, q: Reps, pieces: Sequence[Piece], chunk_rows: int, block_rows: int,
                  kernel: str) -> str | None:
    """None when :func:`_fused_search` can run, else why not. ``kernel`` auto takes it on CUDA
    devices only (on a CPU the native kernel or torch is faster than the interpreter)."""
    if kernel == "auto" and not q.vecs.is_cuda:
        return "not a CUDA device"
    if not _is_dot(spec, q, pieces):
        return "the fused path scores single-vector (dual) reps only"
    if block_rows & (block_rows - 1) or chunk_rows % block_rows:
        return f"block_rows ({block_rows}) must be a power of two dividing chunk_rows ({chunk_rows})"
    from dist_nce.kernels.triton_base import available  # imports triton: only where the fused path may run

    return available(q.vecs.device)


def _chunk_scores(q: Tensor, ents: Tensor, bf16_gemm: bool) -> Tensor:
    """[B, C] scores of queries q [B, d] against ents [C, d], in q's dtype.

    ``bf16_gemm``: bf16 rows against queries holding bf16 values (``score_dtype: bf16``):
    products exact, sums and output fp32, in one bf16 GEMM with fp32 output on CUDA
    (``torch.mm(..., out_dtype=)``); elsewhere the rows are upcast, as the torch path does."""
    if bf16_gemm and q.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(q.to(torch.bfloat16), ents.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as exc:  # an older torch: upcast instead
            _MM_OUT_DTYPE[0] = False
            _say_once(f"torch.mm(out_dtype=float32) unavailable ({exc}); bf16 rows are upcast per chunk")
    return q @ ents.to(q.dtype).t()


_MM_OUT_DTYPE = [True]  # does this torch have torch.mm(..., out_dtype=) on CUDA (2.8+)?


def _fused_search(q: Reps, pieces: Sequence[Piece], k: int, gold: Tensor | None, chunk_rows: int,
                  seed: int | None, query_keys: Tensor | None, version: int, block_rows: int,
                  dead: Tensor | None) -> ShardResult:
    """Top-k (``seed`` None) or the block sampler over the grid of :func:`exact_search`, steps
    1-2 in :class:`block_fused.FusedBlockStream`: per chunk one GEMM, one fused reduction and a
    few small operations, nothing read back to the host until the end.

    Rows that no piece covers in a chunk, and dead rows, are set to -inf in the chunk's scores
    (the gold inside the reduction); a chunk the shard holds whole is scored in place, any
    other is copied into its padded grid layout, so every chunk has the GEMM shape of the
    flat search's (bit-identical scores)."""
    from dist_nce.sampling.block_fused import FusedBlockStream

    vecs = q.vecs
    ent_dtype = pieces[0].reps.vecs.dtype
    # one host check per call: are the fp32 queries bf16 values (score_dtype bf16)?
    bf16_gemm = (ent_dtype == torch.bfloat16 and vecs.dtype == torch.float32
                 and torch.equal(vecs.to(torch.bfloat16).float(), vecs))
    plan = _grid_plan(pieces, chunk_rows)
    counters, spans = [], []
    for b0, parts in plan:
        lo, hi = parts[0][1], parts[-1][2]
        j0, j1 = (lo - b0) // block_rows, -(-(hi - b0) // block_rows)
        counters.append((b0 + block_rows * torch.arange(j0, j1)).clamp(min=lo))
        spans.append((j0, j1))
    device = vecs.device
    stream = FusedBlockStream(k, gold, block_rows, torch.cat(counters) if counters else
                              torch.zeros(0, dtype=torch.int64), seed, query_keys, batch=vecs.shape[0], device=device)
    for (b0, parts), (j0, j1) in zip(plan, spans):
        lo, hi = parts[0][1], parts[-1][2]
        piece = pieces[parts[0][0]]
        if len(parts) == 1 and lo == b0 and hi == b0 + chunk_rows:  # held whole: read in place
            ents = piece.reps.vecs[b0 - piece.row_start:b0 - piece.row_start + chunk_rows]
        else:
            ents = _padded_chunk(pieces, parts, b0, chunk_rows, ent_dtype).vecs
        scores = _chunk_scores(vecs, ents, bf16_gemm)
        stream.add(_exclude_(scores, parts, dead, b0), b0, j0, j1, lo)
    return stream.finish(version)


def _left_out(parts: list[tuple[int, int, int]], dead: Tensor | None, b0: int, width: int) -> Tensor | None:
    """Columns [n] int64 of the ``width`` columns from global row ``b0`` that no part covers, and its
    dead rows (host tensors only: no device round trip); None when there are none."""
    dead_here = None
    if dead is not None:
        a, b = torch.searchsorted(dead, torch.tensor([b0, b0 + width])).tolist()
        dead_here = dead[a:b] - b0 if b > a else None
    if dead_here is None and sum(hi - lo for _, lo, hi in parts) == width:
        return None
    own = torch.zeros(width, dtype=torch.bool)
    for _, lo, hi in parts:
        own[lo - b0:hi - b0] = True
    if dead_here is not None:
        own[dead_here] = False
    return (~own).nonzero().squeeze(1)


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
                calls[-1] = last._replace(hi=hi, j1=j1)
            else:
                calls.append(block_native.Call(piece.reps.vecs, piece.row_start, lo, hi, j0, j1, empty, empty))
            continue
        chunk = _padded_chunk(pieces, parts, b0, chunk_rows, pieces[parts[0][0]].reps.vecs.dtype).vecs
        own = torch.zeros(hi - lo, dtype=torch.bool)
        for _, a, z in parts:
            own[a - lo:z - lo] = True
        calls.append(block_native.Call(chunk, b0, lo, hi, j0, j1, (~own).nonzero().squeeze(1) + lo, empty))
    return [call._replace(counters=counters(call.lo, call.j0, call.j1)) for call in calls]  # once the calls are cut


def _native_search(q: Reps, pieces: Sequence[Piece], k: int, gold: Tensor | None, chunk_rows: int,
                   seed: int | None, query_keys: Tensor | None, version: int, block_rows: int, dead: Tensor | None,
                   kernel: str) -> ShardResult:
    """:func:`_exact_block_gumbel` (or, ``seed`` None, the exact top-k) with steps 1-2 in a native
    kernel (``block_native``: ``block_lse`` or ``block_fp32``).

    Top-k: the kernel keeps the k best blocks by (max desc, block asc), which hold the k best
    rows by (score desc, row asc) (``block_fused``'s argument), and the rows are ranked here.
    It needs no block grid, so any ``block_rows`` serves it (a block a chunk boundary cuts is two
    pieces, each a block of its own)."""
    if seed is not None and (block_rows < 1 or chunk_rows % block_rows):
        raise ValueError(f"exact_search: block_rows ({block_rows}) must divide chunk_rows ({chunk_rows})")
    threads = max(1, torch.get_num_threads())
    calls = _native_calls(pieces, chunk_rows, block_rows, threads)
    vecs = q.vecs.to(torch.bfloat16) if kernel == block_native.BF16 else q.vecs
    kept, log_z = block_native.run_calls(calls, vecs, k, gold, dead, seed, query_keys, block_rows, threads,
                                         kernel=kernel)
    if seed is not None:
        return rows_from_blocks(kept, k, seed, query_keys, log_z, version)
    batch, c, b = kept.scores.shape
    scores = kept.scores.reshape(batch, c * b)  # gold, dead and rows of no piece are -inf already
    rows = block_rows_of(kept.counters, b).reshape(batch, c * b)  # ascending: blocks sorted by counter
    return result_from_keys(scores.double(), scores, rows, k, log_z=log_z, version=version)
