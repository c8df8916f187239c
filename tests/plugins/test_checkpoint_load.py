"""Striped loads: ranged GETs of each rank's share, exchanged inside the site, CRCs combined from slices.

Pure tiers check the CRC arithmetic and the read schedule; the distributed cases run 2-4 gloo ranks against a real
SeaweedFS S3 server and record the GET requests s3fs really sends.
"""

from __future__ import annotations

import os
import random
import re
import uuid
import zlib
from collections import Counter

import pytest
import torch

from multidc.hierarchical.tools.ranks import run_ranks
from multidc.plugins.checkpoint.crc import combine, crc32_combine
from multidc.plugins.checkpoint.format import ItemLocation
from multidc.plugins.checkpoint.read_plan import MAX_GAP, plan_reads
from tests._batched import run_cases

pytestmark = pytest.mark.timeout(300)
PIECE = 32 << 10
CONFIG = {"piece_bytes": PIECE, "round_bytes": 2 * PIECE, "read_ahead_bytes": 2 * PIECE, "stripe_min_bytes": 0}


# ----------------------------------------------------------------------------- pure
@pytest.mark.parametrize("seed", range(5))
def test_combined_slice_crcs_equal_the_crc_of_the_whole(seed):
    rng = random.Random(seed)
    data = os.urandom(rng.randint(0, 200_000))
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 6)))
    slices = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    assert combine((zlib.crc32(s), len(s)) for s in slices) == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(data), 0, 0) == zlib.crc32(data)


def _loc(offset: int, rows: int, cols: int = 256) -> ItemLocation:
    return ItemLocation(file="data/rank00000.distcp", offset=offset, length=rows * cols * 4, crc32=0,
                        dtype="float32", sizes=(rows, cols))


@pytest.mark.parametrize(("sites", "rows"), [([0, 0, 0, 0], 1000), ([0, 0, 1, 1], 1000), ([0, 0, 0], 7),
                                             ([0, 1, 2], 50)])
def test_replicated_items_and_values_are_read_once_per_site_in_equal_shares_within_the_round_budget(sites, rows):
    locs = [_loc(0, rows), _loc(rows * 1024, 3)]
    value = ItemLocation(file="data/rank00000.distcp", offset=rows * 1024 + 3072, length=100, crc32=0)
    needs = [{loc: "w" for loc in [*locs, value]} for _ in sites]
    budget = 3 * PIECE
    schedule = plan_reads(needs, sites, piece_bytes=PIECE, round_bytes=budget, stripe_min_bytes=0)
    pieces = schedule.pieces()
    for index, loc in enumerate(schedule.locations):  # each site reads one copy (a request costs more than a send)
        copies = {p.copy for p in pieces if p.loc == index}
        assert len(copies) == len(set(sites))
        for copy in copies:
            ranges = sorted((p.start, p.end) for p in pieces if p.copy == copy)
            assert ranges[0][0] == 0 and ranges[-1][1] == loc.length
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    for p in pieces:
        assert p.size <= max(PIECE, 1024) and all(sites[r] == sites[p.reader] for r in p.receivers)
    big = schedule.locations.index(locs[0])
    share = {r: sum(p.size for p in pieces if p.loc == big and p.reader == r) for r in range(len(sites))}
    per_site = {s: [share[r] for r in range(len(sites)) if sites[r] == s] for s in set(sites)}
    for shares in per_site.values():  # equal shares, to a piece
        assert max(shares) - min(shares) <= PIECE
    for round_ in schedule.rounds:
        for rank in range(len(sites)):
            assert sum(p.size for p in round_ if p.reader == rank) <= budget
            assert sum(p.size for p in round_ if rank in p.receivers) <= budget


def _gets_of(schedule, rank: int) -> list[tuple[str, int, int]]:
    """(object, first byte, byte after the last) of each of ``rank``'s GETs in ``schedule``."""
    gets: dict[int, list] = {}
    for p in schedule.pieces():
        if p.reader == rank:
            loc = schedule.locations[p.loc]
            gets.setdefault(p.get, []).append((loc.file, loc.offset + p.start, loc.offset + p.end))
    for pieces in gets.values():  # a GET: one object, its pieces in order, gaps of padding only
        assert len({f for f, _, _ in pieces}) == 1
        assert all(0 <= b[1] - a[2] <= MAX_GAP for a, b in zip(pieces, pieces[1:])), pieces
    return sorted((pieces[0][0], pieces[0][1], pieces[-1][2]) for pieces in gets.values())


