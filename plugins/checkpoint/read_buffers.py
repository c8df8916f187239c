"""Buffers of one rank's striped load, reused across pieces. Pure bookkeeping: no I/O.

Invariant (what the memory bound of docs/guides/checkpoints.md rests on): the bytes of GET buffers this rank has
allocated, in use or kept for reuse, never exceed ``limit``, except for one GET's larger than ``limit``, held
alone. Reuse never depends on a piece's exact size: a piece of more than half a slot gets a whole slot (``slot``
bytes) and uses its first ``size`` bytes; smaller and larger pieces get a buffer of their own size, freed when
released. Free slots are dropped whenever keeping them would push the total over ``limit``.
"""

from __future__ import annotations

import torch


def held_bytes(size: int, slot: int) -> int:
    """Bytes of buffer a GET of ``size`` bytes holds with slots of ``slot`` bytes. The read plan budgets rounds in
    these units: all of a round's GETs must fit the read-ahead at once (they are sent only after the last lands)."""
    return slot if slot // 2 < size <= slot else size


class GetBuffers:
    """Buffers for GETs; the caller serialises calls (one lock) and waits until :meth:`fits` before :meth:`take`.

    Args:
        limit: most bytes allocated at once (the read-ahead budget), in use plus kept free.
        slot: capacity of a reusable buffer, bytes (the piece size).
    """

    def __init__(self, *, limit: int, slot: int) -> None:
        if limit < 1 or slot < 1:
            raise ValueError(f"GetBuffers limit={limit} and slot={slot} must be >= 1")
        self.limit, self.slot = limit, slot
        self.used = 0  # capacity of the buffers handed out and not yet given back
        self.free: list[torch.Tensor] = []

    @property
    def allocated(self) -> int:
        """Bytes allocated now: in use plus kept for reuse."""
        return self.used + self.slot * len(self.free)

    def capacity(self, size: int) -> int:
        """Bytes a piece of ``size`` bytes holds while in use."""
        return held_bytes(size, self.slot)

    def fits(self, *sizes: int) -> bool:
        """Whether pieces of ``sizes`` bytes (one GET's) may be taken now (free slots can always be dropped to make
        room)."""
        return self.used == 0 or self.used + sum(self.capacity(size) for size in sizes) <= self.limit

    def take(self, size: int) -> torch.Tensor:
        """A uint8 buffer of at least ``size`` bytes (use ``buffer[:size]``); give it back with :meth:`give`."""
        need = self.capacity(size)
        if need == self.slot and self.free:
            buffer = self.free.pop()
        else:
            while self.free and self.allocated + need > self.limit:
                self.free.pop()
            buffer = torch.empty(need, dtype=torch.uint8)
        self.used += need
        return buffer

    def give(self, buffer: torch.Tensor, *, reuse: bool = True) -> None:
        """Return a buffer from :meth:`take`; ``reuse=False`` when a transfer may still read it (never reused)."""
        self.used -= buffer.numel()
        if reuse and buffer.numel() == self.slot and self.allocated + self.slot <= self.limit:
            self.free.append(buffer)


ALIGN = 16  # each received piece starts at a multiple of this: viewing it as any dtype needs aligned storage


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def receive_bytes(rounds, rank: int) -> int:
    """Bytes of the buffer that holds every piece ``rank`` receives in any one round, each at an offset that is a
    multiple of :data:`ALIGN`: at most the schedule's ``round_bytes`` (or one larger GET's pieces) plus under ``ALIGN``
    bytes per piece. Reused round after round, so no piece size ever needs to match."""
    return max((sum(aligned(p.size) for p in pieces if rank in p.receivers) for pieces in rounds), default=0)
