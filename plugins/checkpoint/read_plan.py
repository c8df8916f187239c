"""Who reads which byte ranges of a checkpoint, and in which rounds the ranges are exchanged. Pure: no I/O.

A stored item (one :class:`ItemLocation`) that several ranks of one site need (a replicated tensor or value:
DDP, the replicas of HSDP) is read from the store once per site: its rows are cut into equal ranges, one per
reader (as many of those ranks as get at least half a piece each, the least loaded: a small item, or a value, has
one reader, so ranged GETs stay large and few), each range into pieces of at most ``piece_bytes``; every piece is
read by one rank and sent to the site's other ranks that need it (a request to the store costs far more than a
message inside the site). Ranks of other sites read their own copy, so nothing needed by a whole site crosses the
WAN more than once per site and no exchange leaves a site. Items needed by one rank are read whole by it.

Rounds bound memory: in one round no rank reads (counted in the buffer bytes its GETs hold, ``held_bytes``), nor
receives, more than ``round_bytes`` (one piece more if a single piece is larger), and readers take turns so that
every reader with pieces left sends in every round.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from multidc.plugins.checkpoint.format import ItemLocation, parse_dtype
from multidc.plugins.checkpoint.read_buffers import held_bytes


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of location ``loc`` (relative to the item), read by ``reader`` and sent to
    ``receivers`` (group ranks). ``copy`` numbers one complete reading of the item: the CRC-32s of a copy's pieces
    combine to the item's."""

    loc: int
    start: int
    end: int
    reader: int
    receivers: tuple[int, ...]
    copy: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadSchedule:
    """The same on every rank: ``locations`` (sorted by object and offset), what each holds (for errors), and the
    pieces, round by round."""

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
    locations = sorted(needers, key=lambda loc: (loc.file, loc.offset, loc.length))
    groups = _readers(locations, needers, sites, piece_bytes, stripe_min_bytes)
    queues: dict[int, list[Piece]] = defaultdict(list)
    copies = 0
    for index, loc in enumerate(locations):
        for readers, holders in groups[index]:
            for piece in _cut(index, loc, readers, holders, piece_bytes, copies):
                queues[piece.reader].append(piece)
            copies += 1
    return ReadSchedule(locations=tuple(locations), names=tuple(names[loc] for loc in locations),
                        rounds=_rounds(queues, round_bytes, piece_bytes))


def _readers(locations: list[ItemLocation], needers: dict, sites: list[int], piece_bytes: int,
             stripe_min_bytes: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per location, its copies as ``(readers, holders)``: one per site that needs it. An item several ranks of a
    site need is read by as many of them as give each a share of at least half a piece (small ranged GETs cost a
    request each for little data; an item under ``stripe_min_bytes`` has one reader), the least loaded first,
    largest items first, so that the site's ranks read about equal bytes; the others receive it."""
    groups: list[list] = [[] for _ in locations]
    load: dict[int, int] = defaultdict(int)  # bytes each rank reads
    striped = []
    for index, loc in enumerate(locations):
        by_site: dict[int, list[int]] = defaultdict(list)
        for rank in needers[loc]:
            by_site[sites[rank]].append(rank)
        for site in sorted(by_site):
            ranks = sorted(by_site[site])
            if len(ranks) > 1:
                striped.append((index, ranks))  # some of them read, all of them receive
                continue
            groups[index].append((ranks, ranks))  # one rank needs it: it reads the whole item
            load[ranks[0]] += loc.length
    for index, ranks in sorted(striped, key=lambda s: (-locations[s[0]].length, s[0])):
        loc = locations[index]
        rows = loc.length // row_bytes(loc)
        count = max(1, min(len(ranks), rows, loc.length // max(1, piece_bytes // 2)))
        count = count if loc.length >= stripe_min_bytes else 1
        readers = sorted(sorted(ranks, key=lambda r: (load[r], r))[:count])
        for reader in readers:
            load[reader] += loc.length // count
        groups[index].append((readers, ranks))
    for copies in groups:  # one order for the copies of a location: the sites' (the plan is deterministic)
        copies.sort(key=lambda c: (sites[c[1][0]], c[0]))
    return groups


def _cut(index: int, loc: ItemLocation, readers: list[int], holders: list[int], piece_bytes: int,
         copy: int) -> list[Piece]:
    """Pieces of one copy of ``loc``: equal row ranges per reader, each cut at row bounds into <= piece_bytes."""
    if loc.length == 0:
        return []
    row = row_bytes(loc)
    rows = loc.length // row
    readers = readers[: max(1, min(len(readers), rows))]
    per_piece = max(1, piece_bytes // row)
    pieces = []
    for i, reader in enumerate(readers):
        first, last = rows * i // len(readers), rows * (i + 1) // len(readers)
        receivers = tuple(r for r in holders if r != reader)
        for start in range(first, last, per_piece):
            end = min(last, start + per_piece)
            pieces.append(Piece(index, start * row, end * row, reader, receivers, copy))
    return pieces


def _rounds(queues: dict[int, list[Piece]], round_bytes: int, slot: int) -> tuple[tuple[Piece, ...], ...]:
    rounds, heads = [], {reader: 0 for reader in queues}
    while any(heads[r] < len(queues[r]) for r in queues):
        taken: list[Piece] = []
        read: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        progress = True
        while progress:  # readers take turns, one piece each per pass, until the budgets are spent
            progress = False
            for reader in sorted(queues):
                if heads[reader] == len(queues[reader]):
                    continue
                piece = queues[reader][heads[reader]]
                ranks = (reader, *piece.receivers)
                held = held_bytes(piece.size, slot)
                if read[reader] and read[reader] + held > round_bytes or any(
                        received[r] and received[r] + piece.size > round_bytes for r in piece.receivers):
                    continue
                taken.append(piece)
                heads[reader] += 1
                read[reader] += held
                for r in ranks[1:]:
                    received[r] += piece.size
                progress = True
        rounds.append(tuple(taken))
    return tuple(rounds)
