"""One rank's part of a :class:`ReadSchedule`: ranged GETs in parallel, the exchange inside the site, CRC checks.

Invariants:

* **Straight into place.** A piece whose bytes one destination takes as stored (``direct``: same dtype, whole rows
  of a contiguous tensor) is GET into, received into and sent from that destination: no buffer, no copy.
* **Bounded memory.** Other GETs land in reused buffers (``read_buffers.GetBuffers``): at most
  ``read_ahead_bytes`` of them are allocated (in flight, waiting to be sent, or kept for reuse) at once; a round's
  other receives land in one buffer of this rank's largest round of receives (at most the schedule's
  ``round_bytes``, or one larger GET's), reused every round. A GET larger than the budget is held alone. Nothing
  holds a second copy of the share.
* **Nothing written after a stop.** Every chunk of a GET is written, and every buffered piece copied, into the
  caller's tensors only after checking ``stop`` (the checkpoint group failed) and ``halt`` (this load failed on some
  rank). A receive posted into a destination before a failure is given ``_LATE_RECEIVE_S`` to land before the load
  raises (its sender passed the round's status, so it sends at once, or never if it was lost); one still pending
  then may write into the destination later: a failed load's destinations hold no state to use.
* **The same outcome everywhere.** Every rank learns at each round whether any rank failed and then stops reading;
  afterwards the ranks gather every piece's CRC-32 and every error, so each rank raises the same error (the lowest
  failing rank's, or the first corrupt item in schedule order) or verifies every item it got.
* **Waits are bounded by liveness, not by a clock.** The exchange polls its requests and gives up as soon as the
  checkpoint group's heartbeat declares a peer lost (``stop``), i.e. within ``timeout_s`` plus one beat; a slow but
  healthy peer (a GET that retries) is waited for.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from multidc.plugins.checkpoint.comm import _describe, raise_gathered
from multidc.plugins.checkpoint.crc import combine
from multidc.plugins.checkpoint.format import CheckpointCorruptError
from multidc.plugins.checkpoint.read_buffers import GetBuffers, aligned, receive_bytes
from multidc.plugins.checkpoint.read_plan import Piece, ReadSchedule
from multidc.plugins.checkpoint.stop import Abandoned, abandoned, check_stop, peer_left

_POLL_S = 0.05  # how soon a wait notices the heartbeat failed; completion is noticed at once
_LATE_RECEIVE_S = 2.0  # after giving up, how long receives into the caller's tensors may still land


class _PeerFailed(Exception):
    """Another rank reported a failure at a round boundary; its error is the one every rank raises."""


class _Left(Exception):
    """This rank cannot follow the read's collectives any more (its group broke, or a peer left): raised as its
    ``cause``, without the gather the others would never join."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Either:
    def __init__(self, *events) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e is not None and e.is_set() for e in self.events)