def test_each_rank_reads_one_contiguous_span_in_gets_of_one_piece_however_small_the_items():
    # 4 ranks of one site need 32 items of 3/4 piece and one large item: cut item by item, the small ones would
    # cost a ranged GET each (or four, striped); laid end to end and cut into 4 equal spans, each rank reads its
    # span front to back in GETs of a whole piece
    small = [_loc(i * (24 << 10), 24) for i in range(32)]
    large = _loc(32 * (24 << 10), 1000)
    needs = [{loc: "w" for loc in [*small, large]} for _ in range(4)]
    schedule = plan_reads(needs, [0] * 4, piece_bytes=PIECE, round_bytes=4 * PIECE, stripe_min_bytes=0)
    total = sum(loc.length for loc in [*small, large])
    spans = []
    for rank in range(4):
        gets = _gets_of(schedule, rank)
        assert all(a[2] == b[1] for a, b in zip(gets, gets[1:]))  # one contiguous span
        assert all(end - start <= PIECE for _, start, end in gets)
        assert len(gets) == -(-(gets[-1][2] - gets[0][1]) // PIECE)  # as few GETs as the bytes need
        spans.append((gets[0][1], gets[-1][2]))
    assert [a for a, _ in spans] == sorted(a for a, _ in spans) and spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # the spans tile the items
    assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 2 * 1024  # equal, to a row
    for p in schedule.pieces():  # everything read once is sent to the three others
        assert len(p.receivers) == 3 and p.reader not in p.receivers


def test_what_ranks_read_alone_counts_when_they_share_the_rest():
    # rank 0 alone needs 64 rows, both ranks need 64 more: rank 1 reads all of the shared rows, so each reads 64
    alone, shared = _loc(0, 64), _loc(64 * 1024, 64)
    schedule = plan_reads([{alone: "a", shared: "s"}, {shared: "s"}], [0, 0], piece_bytes=PIECE,
                          round_bytes=4 * PIECE, stripe_min_bytes=0)
    read = [sum(p.size for p in schedule.pieces() if p.reader == r) for r in range(2)]
    assert read == [64 * 1024, 64 * 1024], read


def test_replicated_state_saved_striped_is_read_back_one_shard_object_per_rank():
    # what a striped save of DDP state writes: every shard object holds a slice of each large tensor and some
    # small ones; the ranks reading it back each read one object whole, as the raw-GET bound does
    locs = []
    for rank in range(4):
        file, offset = f"data/rank{rank:05d}.distcp", 0
        for rows in (96, 16, 16, 1, 1):
            locs.append(ItemLocation(file=file, offset=offset, length=rows * 1024, crc32=0, dtype="float32",
                                     sizes=(rows, 256)))
            offset += rows * 1024 + 64 - (rows * 1024) % 64
    needs = [{loc: "w" for loc in locs} for _ in range(4)]
    schedule = plan_reads(needs, [0] * 4, piece_bytes=PIECE, round_bytes=4 * PIECE, stripe_min_bytes=8 << 10)
    objects = [{f for f, _, _ in _gets_of(schedule, rank)} for rank in range(4)]
    assert sorted(objects, key=sorted) == [{f"data/rank{r:05d}.distcp"} for r in range(4)], objects
    assert [len(_gets_of(schedule, rank)) for rank in range(4)] == [5] * 4  # 130 KiB in pieces of 32 KiB


def test_items_under_stripe_min_bytes_are_read_whole_by_one_rank_of_the_site_and_sent_to_the_others():
    # a bias every rank of a site needs: one GET per site, not one per rank (a request to the store costs more
    # than a message inside the site); ranks of another site read their own copy
    small, large = _loc(0, 4), _loc(4 * 1024, 1000)
    sites = [0, 0, 0, 1, 1]
    needs = [{small: "bias", large: "w"} for _ in sites]
    schedule = plan_reads(needs, sites, piece_bytes=PIECE, round_bytes=4 * PIECE, stripe_min_bytes=large.length + 1)
    for loc in (small, large):  # both under stripe_min_bytes: not cut across readers
        pieces = [p for p in schedule.pieces() if p.loc == schedule.locations.index(loc)]
        for site in set(sites):
            mine = sorted((p.start, p.end, p.reader) for p in pieces if sites[p.reader] == site)
            assert len({reader for *_, reader in mine}) == 1 and mine[0][0] == 0 and mine[-1][1] == loc.length
            assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))  # one whole copy per site
        for p in pieces:
            assert sorted((p.reader, *p.receivers)) == [r for r in range(len(sites)) if sites[r] == sites[p.reader]]


