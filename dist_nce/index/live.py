"""One served version of a shard after KB deltas: index pieces, removed rows, KB version.

A shard owns its base contiguous range plus the row segments KB deltas placed on it
(``dist_nce.actors.placement``). Each contiguous range is an immutable ``ShardIndex``
(a *piece*); a version is the pieces it serves, the rows removed at its KB version
(``dead``, sorted global int64) and that KB version. A delta builds a new
:class:`LiveIndex` from the old pieces (shared, not copied) plus pieces for the new rows
only, so its cost and memory are those of the delta.

Removed rows are excluded exactly as the gold is: their scores are -inf before top-k,
Gumbel keys, ``log_z`` and the bias monitor's log-sum-exp (``exact.exact_search_pieces``,
``ShardIndex.topk(dead=...)``, ``gradbias.lse_grad_all(dead=...)``). The exact path scores
all pieces on the one global block grid, so a sharded answer still equals a flat search
over the same rows, and the Gumbel noise stays keyed by global row. One piece and no dead
rows is the plain ShardIndex answer, unchanged. Every answer carries this version.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dist_nce.bias.gradbias import LseGrad, lse_grad_all, lse_grad_rows, merge as merge_lse
from dist_nce.index.exact import Piece, exact_search_pieces
from dist_nce.index.search import ShardIndex, _check_batch
from dist_nce.modeling.scoring import Reps
from dist_nce.sampling.topk import ShardResult, merge_results


class LiveIndex:
    """pieces: ShardIndex per owned contiguous range (any order); dead: sorted int64 global rows
    removed at ``kb_version`` (any rows; those outside the pieces are ignored)."""

    def __init__(self, pieces: Sequence[ShardIndex], dead: Tensor | None, version: int, kb_version: int = 0):
        if not pieces:
            raise ValueError("LiveIndex: at least one piece")
        self.pieces = sorted(pieces, key=lambda p: p.row_start)
        for a, b in zip(self.pieces, self.pieces[1:]):
            if a.row_start + a.num_rows > b.row_start:
                raise ValueError(f"LiveIndex: pieces overlap at row {b.row_start}")
        first = self.pieces[0]
        self.spec, self.config, self.compute, self.device = first.spec, first.config, first.compute, first.device
        self.version, self.kb_version = int(version), int(kb_version)
        dead = torch.zeros(0, dtype=torch.int64) if dead is None else dead.to(torch.int64).cpu()
        own = self.owns(dead)
        self.dead = dead[own].contiguous()
        self.num_rows = sum(p.num_rows for p in self.pieces)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(p.row_start, p.row_start + p.num_rows) for p in self.pieces]

    @property
    def num_live(self) -> int:
        return self.num_rows - self.dead.numel()

    def owns(self, rows: Tensor) -> Tensor:
        """bool, same shape as ``rows``: True where a piece holds the row."""
        out = torch.zeros_like(rows, dtype=torch.bool)
        for a, b in self.ranges:
            out |= (rows >= a) & (rows < b)
        return out

    def _stamp(self, result: ShardResult) -> ShardResult:
        return result._replace(version=self.version)

    def _dead(self) -> Tensor | None:
        return self.dead if self.dead.numel() else None

    def _exact_all(self, queries: Reps | Tensor, k: int, gold: Tensor | None, seed: int | None,
                   query_keys: Tensor | None) -> ShardResult:
        first = self.pieces[0]
        q = first._prepare(queries, k, gold)
        if query_keys is not None:
            _check_batch("query_keys", query_keys, q.vecs.shape[0], (1,))
        res = exact_search_pieces(
            self.spec, q, [Piece(p.row_start, p.entities) for p in self.pieces], k,
            None if gold is None else gold.to(self.device), self.config.chunk_rows, self.compute, seed,
            None if query_keys is None else query_keys.to(self.device), self.version, self.config.resolved_sampler(),
            self.config.block_rows, self._dead())
        return ShardResult(*(x.cpu() if isinstance(x, Tensor) else x for x in res))

    def topk(self, queries: Reps | Tensor, k: int, gold: Tensor | None = None) -> ShardResult:
        """``ShardIndex.topk`` over every piece, removed rows excluded."""
        if len(self.pieces) == 1:
            return self._stamp(self.pieces[0].topk(queries, k, gold, self._dead()))
        if self.config.backend == "torch":
            return self._exact_all(queries, k, gold, None, None)
        return self._stamp(merge_results([p.topk(queries, k, gold, self._dead()) for p in self.pieces], k))

    def gumbel_topk(self, queries: Reps | Tensor, k: int, gold: Tensor | None, seed: int,
                    query_keys: Tensor) -> ShardResult:
        """``ShardIndex.gumbel_topk`` over every piece (one exact pass on the global grid; in
        candidates mode each piece draws from its own candidates, as shards do)."""
        if len(self.pieces) == 1:
            return self._stamp(self.pieces[0].gumbel_topk(queries, k, gold, seed, query_keys, self._dead()))
        if self.config.gumbel_mode() == "exact":
            return self._exact_all(queries, k, gold, seed, query_keys)
        parts = [p.gumbel_topk(queries, k, gold, seed, query_keys, self._dead()) for p in self.pieces]
        return self._stamp(merge_results(parts, k))

    def score_rows(self, queries: Reps | Tensor, rows: Tensor) -> Tensor:
        """Exact s(x_b, y) [B, r] float32 for global ``rows`` [B, r] owned by this shard."""
        if not bool(self.owns(rows).all()):
            raise ValueError(f"score_rows: rows outside this shard's pieces {self.ranges}")
        out = torch.full(rows.shape, float("nan"), dtype=torch.float32)
        for p in self.pieces:
            mine = (rows >= p.row_start) & (rows < p.row_start + p.num_rows)
            if bool(mine.any()):
                scores = p.score_rows(queries, torch.where(mine, rows, p.row_start))
                out = torch.where(mine, scores, out)
        return out

    def lse_grad(self, queries: Reps | Tensor, rows: Tensor | None = None) -> LseGrad:
        """This shard's (lse, grad) of log-sum-exp s(x, .) over its live rows (``rows`` None) or
        over the rows it owns of global ``rows`` [B, S, K] (``dist_nce.bias.gradbias``)."""
        q = Reps(queries) if isinstance(queries, Tensor) else queries
        # The service sends host tensors; a GPU shard's rows are on its device, and it answers on the
        # host, as its searches do.
        q = Reps(q.vecs.to(self.device), None if q.mask is None else q.mask.to(self.device))
        dtype = torch.promote_types(self.compute, torch.float32)  # gradients of half scores are too coarse
        parts = []
        for p in self.pieces:
            if rows is None:
                dead = p._local_dead(self._dead())
                parts.append(lse_grad_all(self.spec, q, p.entities, self.config.chunk_rows or 4096, dtype,
                                          None if dead is None else dead.to(p.device)))
            else:
                local = rows.to(p.device) - p.row_start
                local = torch.where((local >= 0) & (local < p.num_rows), local, torch.full_like(local, -1))
                parts.append(lse_grad_rows(self.spec, q, p.entities, local, dtype))
        out = parts[0] if len(parts) == 1 else merge_lse(parts)
        return LseGrad(out.lse.cpu(), out.grad.cpu())
