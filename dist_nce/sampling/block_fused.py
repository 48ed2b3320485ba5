"""The block sampler and the exact top-k at the cost of the GEMM: a fixed handful of device
operations per score chunk and no host synchronisation until the end (the GPU path).

Same law, counters and tie rules as :mod:`dist_nce.sampling.block_gumbel` (read its docstring
first); what changes is how steps 1-2 run over a stream of score chunks:

* **One fused reduction per chunk.** ``kernels.block_reduce`` reads the chunk's scores once
  and writes each block's max and sum exp(s - max), gold excluded: L_B = log(sum) + max.
* **All block noise at once.** G_B for every block of the call is drawn in one vectorised
  :func:`block_gumbel.block_noise` before the first chunk (the counters are known from the
  grid plan), not per chunk.
* **Candidates without a threshold.** Each chunk contributes its own k best blocks (a
  ``torch.topk`` over its [B, C/b] block keys) and their scores; the k best blocks of the
  whole stream are among those (the best k of a union lie among the best k of each part).
  ``block_gumbel.BlockStream`` copies blocks above a running threshold instead, which needs
  a ``nonzero`` and so a host round trip per chunk.

Step 3 is ``block_gumbel.rows_from_blocks`` unchanged. With ``seed`` None the same stream is
the exact top-k: a block's key is its max, and the k best rows by (score desc, row asc) lie
in the k best blocks by (max desc, first row asc), by the argument of step 2 with the noise
taken out. Chunk candidates are chosen by an integer key (ordered max bits, then block
position) so ties between blocks resolve the same way on every shard and in the flat search.
"""
from __future__ import annotations

import torch
from torch import Tensor

from dist_nce.kernels.block_reduce import block_reduce
from dist_nce.sampling.block_gumbel import BlockSet, block_noise, rows_from_blocks
from dist_nce.sampling.topk import NEG_INF, ShardResult, as_gold, result_from_keys, select_topk

_LOW32 = (1 << 32) - 1


def ordered_key(top: Tensor) -> Tensor:
    """int64 keys [B, n] ordering float32 maxima ``top`` [B, n] descending-first and, among equal
    maxima, lower positions first: torch.topk over them has no ties to break arbitrarily."""
    bits = (top + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 becomes +0.0
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    pos = torch.arange(top.shape[1], device=top.device, dtype=torch.int64)
    return (bits << 32) | (_LOW32 - pos)


class FusedBlockStream:
    """k best blocks of a stream of score chunks (module docstring); ``seed`` None = top-k.

    k: rows wanted; gold: [B] or [B, e] int64 global rows (-1 = none); block_rows: b, a power
    of two; counters: [nb] int64 the counter of every block the stream will see, in order (the
    first global row of the block's piece, ``block_gumbel.block_noise``); query_keys: [B] int64
    (Gumbel only).
    """

    def __init__(self, k: int, gold: Tensor | None, block_rows: int, counters: Tensor, seed: int | None = None,
                 query_keys: Tensor | None = None, batch: int | None = None, device: torch.device | None = None):
        self.k, self.b, self.seed, self.query_keys = k, block_rows, seed, query_keys
        self.device = device if device is not None else counters.device
        if gold is None:
            gold = torch.full((batch, 0), -1, dtype=torch.int64)
        self.gold = as_gold(gold, batch).to(self.device)
        self.batch = self.gold.shape[0]
        self.counters = counters.to(self.device)
        self.noise = (None if seed is None else
                      block_noise(seed, query_keys.to(self.device), self.counters))  # [B, nb] float64
        self._seen = 0
        self._keys: list[Tensor] = []
        self._counters: list[Tensor] = []
        self._scores: list[Tensor] = []
        self._log_z: list[Tensor] = []

    def add(self, scores: Tensor, col0: int, j0: int, j1: int) -> None:
        """A chunk of scores [B, C] (float32 or bf16; global rows [col0, col0 + C), C a multiple of
        b, -inf for rows to leave out besides the gold), of which blocks [j0, j1) are the
        stream's next ones."""
        top, mass = block_reduce(scores, self.gold, col0, self.b)
        top, mass = top[:, j0:j1], mass[:, j0:j1]
        n = j1 - j0
        log_mass = mass.double().log_().add_(top)  # log 0 + -inf = -inf: an empty block
        self._log_z.append(torch.logsumexp(log_mass, dim=1))
        if self.noise is None:
            key, pick = top.double(), ordered_key(top)
        else:
            key = log_mass.add_(self.noise[:, self._seen:self._seen + n])  # T_B = L_B + G_B
            pick = key
        kk = min(self.k, n)
        pos = torch.topk(pick, kk, dim=1, sorted=False).indices.sort(dim=1).values  # counter ascending
        blocks = scores.view(self.batch, -1, self.b)[:, j0:j1]
        self._keys.append(key.gather(1, pos))
        self._counters.append(self.counters[self._seen:self._seen + n][pos])
        self._scores.append(blocks.gather(1, pos[:, :, None].expand(-1, -1, self.b)))
        self._seen += n

    def _best(self) -> tuple[BlockSet, Tensor]:
        log_z = (torch.logsumexp(torch.stack(self._log_z), dim=0) if self._log_z else
                 torch.full((self.batch,), NEG_INF, dtype=torch.float64, device=self.device))
        if not self._keys:
            return BlockSet(torch.zeros((self.batch, 0), dtype=torch.float64, device=self.device),
                            torch.zeros((self.batch, 0), dtype=torch.int64, device=self.device),
                            torch.zeros((self.batch, 0, self.b), device=self.device)), log_z
        keys, counters = torch.cat(self._keys, dim=1), torch.cat(self._counters, dim=1)
        pos = select_topk(keys, self.k).sort(dim=1).values  # candidates are in counter order
        scores = torch.cat(self._scores, dim=1).gather(1, pos[:, :, None].expand(-1, -1, self.b)).float()
        counters = counters.gather(1, pos)
        rows = self.rows(counters)
        gold_hit = (rows[..., None] == self.gold[:, None, None, :]).any(-1) & (self.gold.shape[1] > 0)
        return BlockSet(keys.gather(1, pos), counters, scores.masked_fill_(gold_hit, NEG_INF)), log_z

    def rows(self, counters: Tensor) -> Tensor:
        """Global rows [B, c, b] of the blocks with these counters (their grid blocks)."""
        starts = torch.where(counters >= 0, counters // self.b * self.b, 0)
        return starts[:, :, None] + torch.arange(self.b, device=counters.device)

    def finish(self, version: int = 0) -> ShardResult:
        """The k rows: a Gumbel-top-k sample (eq. 23 inside the kept blocks) or the exact top-k."""
        kept, log_z = self._best()
        if self.seed is not None:
            return rows_from_blocks(kept, self.k, self.seed, self.query_keys.to(self.device), log_z, version)
        batch, c, b = kept.scores.shape
        scores = kept.scores.reshape(batch, c * b)
        return result_from_keys(scores.double(), scores, self.rows(kept.counters).reshape(batch, c * b), self.k,
                                log_z=log_z, version=version)
