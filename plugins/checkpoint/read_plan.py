"""Who reads which byte ranges of a checkpoint, in which ranged GETs, and in which rounds the ranges are exchanged.
Pure: no I/O.

A stored item (one :class:`ItemLocation`) that several ranks of one site need (a replicated tensor or value: DDP,
the replicas of HSDP) is read from the store once per site. The items that the same ranks of a site need are laid
end to end in the order they are stored and cut into one contiguous span per reader (as many of those ranks as get
at least half a piece each, the least loaded; sized so that the readers end with equal bytes), at whole rows of a
tensor, never inside a value or an item under ``stripe_min_bytes``; each reader sends what it read to the others (a
request to the store costs far more than a message inside the site). Ranks of other sites read their own copy, so
nothing needed by a whole site crosses the WAN more than once per site and no exchange leaves a site. Items needed
by one rank are read by it.

Each reader's span becomes ranged GETs of at most ``piece_bytes`` of the object (whole rows; a row larger than that
alone), each covering adjacent items (gaps of alignment padding are read and dropped): with replicated state saved
striped, a rank's span is one shard object read front to back in GETs of ``piece_bytes``, as many requests as the
bytes need. A GET's bytes are split into pieces at item bounds: the unit that is sent, copied and checksummed.

Rounds bound memory: in one round no rank reads (counted in the buffer bytes its GETs hold, ``held_bytes``), nor
receives, more than ``round_bytes`` (one GET more if a single GET is larger), and readers take turns so that every
reader with GETs left sends in every round.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass

from multidc.plugins.checkpoint.format import ItemLocation, parse_dtype
from multidc.plugins.checkpoint.read_buffers import held_bytes

MAX_GAP = 4096  # bytes between two items one GET may read across and drop (the save aligns items to 64 bytes)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of location ``loc`` (relative to the item), read by ``reader`` in GET number ``get``
    and sent to ``receivers`` (group ranks). ``copy`` numbers one complete reading of an item (one per site that
    needs it; unique in the schedule): the CRC-32s of a copy's pieces combine to the item's."""

    loc: int
    start: int
    end: int
    reader: int
    receivers: tuple[int, ...]
    copy: int
    get: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadSchedule:
    """The same on every rank: ``locations`` (sorted by object and offset), what each holds (for errors), and the
    pieces, round by round; the pieces of one GET are consecutive, in the order of their bytes."""

    locations: tuple[ItemLocation, ...]
    names: tuple[str, ...]
    rounds: tuple[tuple[Piece, ...], ...]

    def pieces(self):
        return [piece for pieces in self.rounds for piece in pieces]


def row_bytes(loc: ItemLocation) -> int:
    """Bytes of one dim-0 row of a stored tensor (a 0-d tensor is one row); the whole item for a value."""
    if loc.dtype is None:
        return max(loc.length, 1)
    element = parse_dtype(loc.dtype).itemsize
    return element * math.prod(loc.sizes[1:]) if loc.sizes else element


def plan_reads(needs: list[dict[ItemLocation, str]], sites: list[int], *, piece_bytes: int, round_bytes: int,
               stripe_min_bytes: int) -> ReadSchedule:
    """The read schedule for ``needs[rank]`` (location -> what it holds) and ``sites[rank]``. Deterministic."""
    if len(needs) != len(sites):
        raise ValueError(f"{len(needs)} ranks' needs but {len(sites)} sites")
    if piece_bytes < 1 or round_bytes < 1:
        raise ValueError(f"piece_bytes={piece_bytes} and round_bytes={round_bytes} must be >= 1")
    names: dict[ItemLocation, str] = {}
    needers: dict[ItemLocation, list[int]] = defaultdict(list)
    for rank, wanted in enumerate(needs):
        for loc, name in wanted.items():
            needers[loc].append(rank)
            names.setdefault(loc, name)
    locations = sorted(needers, key=lambda loc: (loc.region or "", loc.file, loc.offset, loc.length))
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = defaultdict(list)  # (site, holders) -> locations
    for index, loc in enumerate(locations):
        by_site: dict[int, list[int]] = defaultdict(list)
        for rank in needers[loc]:
            by_site[sites[rank]].append(rank)
        for site, ranks in by_site.items():
            groups[(site, tuple(sorted(ranks)))].append(index)
    readers: dict[int, list[list]] = defaultdict(list)  # reader -> its GETs, [(location, start, end, holders)]
    for (site, holders), reader, segments in _spans(groups, locations, piece_bytes, stripe_min_bytes):
        readers[reader] += [[(*segment, site, holders) for segment in get]
                            for get in _gets(segments, locations, piece_bytes)]
    pairs = sorted((index, site) for (site, _), items in groups.items() for index in items)
    copies = {pair: n for n, pair in enumerate(pairs)}  # one complete reading of an item per site that needs it
    queues: dict[int, list[tuple[Piece, ...]]] = {}
    number = 0
    for reader in sorted(readers):  # each reader's GETs in the order of their bytes, numbered
        queues[reader] = []
        for get in sorted(readers[reader], key=lambda g: g[0][:2]):
            queues[reader].append(tuple(Piece(index, start, end, reader, tuple(r for r in holders if r != reader),
                                              copies[index, site], number)
                                        for index, start, end, site, holders in get))
            number += 1
    return ReadSchedule(locations=tuple(locations), names=tuple(names[loc] for loc in locations),
                        rounds=_rounds(queues, round_bytes, piece_bytes))


