"""Chunk planning: how a flat tensor is cut into pipelined chunks, each split into one shard per rail.

Pure arithmetic, no process groups, so it is unit-tested on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, start + numel)`` of the flat tensor.

    The chunk is zero-padded to ``shard_numel * num_shards`` elements so each of the ``num_shards`` rails owns
    an equal ``shard_numel``-element shard; only the last chunk of a plan can need padding.
    """

    start: int
    numel: int
    shard_numel: int
    num_shards: int

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    @property
    def padded(self) -> bool:
        return self.padded_numel != self.numel

    @property
    def end(self) -> int:
        return self.start + self.numel


def plan_chunks(numel: int, element_size: int, chunk_mb: float, num_shards: int) -> list[Chunk]:
    """Cut ``numel`` elements into chunks of about ``chunk_mb`` MiB, each a multiple of ``num_shards``.

    Args:
        numel: elements of the flat tensor (at least 1).
        element_size: bytes per element of the tensor.
        chunk_mb: target chunk size in MiB; chunks are balanced so none is much smaller than the others.
        num_shards: shards per chunk (the number of rails).

    Returns:
        Consecutive chunks covering ``[0, numel)`` exactly once.
    """
    if numel < 1 or element_size < 1 or num_shards < 1 or not (math.isfinite(chunk_mb) and chunk_mb > 0):
        raise ValueError(
            f"plan_chunks needs numel>=1, element_size>=1, num_shards>=1, finite chunk_mb>0; got "
            f"numel={numel}, element_size={element_size}, num_shards={num_shards}, chunk_mb={chunk_mb}."
        )
    # Plan in "rows" of one element per shard, so every chunk but the last is an exact multiple of num_shards
    # and no chunk exceeds the budget (unless a single row already does). Rows are spread evenly over the
    # fewest chunks that fit the budget: sizes differ by at most one row, plus the last chunk's padding.
    rows = math.ceil(numel / num_shards)
    budget_rows = max(1, int(chunk_mb * MIB) // element_size // num_shards)
    count = math.ceil(rows / budget_rows)
    base, extra = divmod(rows, count)
    chunks, start = [], 0
    for i in range(count):
        padded = (base + (i < extra)) * num_shards
        size = min(padded, numel - start)
        chunks.append(Chunk(start, size, padded // num_shards, num_shards))
        start += size
    return chunks
