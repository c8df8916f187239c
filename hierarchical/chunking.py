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
    if numel < 1 or element_size < 1 or num_shards < 1 or not chunk_mb > 0:
        raise ValueError(
            f"plan_chunks needs numel>=1, element_size>=1, num_shards>=1, chunk_mb>0; got "
            f"numel={numel}, element_size={element_size}, num_shards={num_shards}, chunk_mb={chunk_mb}."
        )
    target = max(num_shards, int(chunk_mb * MIB) // element_size)
    count = math.ceil(numel / target)
    per_chunk = math.ceil(math.ceil(numel / count) / num_shards) * num_shards
    chunks = []
    for start in range(0, numel, per_chunk):
        size = min(per_chunk, numel - start)
        chunks.append(Chunk(start, size, math.ceil(size / num_shards), num_shards))
    return chunks
