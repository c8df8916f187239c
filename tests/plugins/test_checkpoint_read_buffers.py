"""The load's buffer bound (``read_buffers``): pure, no process group."""

from __future__ import annotations

import random

import pytest

from multidc.plugins.checkpoint.format import ItemLocation
from multidc.plugins.checkpoint.read_buffers import ALIGN, GetBuffers, held_bytes, receive_bytes
from multidc.plugins.checkpoint.read_plan import plan_reads

MIB = 1 << 20


@pytest.mark.parametrize("seed", range(4))
def test_get_buffers_never_hold_more_than_the_read_ahead_budget_with_many_distinct_piece_sizes(seed):
    """200 distinct piece sizes (items of different row sizes), taken and given back in random order: the bytes
    allocated (in use + kept for reuse) never exceed the budget; with exact-size reuse dead buffers piled up."""
    rng = random.Random(seed)
    limit, slot = 16 * MIB, 4 * MIB
    buffers, in_use, seen, reused = GetBuffers(limit=limit, slot=slot), [], set(), 0
    sizes = [rng.randint(1, slot) for _ in range(200)] + [rng.randint(1, 4096) for _ in range(50)]
    for size in sizes * 4:
        while not buffers.fits(size):  # what the feeder waits for: a release by a finished GET
            buffers.give(in_use.pop(rng.randrange(len(in_use))))
        buffer = buffers.take(size)
        assert buffer.numel() >= size
        reused += buffer.data_ptr() in seen
        seen.add(buffer.data_ptr())
        in_use.append(buffer)
        assert buffers.allocated <= limit
        assert sum(b.numel() for b in in_use) + slot * len(buffers.free) == buffers.allocated
    assert reused > len(sizes)  # slots are reused whatever the exact piece size


def test_a_piece_larger_than_the_budget_is_held_alone():
    buffers = GetBuffers(limit=MIB, slot=MIB)
    small = buffers.take(MIB)
    assert not buffers.fits(3 * MIB)
    buffers.give(small)
    assert buffers.fits(3 * MIB)
    big = buffers.take(3 * MIB)
    assert buffers.allocated == 3 * MIB and not buffers.free  # the free slot was dropped to make room
    buffers.give(big)
    assert buffers.allocated == 0


def test_the_receive_buffer_of_a_rank_is_its_largest_round_within_the_round_budget():
    """Three sites (4, 2 and 2 ranks) share 200 items of distinct sizes: every rank's receive buffer is at
    most round_bytes plus alignment, whatever the other ranks receive."""
    rng = random.Random(0)
    locs, offset = [], 0
    for i in range(200):
        cols = 64 + i
        rows = rng.randint(1, 400)
        locs.append(ItemLocation(file="data/rank00000.distcp", offset=offset, length=rows * cols * 4, crc32=0,
                                 dtype="float32", sizes=(rows, cols)))
        offset += rows * cols * 4
    sites = [0, 0, 0, 0, 1, 1, 2, 2]
    needs = [{loc: f"w{i}" for i, loc in enumerate(locs)} for _ in sites]
    round_bytes = 256 << 10
    schedule = plan_reads(needs, sites, piece_bytes=64 << 10, round_bytes=round_bytes, stripe_min_bytes=0)
    for rank in range(len(sites)):
        most = max(sum(1 for p in pieces if rank in p.receivers) for pieces in schedule.rounds)
        assert receive_bytes(schedule.rounds, rank) <= round_bytes + most * (ALIGN - 1)


@pytest.mark.parametrize("row_kib", [1, 40, 63, 65, 100])
def test_a_rounds_gets_fit_the_read_ahead_in_buffer_bytes_so_the_feeder_never_waits_on_its_own_round(row_kib):
    """A round's GETs are all held until its exchange: counted in slots (a piece of just over half a slot holds a
    whole slot), each rank's round fits round_bytes (<= read_ahead_bytes), or is one piece alone."""
    piece, round_bytes = 64 << 10, 256 << 10
    rows = 40
    locs = [ItemLocation(file="data/rank00000.distcp", offset=i * rows * row_kib * 1024, length=rows * row_kib * 1024,
                         crc32=0, dtype="uint8", sizes=(rows, row_kib * 1024)) for i in range(3)]
    needs = [{loc: f"w{i}" for i, loc in enumerate(locs)} for _ in range(4)]
    schedule = plan_reads(needs, [0, 0, 0, 0], piece_bytes=piece, round_bytes=round_bytes, stripe_min_bytes=0)
    for pieces in schedule.rounds:
        for rank in range(4):
            mine = [p for p in pieces if p.reader == rank]
            assert len(mine) <= 1 or sum(held_bytes(p.size, piece) for p in mine) <= round_bytes