# ----------------------------------------------------------------------------- distributed, SeaweedFS
def _record_gets(log: list):
    """Record every GET s3fs sends in this process: (key, Range header). Returns s3fs's own method, to put back."""
    import s3fs

    original = s3fs.S3FileSystem._call_s3

    async def recording(self, method, *args, **kwargs):
        if method == "get_object":
            log.append((kwargs.get("Key"), kwargs.get("Range")))
        return await original(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = recording
    return original


ROWS = 256  # "w" is 1 MiB: 16 pieces per rank of 2


def _state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, 1024, generator=gen), "b": torch.randn(3000, generator=gen), "meta": {"step": 5}}


def _zeros() -> dict:
    return {"w": torch.zeros(ROWS, 1024), "b": torch.zeros(3000), "meta": {"step": 0}}


def _save_then_load_recording_gets(rank, world, url, options, sites):
    from multidc.hierarchical import Topology
    from multidc.plugins import Checkpointer, ReadConfig

    topology = Topology.build(site=rank * sites // world) if sites > 1 else None
    ckpt = Checkpointer(url, storage_options=options, stripe_min_mb=0, topology=topology,
                        read_config=ReadConfig(**CONFIG))
    ckpt.save(_state(), step=1)
    log: list = []
    original = _record_gets(log)
    target = _zeros()
    try:
        ckpt.load(target)
    finally:
        import s3fs

        s3fs.S3FileSystem._call_s3 = original  # the next case on these ranks records its own GETs
    ckpt.close()
    equal = all(torch.equal(target[k], v) for k, v in _state().items() if k != "meta")
    return equal, target["meta"]["step"], [(k, r) for k, r in log if k.endswith(".distcp")]


def _ranges(log) -> list[tuple[str, int, int]]:
    out = []
    for key, header in log:
        assert header and header.startswith("bytes="), (key, header)  # every shard read is a ranged GET
        first, last = header[len("bytes="):].split("-")
        out.append((key, int(first), int(last) + 1))
    return out


@pytest.fixture(scope="module")
def four_ranks(s3_server):
    """Both 4-rank saves and striped loads (one site, two sites) on one set of spawned ranks, each in its own
    bucket (starting ranks is the slow part)."""
    options = s3_server.storage_options()
    cases = {f"sites {sites}": (_save_then_load_recording_gets,
                                (s3_server.make_bucket(f"t-gets-{uuid.uuid4().hex[:12]}") + "/run", options, sites))
             for sites in (1, 2)}
    return run_cases(cases, 4, timeout=280)


@pytest.mark.parametrize("sites", [1, 2])
def test_each_rank_gets_only_its_share_by_ranged_gets_and_sites_exchange_the_rest(four_ranks, sites):
    """4 ranks load a replicated state: each site GETs the shard objects once, each rank about a quarter (one
    site) or half (two sites) of them, in ranged GETs of at most one piece; the loaded tensors are exact."""
    results = four_ranks[f"sites {sites}"]
    tensor_bytes = (ROWS * 1024 + 3000) * 4
    per_rank = []
    for equal, step, log in results:
        assert equal and step == 5
        ranges = _ranges(log)
        assert all(end - start <= PIECE for _, start, end in ranges)
        per_rank.append(sum(end - start for _, start, end in ranges))
    site_size = 4 // sites
    for rank, got in enumerate(per_rank):  # a share (to a piece), perhaps plus the small pickled value
        assert got <= tensor_bytes / site_size + 2 * PIECE + 4096, (rank, got, per_rank)
    for site in range(sites):  # each site read everything exactly once, the pickled value too: none missing
        ranks = range(site * site_size, (site + 1) * site_size)
        counts = Counter(r for rank in ranks for r in _ranges(results[rank][2]))
        assert set(counts.values()) == {1}, counts
        ranges = sorted(counts)
        assert tensor_bytes < sum(end - start for _, start, end in ranges) < tensor_bytes + 4096  # + the value
        for (k1, _, e1), (k2, s2, _) in zip(ranges, ranges[1:]):
            assert k1 != k2 or e1 <= s2


def _save(rank, world, url, options):
    from multidc.plugins import Checkpointer

    with Checkpointer(url, storage_options=options, stripe_min_mb=0) as ckpt:
        ckpt.save(_state(), step=1)


@pytest.fixture(scope="module")
def saved_by_two_ranks(s3_server) -> str:
    """``_state()`` saved once as step 1 by 2 gloo ranks (``_save``), for the load tests below to copy."""
    url = s3_server.make_bucket(f"t-saved-{uuid.uuid4().hex[:12]}") + "/run"
    run_ranks(_save, 2, url, s3_server.storage_options(), timeout=120)
    return url


def _copy(source_url: str, url: str, options: dict) -> str:
    """Copy the checkpoint at ``source_url`` to ``url``, object by object: what ``run_ranks(_save, 2, url,
    options)`` writes there, without starting two more ranks."""
    from multidc.plugins import ObjectStore

    source, target = ObjectStore(source_url, storage_options=options), ObjectStore(url, storage_options=options)
    keys = source.list_files()
    assert any(key.endswith("COMMIT.json") for key in keys) and any(key.endswith(".distcp") for key in keys), keys
    for key in keys:
        target.put(key, source.get(key))
    return url


@pytest.fixture
def saved(s3_server, s3_bucket, saved_by_two_ranks) -> str:
    """This test's own copy (``s3_bucket``/run) of the checkpoint ``saved_by_two_ranks``."""
    return _copy(saved_by_two_ranks, f"{s3_bucket}/run", s3_server.storage_options())


def _corrupt_a_byte_of_w(url: str, options: dict) -> None:
    from multidc.plugins import ObjectStore

    store = ObjectStore(url, storage_options=options)
    key = "step_0000000001/data/rank00000.distcp"
    data = bytearray(store.get(key))
    data[1000] ^= 0x10  # inside the first rows of "w", which rank 0 wrote
    store.put(key, bytes(data))


@pytest.fixture(scope="module")
def two_ranks(s3_server, saved_by_two_ranks):
    """The 2-rank loads of this module that leave no exchange half-done, on one set of spawned ranks (starting
    ranks is the slow part), each from its own copy of ``saved_by_two_ranks``; the failing ones last."""
    options = s3_server.storage_options()
    url = {name: _copy(saved_by_two_ranks, s3_server.make_bucket(f"t-load-{uuid.uuid4().hex[:12]}") + "/run",
                       options) for name in ("pieces land", "corrupt", "failed get", "failing feed")}
    _corrupt_a_byte_of_w(url["corrupt"], options)
    cases = {"pieces land": (_load_counting_copies, (url["pieces land"], options)),
             "corrupt": (_load, (url["corrupt"], options, None)),
             "failed get": (_load, (url["failed get"], options, 1)),
             "failing feed": (_load_with_failing_feed, (url["failing feed"], options))}
    return run_cases(cases, 2, timeout=280)


def _load(rank, world, url, options, fail_rank):
    from multidc.plugins import Checkpointer, ObjectStore, ObjectStoreError, ReadConfig

    calls = []
    original = ObjectStore.read_into

    def read_into(self, key, start, out, **kwargs):
        calls.append(start)
        if rank == fail_rank and len(calls) == 2:
            raise ObjectStoreError(f"injected failure of rank {rank}'s second GET")
        return original(self, key, start, out, **kwargs)

    ObjectStore.read_into = read_into
    target = _zeros()
    ckpt = Checkpointer(url, storage_options=options, read_config=ReadConfig(**CONFIG))
    try:
        ckpt.load(target)
        outcome = None
    except Exception as exc:  # the test compares every rank's
        outcome = (type(exc).__name__, str(exc))
    finally:
        ObjectStore.read_into = original  # for the next case on these ranks
    ckpt.close()
    equal = all(torch.equal(target[k], v) for k, v in _state().items() if k != "meta")
    return outcome, equal, len(calls)


def _load_counting_copies(rank, world, url, options):
    from multidc.plugins import Checkpointer, ReadConfig
    from multidc.plugins.checkpoint import reader

    copied, original = Counter(), reader._Targets.deliver

    def deliver(self, piece, buffer):
        copied[self.schedule.names[piece.loc].split(" ")[0]] += 1
        return original(self, piece, buffer)

    reader._Targets.deliver = deliver
    try:
        ckpt = Checkpointer(url, storage_options=options, stripe_min_mb=0, read_config=ReadConfig(**CONFIG))
        target = _zeros()
        target["w"] = torch.zeros(1024, ROWS).t()  # the right shape, not contiguous: its rows are not its bytes
        ckpt.load(target)
        in_place = dict(copied)
        copied.clear()
        contiguous = _zeros()
        ckpt.load(contiguous)
        ckpt.close()
    finally:
        reader._Targets.deliver = original  # for the next case on these ranks
    equal = [all(torch.equal(t[k], v) for k, v in _state().items() if k != "meta") and t["meta"] == {"step": 5}
             for t in (target, contiguous)]
    return in_place, dict(copied), equal


def test_pieces_land_straight_in_contiguous_destinations_and_others_are_copied(two_ranks):
    # GETs and receives of a tensor whose destination is contiguous with the stored dtype go into it directly
    # (no buffer, no copy), those of a pickled value into its own buffer; a non-contiguous destination takes its
    # pieces through a buffer: both load exactly
    for strided, contiguous, equal in two_ranks["pieces land"]:
        assert equal == [True, True]
        assert strided.get("w", 0) >= (ROWS * 1024 * 4) // PIECE and "b" not in strided, strided
        assert not contiguous, contiguous  # the pickled value landed in its buffer too


def test_loading_on_another_world_size_reshards_striped_reads_exactly(s3_server, saved):
    url, options = saved, s3_server.storage_options()
    for outcome, equal, _ in run_ranks(_load, 3, url, options, None, timeout=120):  # 256 rows over 3: uneven
        assert outcome is None and equal


def test_a_corrupt_byte_fails_every_rank_with_the_same_error_naming_object_range_and_tensor(two_ranks):
    results = two_ranks["corrupt"]  # a byte of "w" flipped in rank 0's shard (``_corrupt_a_byte_of_w``)
    # the same error everywhere; the other ranks' copy names the rank whose error it is ("rank 0: ...")
    outcomes = {(name, re.sub(r"^rank \d+: ", "", message)) for (name, message), _, _ in results}
    assert len(outcomes) == 1, outcomes
    name, message = outcomes.pop()
    assert name == "CheckpointCorruptError"
    assert "data/rank00000.distcp" in message and "bytes [0, " in message and "holding w" in message


def test_a_failed_get_on_one_rank_stops_every_rank_and_raises_its_error_everywhere(two_ranks):
    results = two_ranks["failed get"]
    for outcome, _, _ in results:
        assert outcome is not None and outcome[0] == "ObjectStoreError", outcome
        assert "injected failure of rank 1's second GET" in outcome[1]
    pieces_each = (ROWS * 1024 * 4 // 2) // PIECE  # rank 0's share of "w" alone
    assert results[0][2] < pieces_each // 2, results[0][2]  # rank 0 stopped reading soon after


def _load_with_broken_exchange(rank, world, url, options):
    import time

    import torch.distributed as dist

    from multidc.plugins import Checkpointer, ReadConfig

    original, sends = dist.isend, []

    def isend(*args, **kwargs):
        sends.append(1)
        if rank == 1 and len(sends) == 3:
            raise RuntimeError("injected gloo send failure on rank 1")
        return original(*args, **kwargs)

    dist.isend = isend
    ckpt = Checkpointer(url, storage_options=options, read_config=ReadConfig(**CONFIG))
    _load_with_broken_exchange.last = ckpt  # for a second load in the same process
    started = time.monotonic()
    try:
        ckpt.load(_zeros())
        outcome = "no error"
    except Exception as exc:  # the test compares every rank's
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.monotonic() - started, ckpt.timeout_s


def test_a_rank_whose_exchange_breaks_is_not_waited_for_and_its_error_is_raised_everywhere(s3_server, saved):
    """Rank 1 leaves the exchange (its send fails); rank 0, still waiting for rank 1's pieces on a group whose gloo
    timeout is hours, stops within a heartbeat (the heartbeat says a peer failed) and reports rank 1's error."""
    url, options = saved, s3_server.storage_options()
    results = run_ranks(_load_with_broken_exchange, 2, url, options, timeout=120)
    for outcome, seconds, timeout_s in results:
        assert "injected gloo send failure on rank 1" in outcome, outcome
        assert seconds < 15 and timeout_s == 1800.0


def test_a_ranged_read_stops_between_chunks_and_writes_nothing_after_the_stop(s3_server, s3_bucket):
    from multidc.plugins import ObjectStore
    from multidc.plugins.checkpoint.ranged_read import read_into
    from multidc.plugins.checkpoint.stop import Abandoned
    from multidc.plugins.checkpoint.storage import byte_view

    store = ObjectStore(f"{s3_bucket}/raw", storage_options=s3_server.storage_options())
    data = bytes(1 + i % 255 for i in range(1 << 20))  # no zero byte
    store.put("obj", data)

    class StopAfterFirstChunk:
        checks = 0

        def is_set(self):
            self.checks += 1
            return self.checks > 1

    log: list = []
    _record_gets(log)
    out = torch.zeros(len(data) - 100, dtype=torch.uint8)
    with pytest.raises(Abandoned):
        read_into(store, "obj", 100, byte_view(out, writable=True), stop=StopAfterFirstChunk(), chunk_bytes=64 << 10)
    written = int(out.nonzero().max()) + 1
    assert 0 < written <= 64 << 10
    assert out[:written].numpy().tobytes() == data[100:100 + written]
    assert int(out[written:].count_nonzero()) == 0
    assert log == [(store.path("obj").split("/", 1)[1], f"bytes=100-{len(data) - 1}")]  # one GET: no retry


def _load_with_failing_feed(rank, world, url, options):
    import threading
    import time

    from multidc.plugins import Checkpointer, ReadConfig
    from multidc.plugins.checkpoint.striped_read import StripedRead

    original, takes = StripedRead._room, []

    def room(self, size, in_place):  # the feeder asks before every GET, into a buffer or a destination
        if threading.current_thread().name == "multidc-ckpt-feed":
            takes.append(size)
            if rank == 1 and len(takes) == 3:
                raise MemoryError("injected allocation failure in rank 1's GET feed")
        return original(self, size, in_place)

    StripedRead._room = room
    ckpt = Checkpointer(url, storage_options=options, read_config=ReadConfig(**CONFIG))
    started = time.monotonic()
    try:
        ckpt.load(_zeros())
        outcome = "no error"
    except Exception as exc:  # the test compares every rank's
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        StripedRead._room = original
    return outcome, time.monotonic() - started


def test_a_failure_in_the_get_feed_fails_every_rank_promptly_instead_of_hanging(two_ranks):
    """Rank 1's read-ahead feeder fails allocating a buffer: every rank raises that error within seconds (before
    the fix the feeder thread died silently and every rank waited for the gloo timeout)."""
    for outcome, seconds in two_ranks["failing feed"]:
        assert "injected allocation failure in rank 1's GET feed" in outcome, outcome
        assert seconds < 15


def _load_twice_after_broken_exchange(rank, world, url, options):
    from multidc.plugins import Checkpointer

    first, _, _ = _load_with_broken_exchange(rank, world, url, options)
    ckpt = _load_with_broken_exchange.last
    try:
        ckpt.load(_zeros())
        second = "no error"
    except Exception as exc:  # the test compares every rank's
        second = f"{type(exc).__name__}: {exc}"
    assert isinstance(ckpt, Checkpointer)
    return first, second


def test_a_load_whose_exchange_broke_leaves_the_checkpointer_refusing_further_use_on_every_rank(s3_server,
                                                                                                  saved):
    """Rank 1's send fails mid-exchange, so sends and receives stay posted on the data group; a second load would
    match them. Every rank's next load raises a clear error telling the user to restart, instead of proceeding."""
    url, options = saved, s3_server.storage_options()
    for first, second in run_ranks(_load_twice_after_broken_exchange, 2, url, options, timeout=120):
        assert "injected gloo send failure on rank 1" in first, first
        assert "cannot be used again" in second and "Restart the job" in second, second