def _spans(groups: dict, locations: list[ItemLocation], piece_bytes: int, stripe_min_bytes: int) -> list:
    """``((site, holders), reader, [(location, start, end), ...])`` per reader: the items of each group cut into
    contiguous spans, one per reader, sized so that the readers end with about equal bytes to read. Groups of one
    rank first (it reads them), then the largest first, each taking the least loaded of its ranks as readers."""
    load: dict[int, int] = defaultdict(int)  # bytes each rank reads
    total = {key: sum(locations[i].length for i in items) for key, items in groups.items()}
    out = []
    for key in sorted(groups, key=lambda k: (len(k[1]) > 1, -total[k], k)):
        holders, items = key[1], groups[key]
        count = max(1, min(len(holders), total[key] // max(1, piece_bytes // 2)))
        readers = sorted(sorted(holders, key=lambda r: (load[r], r))[:count])
        ends = list(itertools.accumulate(_shares([load[r] for r in readers], total[key])))
        cuts = _cuts(items, locations, ends[:-1], total[key], stripe_min_bytes)
        for reader, (first, last) in zip(readers, zip(cuts, cuts[1:])):
            segments, at = [], 0
            for index in items:
                length = locations[index].length
                start, end = max(first - at, 0), min(last - at, length)
                if start < end:
                    segments.append((index, start, end))
                at += length
            if segments:
                out.append((key, reader, segments))
                load[reader] += last - first
    return out


def _shares(loads: list[int], total: int) -> list[int]:
    """``total`` bytes dealt to readers that already read ``loads``: the least loaded are filled up to the others'
    level first, then all alike, so the readers end as equal as the bytes allow."""
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    level, left, filled = loads[order[0]], total, 1
    while filled < len(order) and (loads[order[filled]] - level) * filled <= left:
        left -= (loads[order[filled]] - level) * filled
        level, filled = loads[order[filled]], filled + 1
    shares = [0] * len(loads)
    base, extra = divmod(left, filled)
    for n, i in enumerate(order[:filled]):
        shares[i] = level - loads[i] + base + (n < extra)
    return shares


def _cuts(items: list[int], locations: list[ItemLocation], targets: list[int], total: int,
          stripe_min_bytes: int) -> list:
    """Positions in the items laid end to end, from 0 to their ``total`` length: each of ``targets`` (ascending)
    moved to the nearest row bound of a tensor, or item bound of a value or an item under ``stripe_min_bytes``."""
    cuts, at, k = [0], 0, 0
    for target in targets:
        if target >= total:
            cuts.append(total)
            continue
        while at + locations[items[k]].length <= target:
            at += locations[items[k]].length
            k += 1
        loc, within = locations[items[k]], target - at
        step = row_bytes(loc) if loc.dtype is not None and loc.length >= stripe_min_bytes else loc.length
        within = (within + step // 2) // step * step
        cuts.append(max(cuts[-1], at + min(within, loc.length)))
    return [*cuts, total]


def _gets(segments: list[tuple[int, int, int]], locations: list[ItemLocation], piece_bytes: int) -> list[list]:
    """One reader's span as ranged GETs, ``[(location, start, end), ...]`` each: at most ``piece_bytes`` of one
    object from the GET's first byte to its last (whole rows; a larger row alone), across gaps of at most
    ``MAX_GAP`` between items."""
    gets: list[list] = []
    file = begin = end = None  # the current GET: its object, its first byte, the byte after its last so far
    for index, start, stop in segments:
        loc = locations[index]
        row = row_bytes(loc)
        while start < stop:
            here = loc.offset + start
            joins = bool(gets) and (loc.region, loc.file) == file and 0 <= here - end <= MAX_GAP
            take = min(stop - start, (piece_bytes - (here - begin)) // row * row) if joins else 0
            if take <= 0:  # a new GET
                gets.append([])
                file, begin = (loc.region, loc.file), here
                take = min(stop - start, max(row, piece_bytes // row * row))
            gets[-1].append((index, start, start + take))
            start += take
            end = loc.offset + start
    return gets


def _rounds(queues: dict[int, list[tuple[Piece, ...]]], round_bytes: int, slot: int) -> tuple:
    rounds, heads = [], {reader: 0 for reader in queues}
    while any(heads[r] < len(queues[r]) for r in queues):
        taken: list[Piece] = []
        read: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        progress = True
        while progress:  # readers take turns, one GET each per pass, until the budgets are spent
            progress = False
            for reader in sorted(queues):
                if heads[reader] == len(queues[reader]):
                    continue
                get = queues[reader][heads[reader]]
                held = sum(held_bytes(piece.size, slot) for piece in get)
                incoming: dict[int, int] = defaultdict(int)
                for piece in get:
                    for r in piece.receivers:
                        incoming[r] += piece.size
                if read[reader] and read[reader] + held > round_bytes or any(
                        received[r] and received[r] + size > round_bytes for r, size in incoming.items()):
                    continue
                taken += get
                heads[reader] += 1
                read[reader] += held
                for r, size in incoming.items():
                    received[r] += size
                progress = True
        rounds.append(tuple(taken))
    return tuple(rounds)