class StripedRead:
    """Runs this rank's reads and exchanges of ``schedule``; ``deliver(piece, buffer)`` copies a piece's bytes (a
    uint8 tensor) into this rank's destination tensors. Call :meth:`run` on every rank of ``group``. ``regions``:
    the store of each region a location names (``ItemLocation.region``); ``store`` serves the others."""

    def __init__(self, store, checkpoint: str, schedule: ReadSchedule, deliver, *, rank: int, group, stop,
                 concurrency: int, read_ahead_bytes: int, piece_bytes: int, peer_failed=None,
                 on_abandon=None, direct=None, regions: dict | None = None) -> None:
        self.store, self.checkpoint, self.schedule, self.deliver = store, checkpoint, schedule, deliver
        self.regions = regions or {}
        self.direct = direct or (lambda piece: None)
        self.rank, self.group, self.concurrency, self.read_ahead = rank, group, concurrency, read_ahead_bytes
        self.halt = threading.Event()  # this load failed somewhere: read nothing more
        self.stop = _Either(stop, self.halt)
        self.outer_stop, self.peer_failed = stop, peer_failed
        # called with the cause when this rank leaves with transfers or a collective possibly still posted
        self.on_abandon = on_abandon
        self.crcs: dict[tuple[int, int, int], int] = {}  # _crc_key -> CRC-32 of a piece this rank read
        self._cond = threading.Condition()
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._futures: dict[tuple[int, int], object] = {}
        self._local: Exception | None = None  # this rank's first failure, not yet reported to the others
        self._feed_error: BaseException | None = None  # the GET feeder's failure, raised by _future
        self._gets = GetBuffers(limit=read_ahead_bytes, slot=piece_bytes)  # guarded by _cond
        # pieces whose GET lands in their destination (no buffer) -> size; they count against the read-ahead too, so
        # a failing load stops reading soon, as with buffers
        self._in_place: dict[tuple[int, int], int] = {}
        self._received: torch.Tensor | None = None  # allocated at the first exchange that receives

    # ------------------------------------------------------------------ driver
    def run(self, error: Exception | None = None) -> None:
        """Read, exchange, gather, verify. Raises the same error on every rank, or returns with every piece this
        rank needs delivered and its item verified. ``error``: this rank failed before reading (e.g. resolving
        its destinations); it reads nothing, and every rank raises that error.

        Every rank runs the same collectives: a status per round (did anyone fail?), the round's exchange while
        nobody has, the gather (which also carries a failure in the last round's copies). A local failure is
        reported at the next status, never raised in between. A collective that fails itself (the group broke)
        leaves at once: the others learn it from the heartbeat (``peer_failed``) and stop waiting."""
        mine = [p for p in self.schedule.pieces() if p.reader == self.rank] if error is None else []
        gets = [list(pieces) for _, pieces in itertools.groupby(mine, key=lambda p: p.get)]
        self._local = error  # reported at the first round's status (or gathered, with no round)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="multidc-ckpt-get")
        threading.Thread(target=self._feed, args=(pool, gets), name="multidc-ckpt-feed", daemon=True).start()
        try:
            for pieces in self.schedule.rounds:
                if self._any_failed(self._wait_gets(pieces)):
                    raise self._local or _PeerFailed()
                self._exchange(pieces)
            if self._local is not None:  # a failure in the last exchange's copies: the gather tells every rank
                raise self._local
        except _Left as left:
            self.halt.set()
            self._abandon(left.cause)
            raise left.cause from None
        except Exception as exc:  # gathered below: every rank raises the same error
            error = exc
            self.halt.set()
        finally:
            with self._cond:
                self._cond.notify_all()
            pool.shutdown(wait=False, cancel_futures=True)
        check_stop(self.outer_stop, f"loading {self.store.where(self.checkpoint)}")
        own = None if error is None or isinstance(error, _PeerFailed) else error
        try:
            gathered = self._gather((self.crcs, _describe(own)))
        except _Left as left:
            self._abandon(left.cause)
            raise left.cause from None
        raise_gathered([d for _, d in gathered], own)
        if error is not None:  # a peer failed but reported nothing: cannot happen, never silently pass
            raise error
        self._verify({key: crc for crcs, _ in gathered for key, crc in crcs.items()})

    def _abandon(self, cause: BaseException) -> None:
        if self.on_abandon is not None:
            self.on_abandon(cause)

    def _wait_gets(self, pieces: tuple[Piece, ...]) -> bool:
        """Wait for this rank's GETs of the round; whether this rank has failed so far (``_local``). Raises only
        :class:`_Left`."""
        try:
            for piece in pieces:
                if piece.reader == self.rank and self._local is None:
                    self._wait_future(self._future(piece))
        except _Left:
            raise
        except Exception as exc:  # reported at this round's status, before the exchange
            self._local = exc
        return self._local is not None

    # ------------------------------------------------------------------ GETs (read-ahead)
    def _feed(self, pool: ThreadPoolExecutor, gets: list[list[Piece]]) -> None:
        """Submit this rank's GETs within the read-ahead budget. Any failure here (a buffer allocation, a submit)
        is kept in ``_feed_error`` for :meth:`_future` to raise: a silently dead feed would leave the reading
        thread waiting forever while the heartbeat still reports this rank as working."""
        try:
            for pieces in gets:
                targets = [self.direct(piece) for piece in pieces]
                with self._cond:
                    while not self._room(pieces, targets) and not self.stop.is_set():
                        self._cond.wait(0.1)
                    if self.stop.is_set():
                        return
                    buffers = []
                    for piece, target in zip(pieces, targets):
                        key = (piece.loc, piece.start)
                        if target is None:
                            target = self._take(piece.size)
                        else:  # straight into the destination
                            self._in_place[key] = piece.size
                        self._buffers[key] = target
                        buffers.append(target)
                    future = pool.submit(self._get, pieces, buffers)
                    for piece in pieces:
                        self._futures[(piece.loc, piece.start)] = future
                    self._cond.notify_all()
        except BaseException as exc:  # every failure must reach the reading thread
            with self._cond:
                self._feed_error = exc
                self._cond.notify_all()

    def _room(self, pieces: list[Piece], targets: list) -> bool:
        """Whether a GET of ``pieces`` may start now: its buffers within their budget; the bytes GETs write into
        destinations within the same read-ahead (one GET at least)."""
        buffered = [piece.size for piece, target in zip(pieces, targets) if target is None]
        in_place = sum(piece.size for piece, target in zip(pieces, targets) if target is not None)
        ahead = sum(self._in_place.values())
        return (not buffered or self._gets.fits(*buffered)) and (
            not in_place or ahead == 0 or ahead + in_place <= self.read_ahead)

    def _future(self, piece: Piece):
        key = (piece.loc, piece.start)
        with self._cond:
            while key not in self._futures:
                if self._feed_error is not None:
                    raise self._feed_error
                check_stop(self.stop, "waiting for a download")
                self._check_peers("waiting for a download")
                self._cond.wait(0.1)
            return self._futures[key]

    def _wait_future(self, future) -> None:
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except FutureTimeout:
                self._check_peers("waiting for a download")

    def store_of(self, loc):
        """The store that holds ``loc``'s object."""
        return self.regions[loc.region] if loc.region is not None else self.store

    def _get(self, pieces: list[Piece], buffers: list[torch.Tensor]) -> None:
        """One ranged GET of ``pieces`` (adjacent in one object, gaps of padding between them dropped), each
        into its buffer or destination; then each piece's CRC, and delivery of those that need a copy."""
        from multidc.plugins.checkpoint.storage import byte_view

        locs = [self.schedule.locations[piece.loc] for piece in pieces]
        begin = locs[0].offset + pieces[0].start
        views = [byte_view(buffer, writable=True) for buffer in buffers]
        parts = [(loc.offset + piece.start - begin, view) for loc, piece, view in zip(locs, pieces, views)]
        self.store_of(locs[0]).read_into(f"{self.checkpoint}/{locs[0].file}", begin, parts, stop=self.stop)
        for piece, view, buffer in zip(pieces, views, buffers):
            self.crcs[_crc_key(piece)] = zlib.crc32(view)  # off the event loop, while other GETs stream
            check_stop(self.stop, f"loading {self.store.where(self.checkpoint)}")
            if (piece.loc, piece.start) not in self._in_place:
                self.deliver(piece, buffer)
            if not piece.receivers:
                self._release(piece)

    def _release(self, piece: Piece) -> None:
        with self._cond:
            key = (piece.loc, piece.start)
            buffer = self._buffers.pop(key, None)
            if key in self._in_place:  # the destination itself: nothing to give back
                del self._in_place[key]
            elif buffer is not None:  # after a failure a send may still read it: never reused then
                self._gets.give(buffer._base, reuse=not self.halt.is_set())  # the whole buffer _take narrowed
            self._cond.notify_all()

    def _take(self, size: int) -> torch.Tensor:
        return self._gets.take(size)[:size]

    # ------------------------------------------------------------------ exchange inside the site
    def _any_failed(self, failed: bool) -> bool:
        if self.group is None:
            return failed
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        self._poll([dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)])
        return bool(flag.item())

    def _exchange(self, pieces: tuple[Piece, ...]) -> None:
        """Send this rank's pieces of the round to their receivers and receive its own; copy them into place. A
        failed copy is kept in ``_local`` (reported at the next status); a failed transfer raises :class:`_Left`."""
        works, received, offset, in_place = [], [], 0, []
        if self.group is None:
            return self._release_round(pieces)
        try:
            for tag, piece in enumerate(pieces):
                target = self.direct(piece) if self.rank in piece.receivers else None
                if target is not None:  # straight into the destination
                    works.append(dist.irecv(target, src=self._global(piece.reader), group=self.group, tag=tag))
                    in_place.append(works[-1])
                elif self.rank in piece.receivers:
                    if self._received is None:
                        self._received = torch.empty(receive_bytes(self.schedule.rounds, self.rank),
                                                     dtype=torch.uint8)
                    buffer = self._received[offset:offset + piece.size]
                    offset += aligned(piece.size)
                    works.append(dist.irecv(buffer, src=self._global(piece.reader), group=self.group, tag=tag))
                    received.append((piece, buffer))
                elif piece.reader == self.rank and piece.receivers:
                    buffer = self._buffers[(piece.loc, piece.start)]
                    works += [dist.isend(buffer, dst=self._global(r), group=self.group, tag=tag)
                              for r in piece.receivers]
        except Exception as exc:  # posting failed: the group is broken for this rank
            raise _Left(exc) from exc
        # giving up with a receive into the caller's tensors posted: let a send already under way land first, so
        # the load does not write into them after it raised (a lost sender never sends; the wait is bounded)
        self._poll(works, late=in_place)
        try:
            for piece, buffer in received:
                check_stop(self.stop, f"loading {self.store.where(self.checkpoint)}")
                self.deliver(piece, buffer)
        except Exception as exc:
            self._local = exc
        self._release_round(pieces)

    def _release_round(self, pieces: tuple[Piece, ...]) -> None:
        for piece in pieces:
            if piece.reader == self.rank:
                self._release(piece)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _poll(self, works: list, late: list = ()) -> None:
        """Wait for ``works``. Gives up (:class:`_Left`) when this rank's checkpoint group failed (``stop``) or
        when another rank left the read with an error (``peer_failed``, from the heartbeat): so no wait outlasts
        a lost peer by more than the group's timeout plus one beat, and a healthy slow peer is waited for.

        gloo's send/recv works complete only inside ``wait()``, so a helper thread waits and this one watches;
        after giving up the helper is left blocked (daemon) on a group this read no longer uses."""
        done, failed = threading.Event(), []

        def wait_all():
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # raised below, in the reading thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait_all, name="multidc-ckpt-exchange", daemon=True).start()
        try:
            while not done.wait(_POLL_S):
                self._check_peers("exchanging checkpoint pieces")
            if failed:
                raise _Left(failed[0]) from failed[0]
        except _Left:
            _let_land(late)
            raise

    def _check_peers(self, what: str) -> None:
        if self.outer_stop is not None and self.outer_stop.is_set():
            raise _Left(abandoned(what))
        if self.peer_failed is not None and self.peer_failed.is_set():
            raise _Left(peer_left(what))

    def _gather(self, obj) -> list:
        """``all_gather_object`` with polled waits (see :meth:`_poll`)."""
        if self.group is None:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(self.group))]
        self._poll([dist.all_gather(sizes, torch.tensor([data.numel()]), group=self.group, async_op=True)])
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
        self._poll([dist.all_gather(out, padded, group=self.group, async_op=True)])
        # the group's own ranks wrote these: pickle is trusted here, unlike anything read from storage
        return [pickle.loads(t[:int(s)].numpy().tobytes()) for t, s in zip(out, sizes)]

    # ------------------------------------------------------------------ verification
    def _verify(self, crcs: dict[tuple[int, int, int], int]) -> None:
        """Check every copy of every item against the commit record (on every rank: the same verdict)."""
        copies: dict[tuple[int, int], list[Piece]] = {}
        for piece in self.schedule.pieces():
            copies.setdefault((piece.loc, piece.copy), []).append(piece)
        for (index, _), pieces in sorted(copies.items()):
            loc = self.schedule.locations[index]
            pieces.sort(key=lambda p: p.start)
            crc = combine((crcs[_crc_key(p)], p.size) for p in pieces)
            if crc != loc.crc32:
                raise CheckpointCorruptError(
                    f"corrupt shard {loc.file} of checkpoint {self.store_of(loc).where(self.checkpoint)}: bytes "
                    f"[{loc.offset}, {loc.offset + loc.length}) holding {self.schedule.names[index]} have crc32 "
                    f"{crc:08x}, the commit record says crc32 {loc.crc32:08x}. The object was changed or damaged "
                    "after it was committed; load an older checkpoint (list_checkpoints) instead.")


def _let_land(receives: list) -> None:
    """Give receives posted into the caller's tensors up to ``_LATE_RECEIVE_S`` to complete before the load raises:
    their senders passed the round's status, so a live one sends at once (a lost one never does)."""
    if not receives:
        return
    landed = threading.Event()

    def wait():
        for work in receives:
            try:
                work.wait()
            except Exception:  # noqa: BLE001, S112  (the load raises its own error; a failed receive wrote nothing)
                continue
        landed.set()

    threading.Thread(target=wait, name="multidc-ckpt-late-receives", daemon=True).start()
    landed.wait(_LATE_RECEIVE_S)


def _crc_key(piece: Piece) -> tuple[int, int, int]:
    return piece.loc, piece.copy, piece.start


__all__ = ["Abandoned", "StripedRead"]
