"""The block sampler and the exact top-k at the cost of the GEMM: a fixed handful of device
operations per score chunk and no host synchronisation until the end (the GPU path).

Same law, counters and tie rules as :mod:`dist_nce.sampling.block_gumbel` (read its docstring
first); what changes is how steps 1-2 run over a stream of score chunks:

* **One fused pass per chunk.** ``kernels.block_reduce.block_keys`` reads the chunk's scores
  once and writes each block's log-mass L_B (gold excluded) and its key: T_B = L_B + G_B with
  the block's noise hashed in place (the integers of :func:`block_gumbel.block_noise`, whose
  torch form is ~85 launches), or, for top-k, the block max packed with its position.
* **Candidates without a threshold.** Each chunk contributes its own k best blocks (a
  ``torch.topk`` over its keys) and their scores; the k best blocks of the whole stream are
  among those (the best k of a union lie among the best k of each part).
  ``block_gumbel.BlockStream`` copies blocks above a running threshold instead, which needs a
  ``nonzero`` and so a host round trip per chunk.

Step 3 is ``block_gumbel.rows_from_blocks`` with the rows' noise from one launch of
``kernels.gumbel`` and eq. 23 on every kept row (no host round trip). With ``seed`` None the
stream is the exact top-k: the k best rows by (score desc, row asc) lie in the k best blocks by
(max desc, first row asc), by the argument of step 2 with the noise taken out; the packed
integer keys make ``torch.topk`` keep the same blocks on every shard and in the flat search.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_nce.kernels.block_reduce import block_keys
from dist_nce.kernels.gumbel import gumbel_noise_fused
from dist_nce.sampling.block_gumbel import BlockSet, block_rows_of, rows_from_blocks
from dist_nce.sampling.topk import NEG_INF, ShardResult, as_gold, result_from_keys


class FusedBlockStream:
    """k best blocks of a stream of score chunks (module docstring); ``seed`` None = top-k.

    k: rows wanted; gold: [B] or [B, e] int64 global rows (-1 = none); block_rows: b, a power
    of two; counters: [nb] int64 the counter of every block the stream will see, in order (the
    first global row of the block's piece, ``block_gumbel.block_noise``); query_keys: [B] int64
    (Gumbel only).
    """

    def __init__(self, k: int, gold: Tensor | None, block_rows: int, counters: Tensor, seed: int | None = None,
                 query_keys: Tensor | None = None, batch: int | None = None, device: torch.device | None = None):
        self.k, self.b, self.seed = k, block_rows, seed
        self.device = device if device is not None else counters.device
        if gold is None:
            gold = torch.full((batch, 0), -1, dtype=torch.int64)
        self.gold = as_gold(gold, batch).to(self.device)
        self.batch = self.gold.shape[0]
        self.query_keys = None if query_keys is None else query_keys.to(self.device)
        self.counters = counters.to(self.device)
        # every block's log-mass, for log_z at the end: [B, nb] float64 (8 bytes per block and query)
        self.log_mass = torch.empty((self.batch, counters.numel()), dtype=torch.float64, device=self.device)
        self._seen = 0
        self._keys: list[Tensor] = []
        self._counters: list[Tensor] = []
        self._scores: list[Tensor] = []

    def add(self, scores: Tensor, col0: int, j0: int, j1: int, lo: int) -> None:
        """A chunk of scores [B, C] (float32 or bf16; global rows [col0, col0 + C), C a multiple of
        b, -inf for rows to leave out besides the gold), of which blocks [j0, j1) are the
        stream's next ones; ``lo``: the first row of the call's range in the chunk (a block's
        counter is max(its first row, lo))."""
        n = j1 - j0
        key = torch.empty((self.batch, n), dtype=torch.int64 if self.seed is None else torch.float64,
                          device=self.device)
        block_keys(scores, self.gold, col0, self.b, j0, j1, self.log_mass[:, self._seen:self._seen + n], key,
                   self.seed, self.query_keys, lo, self._seen)
        kk = min(self.k, n)
        pos = torch.topk(key, kk, dim=1, sorted=False).indices.sort(dim=1).values  # counter ascending
        blocks = scores.view(self.batch, -1, self.b)[:, j0:j1]
        self._keys.append(key.gather(1, pos))
        self._counters.append(self.counters[self._seen:self._seen + n][pos])
        self._scores.append(blocks.gather(1, pos[:, :, None].expand(-1, -1, self.b)))
        self._seen += n

    def _best(self) -> tuple[BlockSet, Tensor]:
        log_z = torch.logsumexp(self.log_mass[:, :self._seen], dim=1)
        if not self._keys:
            return BlockSet(torch.zeros((self.batch, 0), dtype=torch.float64, device=self.device),
                            torch.zeros((self.batch, 0), dtype=torch.int64, device=self.device),
                            torch.zeros((self.batch, 0, self.b), device=self.device)), log_z
        keys, counters = torch.cat(self._keys, dim=1), torch.cat(self._counters, dim=1)
        # no tie to break: T is continuous (ties only among -inf blocks, which give no row), and
        # the top-k keys are distinct integers; counter ascending again for rows_from_blocks
        pos = torch.topk(keys, min(self.k, keys.shape[1]), dim=1, sorted=False).indices.sort(dim=1).values
        scores = torch.cat(self._scores, dim=1).gather(1, pos[:, :, None].expand(-1, -1, self.b)).float()
        counters = counters.gather(1, pos)
        rows = block_rows_of(counters, self.b)
        gold_hit = (rows[..., None] == self.gold[:, None, None, :]).any(-1)
        top = keys.gather(1, pos) if self.seed is not None else keys.new_zeros(pos.shape, dtype=torch.float64)
        return BlockSet(top, counters, scores.masked_fill_(gold_hit, NEG_INF)), log_z

    def finish(self, version: int = 0) -> ShardResult:
        """The k rows: a Gumbel-top-k sample (eq. 23 inside the kept blocks) or the exact top-k."""
        kept, log_z = self._best()
        if self.seed is not None:
            return rows_from_blocks(kept, self.k, self.seed, self.query_keys, log_z, version,
                                    noise=gumbel_noise_fused, filter_rows=False)
        batch, c, b = kept.scores.shape
        scores = kept.scores.reshape(batch, c * b)
        rows = block_rows_of(kept.counters, b).reshape(batch, c * b)
        return result_from_keys(scores.double(), scores, rows, self.k, log_z=log_z, version=version)
