"""Where a KB delta's new rows go: the least-loaded shards, in whole grid blocks.

New entities get rows ``[first, count)`` at the end of the row space (``kb.delta``). Each
shard keeps its pieces and receives zero or more new contiguous runs:

* rows filling the last, partial grid block (``first`` not a multiple of ``grid``) go to
  the shard that owns row ``first - 1``, so that every block of the global grid lies in ONE
  shard: the block sampler's sharded answer then stays the flat answer bit for bit
  (``sampling.block_gumbel``, "Sharded == flat");
* the rest is cut into at most one run per shard, on the grid, sized by water-filling: the
  shards with the fewest live rows are filled first until loads are level (the last run
  takes any remainder), so live rows stay balanced across deltas.
"""
from __future__ import annotations

from typing import Sequence


def water_fill(loads: Sequence[int], rows: int) -> list[int]:
    """Rows per shard summing to ``rows`` that minimise the largest ``loads[i] + share[i]``
    (ties to lower shard indices)."""
    if rows < 0 or any(x < 0 for x in loads):
        raise ValueError(f"water_fill: loads and rows must be >= 0, got {list(loads)}, {rows}")
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    share = [0] * len(loads)
    left = rows
    for j in range(len(order)):  # raise shards order[:j+1] to the next level
        nxt = loads[order[j + 1]] if j + 1 < len(order) else None
        width = j + 1
        level = loads[order[j]] + share[order[j]]
        need = width * (nxt - level) if nxt is not None else left
        give = min(need, left)
        each, extra = divmod(give, width)
        for r, i in enumerate(sorted(order[:width])):
            share[i] += each + (1 if r < extra else 0)
        left -= give
        if not left:
            break
    return share


def place_rows(first: int, count: int, loads: Sequence[int], grid: int, tail_owner: int | None
               ) -> list[list[tuple[int, int]]]:
    """Runs ``[a, b)`` of new rows ``[first, count)`` per shard (module docstring).

    loads: live rows per shard after the delta's removals; grid: rows per block of the global
    grid (``IndexConfig.row_grid()``, 1 = no constraint); tail_owner: the shard owning row
    ``first - 1`` (None when ``first`` is 0).
    """
    if grid < 1 or not 0 <= first <= count:
        raise ValueError(f"place_rows: need grid >= 1 and 0 <= first <= count, got {grid}, {first}, {count}")
    out: list[list[tuple[int, int]]] = [[] for _ in loads]
    loads = list(loads)
    start = first
    if first % grid and first < count and tail_owner is not None:
        end = min(count, -(-first // grid) * grid)
        out[tail_owner].append((first, end))
        loads[tail_owner] += end - first
        start = end
    share = water_fill(loads, count - start)
    takers = [i for i in range(len(loads)) if share[i]]
    for n, i in enumerate(takers):
        # Whole blocks, rounded to the nearest; the last run ends at count.
        end = count if n == len(takers) - 1 else min(count, start + (share[i] + grid // 2) // grid * grid)
        if end > start:
            out[i].append((start, end))
        start = end
    return out
