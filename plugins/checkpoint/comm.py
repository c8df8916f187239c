"""The few collectives a checkpoint needs, on a dedicated gloo group, with errors raised on every rank.

Every helper here is called by every rank of the group. A failure on one rank is gathered and re-raised on all
ranks (the failing rank raises its own exception; the others an exception of the same kind naming the rank), so
no rank is left waiting in a later collective.

Work that can take long (uploads, downloads, the commit, retries against a store that is down) runs in
:meth:`Comm.alive`: a worker thread does it while the calling thread exchanges a tiny heartbeat all-reduce with the
other ranks every ``heartbeat_s``. So the group's timeout bounds only how long a rank waits for an *unresponsive*
peer (a cut link, a hung or dead process), never how long a healthy peer's upload may take.
"""

from __future__ import annotations

import contextlib
import datetime
import threading

import torch
import torch.distributed as dist

from multidc.hierarchical.errors import timed_out, wan_failure
from multidc.plugins.checkpoint.format import CheckpointCorruptError
from multidc.plugins.checkpoint.object_store import ObjectStoreAuthError, ObjectStoreError, ObjectStoreNotFoundError
from multidc.plugins.checkpoint.regions import CheckpointRegionUnavailableError
from multidc.plugins.checkpoint.stop import abandoned, peer_left

_KNOWN = {cls.__name__: cls for cls in (
    ValueError, FileNotFoundError, PermissionError, TimeoutError, CheckpointCorruptError, ObjectStoreError,
    ObjectStoreAuthError, ObjectStoreNotFoundError, CheckpointRegionUnavailableError)}


def _describe(error: BaseException | None):
    """``(type name, message)`` of this rank's own error, ``(type name, message, rank)`` of an error rebuilt from
    ``rank``'s (so that passing it on names the rank where it happened, not the one that passed it), or ``(type
    name, message, None)`` of a ``secondary`` one raised here because another rank failed (a choice between ranks'
    errors, :func:`raise_gathered`, prefers the 2-tuples: errors that happened where they were raised)."""
    if error is None:
        return None
    origin = getattr(error, "origin", None)
    if origin is not None:
        return origin[1:] + origin[:1]
    return (type(error).__name__, str(error)) + ((None,) if getattr(error, "secondary", False) else ())


def _rebuild(rank: int, described, error_type=None) -> BaseException:
    """The error another rank described (:func:`_describe`), raised here. Marked ``secondary``: it happened
    elsewhere, and a choice between ranks' errors prefers the rank where it happened."""
    name, message, *origin = described
    rank = origin[0] if origin and origin[0] is not None else rank
    cls = error_type or _KNOWN.get(name, RuntimeError)
    error = cls(f"rank {rank}: {message}" if error_type is None else f"rank {rank}: {name}: {message}")
    error.secondary, error.origin = True, (rank, name, message)
    return error


def raise_gathered(described: list, own: BaseException | None) -> None:
    """Given every rank's error as :func:`_describe` gives it (``None``: none) and this rank's own, raise the same
    failure on every rank: a rank raises its own error if it happened there, the others the lowest rank's where an
    error happened (not one that only stopped because another rank left: ``secondary``), rebuilt. Returns if
    none."""
    failed = [(rank, d) for rank, d in enumerate(described) if d is not None]
    if not failed:
        return
    if own is not None and not getattr(own, "secondary", False):
        raise own
    raise _rebuild(*min(failed, key=lambda f: len(f[1]) > 2))  # the lowest rank where an error happened


def _transport_error(exc: RuntimeError) -> bool:
    """Whether ``exc`` is gloo failing to reach a peer (timeout, reset, closed connection)."""
    text = str(exc).lower()
    return isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)) or timed_out(exc) or any(
        word in text for word in ("gloo", "connection"))


class _UntilAnyFails:
    """Set once this rank's checkpoint group failed (``comm.stopped``) or the heartbeat of the current
    :meth:`Comm.alive` reported another rank's work failed (``comm.peer_failed``, read at each check: every
    ``alive`` replaces it)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def is_set(self) -> bool:
        return self.comm.stopped.is_set() or self.comm.peer_failed.is_set()

    def error(self, what: str) -> Exception:
        if self.comm.stopped.is_set():
            return abandoned(what)
        return peer_left(what)


# ``process_group=THIS_PROCESS``: this process alone, also inside a distributed job. For a caller that runs on one
# rank only (Lightning's CheckpointIO, on rank 0): a collective would wait for ranks that never come.
THIS_PROCESS = object()
_DATA_TIMEOUT = datetime.timedelta(hours=6)
_DEFAULT_TIMEOUT_S = 1800.0  # torch's default for gloo groups


def default_timeout_s(topology) -> float:
    """How long a checkpoint group waits for an unresponsive rank when not told: the ``WanConfig.timeout_s`` of the
    job's ``topology`` (``None``: no topology, torch's 1800 s)."""
    return topology.wan.timeout_s if topology is not None else _DEFAULT_TIMEOUT_S


class Comm:
    """Rank, world size and a private gloo group (``None`` in a single process without a process group)."""

    def __init__(self, group, rank: int, world_size: int, timeout_s: float = 1800.0, data_group=None,
                 topology=None) -> None:
        self.group, self.rank, self.world_size, self.timeout_s = group, rank, world_size, timeout_s
        # Bulk transfers between the ranks (striped loads) on a group of their own, from worker threads, while
        # ``group`` carries the heartbeat. Its waits are polled and end when the heartbeat fails (``stopped``).
        self.data_group = data_group
        self.global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # The first failed collective: the group is unusable from then on. Workers of ``alive`` that outlive the
        # failure check ``stopped`` before each write (upload, commit, copy into the caller's tensors).
        self.failure: BaseException | None = None
        self.stopped = threading.Event()
        # A load left its exchange with transfers (or a collective) still posted on ``data_group``: a later
        # load could match them (stale bytes, mismatched collectives), so the Checkpointer refuses further use.
        self.abandoned: BaseException | None = None
        self.peer_failed = threading.Event()  # replaced by each ``alive_outcome``
        # A beat well inside the timeout: a peer that stopped answering is noticed within timeout + one beat.
        self.heartbeat_s = min(1.0, timeout_s / 10)
        # ``(what, error) -> exception`` for a failed collective; in a multi-site job (``topology``: the job's
        # multidc.hierarchical.Topology) a WanError that names the sites and this end of the link.
        self.describe_failure = self._peer_failure
        if topology is not None and getattr(topology, "num_sites", 1) > 1:
            self.describe_failure = lambda what, exc: wan_failure(topology, what, timeout_s, exc)
        # A stop flag for work under ``alive`` that is useful only if every rank's succeeds (an upload)
        self.until_any_fails = _UntilAnyFails(self)

    @contextlib.contextmanager
    def _collective(self, what: str):
        """Turn a failed gloo collective (timeout, lost connection) into ``describe_failure``'s error."""
        try:
            yield
        except RuntimeError as exc:
            if not _transport_error(exc):  # e.g. an error raised inside the block: not about the link
                raise
            self._fail(self.describe_failure(what, exc))
            raise self.failure from exc

    def _fail(self, error: BaseException) -> None:
        """Remember the first failure (what later errors of this group, e.g. a load's after a failed heartbeat
        inside its read, are reported as) and stop the workers."""
        if self.failure is None:
            self.failure = error
            self.stopped.set()

    def abandon_exchange(self, error: BaseException) -> None:
        """Remember that a load left its exchange on ``data_group`` unfinished (``error`` is why): see
        :meth:`check_usable`. Called on every rank that left; every rank of a failed exchange leaves."""
        if self.abandoned is None:
            self.abandoned = error

    def check_usable(self) -> None:
        """Raise if an earlier collective of this group failed (the group is broken; so are, usually, the job's),
        or an earlier load abandoned transfers on the data group (a later load could receive their stale bytes)."""
        if self.failure is not None:
            raise RuntimeError(f"this Checkpointer cannot be used again: an earlier checkpoint collective failed "
                               f"({self.failure}). Restart the job; it resumes from the last committed checkpoint.")
        if self.abandoned is not None:
            raise RuntimeError(f"this Checkpointer cannot be used again: an earlier load failed during its exchange "
                               f"between ranks ({self.abandoned}) and left transfers pending on its process group. "
                               "Restart the job; it resumes from the last committed checkpoint.")

    def _peer_failure(self, what: str, exc: BaseException) -> RuntimeError:
        me = f"rank {self.global_rank}"
        if timed_out(exc):
            happened = (f"timed out after {self.timeout_s:g} s: {me} got no answer from the other ranks of the "
                        "checkpoint group (one of them hung or stopped, or the network between them failed)")
        else:
            happened = f"failed: {me} lost the connection to another rank (it died, or the network failed)"
        return dist.DistBackendError(
            f"{what} {happened}. A save in flight is abandoned (it commits only if rank 0 was already writing its "
            f"commit record); restart the job with the same command: it resumes from the last committed "
            f"checkpoint. [gloo: {exc}]")

    @classmethod
    def create(cls, process_group, *, timeout: datetime.timedelta, topology=None, data: bool = True,
               what: str = "opening the checkpoint group") -> Comm:
        """A Comm over ``process_group`` (``None``: the default group), on a new gloo group: collective, and like
        every collective here it waits ``timeout`` at most for a rank that does not come (``describe_failure``'s
        error about ``what``; with a multi-site ``topology``, a WanError naming the sites). ``data``: also a group
        for bulk transfers (striped loads). Without a process group, or with ``THIS_PROCESS``, a Comm of this
        process alone (no group, nothing collective)."""
        timeout_s = timeout.total_seconds()
        if process_group is THIS_PROCESS or not (dist.is_available() and dist.is_initialized()):
            if process_group is not None and process_group is not THIS_PROCESS:
                raise ValueError("process_group was given but torch.distributed is not initialized.")
            return cls(None, 0, 1, timeout_s=timeout_s)
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        opening = cls(None, 0, len(ranks), timeout_s=timeout_s, topology=topology)  # its errors, before the group
        with opening._collective(what):
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
            try:
                # gloo's own timeout must not end a healthy transfer that waits for a slow peer (a GET being
                # retried); liveness comes from the heartbeat on ``group``, so this one only reaps abandoned ones.
                data_group = dist.new_group(ranks=ranks, backend="gloo", timeout=max(timeout, _DATA_TIMEOUT)) \
                    if data else None
            except BaseException:
                if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                    dist.destroy_process_group(group)
                raise
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not in the checkpoint's process_group; only its members may use it.")
        return cls(group, dist.get_rank(group), len(ranks), timeout_s=timeout_s, data_group=data_group,
                   topology=topology)

    def alive(self, fn, *args, what: str):
        """Run ``fn(*args)`` on this rank while exchanging heartbeats with the others; return its value or raise
        its error (this rank's own: nothing is gathered). Every rank must call it, also those with nothing to do
        (``fn=None``).

        ``fn`` runs in a worker thread and must not use this group. The calling thread all-reduces "still
        working" flags every ``heartbeat_s`` until no rank is, so a peer is never waited on for longer than one
        beat plus the group's timeout, however long its own ``fn`` takes. A beat that times out or loses its
        connection raises ``describe_failure``'s error (the WAN cut during a save) and sets ``stopped``; ``fn``
        is then abandoned (its daemon thread must check ``stopped`` before each write).
        """
        value, error = self.alive_outcome(fn, *args, what=what)
        if error is not None:
            raise error
        return value

    def alive_outcome(self, fn, *args, what: str) -> tuple:
        """:meth:`alive`, returning ``(value, fn's Exception or None)``; only a failed heartbeat raises."""
        outcome = {"value": None, "error": None}
        done = threading.Event()
        # With a group: set once a rank's ``fn`` ended with an error (this one's too): work that waits for peers (a
        # striped load's exchange) stops waiting for one that has left. Failures persist to the last beat, which
        # every rank sees: when this returns, it is set on every rank or on none. Never set in a single process.
        self.peer_failed = peer_failed = threading.Event()

        def work():
            try:
                outcome["value"] = fn(*args) if fn is not None else None
            except Exception as exc:  # returned to the caller, which decides whom to tell
                outcome["error"] = exc
            except BaseException as exc:  # KeyboardInterrupt / SystemExit: re-raised below
                outcome["fatal"] = exc
            finally:
                done.set()

        if self.group is None:
            work()
        else:
            threading.Thread(target=work, name=f"multidc-ckpt-{what}", daemon=True).start()
            beat = torch.ones(2, dtype=torch.int32)  # [ranks still working, ranks whose fn failed]
            while beat[0].item():
                finished = done.wait(self.heartbeat_s)
                beat[0], beat[1] = int(not finished), int(finished and outcome["error"] is not None)
                with self._collective(f"checkpoint heartbeat ({what})"):
                    dist.all_reduce(beat, group=self.group)
                if beat[1].item():
                    peer_failed.set()
        if "fatal" in outcome:
            raise outcome["fatal"]
        return outcome["value"], outcome["error"]

    def all_gather(self, obj, *, what: str = "checkpoint collective (all_gather)") -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.group is None:
            return [obj]
        out = [None] * self.world_size
        with self._collective(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj``, on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        with self._collective("checkpoint collective (broadcast)"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def raise_if_any(self, fn, *args, what: str | None = None):
        """Run ``fn(*args)`` here and return its value; if it failed on any rank, raise on every rank (the failing
        rank its own exception, the others one of the same kind naming that rank). With ``what``, ``fn`` runs
        under :meth:`alive` (for work that may take long, e.g. a request that retries), whose last heartbeat
        already tells every rank whether any ``fn`` failed; without, one all-reduce of a flag does. The errors are
        gathered only then: without a failure this costs one round between the ranks (between sites, one WAN round
        trip), not the two of an object gather."""
        if what is not None:
            value, error = self.alive_outcome(fn, *args, what=what)
            if self.group is not None and not self.peer_failed.is_set():  # no rank failed
                assert error is None, "alive_outcome returned an error its heartbeat did not report"
                return value
        else:
            value, error = None, None
            try:
                value = fn(*args)
            except Exception as exc:
                error = exc
            if self.group is not None and not self._any_failed(error is not None):
                return value
        self._raise_gathered(self.all_gather(_describe(error)), error)
        return value

    def _any_failed(self, failed: bool) -> bool:
        """Whether ``failed`` holds on any rank (one all-reduce)."""
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        with self._collective("checkpoint collective (all_reduce)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _raise_gathered(self, described: list, own: BaseException | None, error_type=None, what=None) -> None:
        if error_type is None:
            return raise_gathered(described, own)
        failed = [(rank, d) for rank, d in enumerate(described) if d is not None]
        failed = [(rank, d) for rank, d in failed if len(d) == 2] or failed  # not those raised because of them
        if failed:
            detail = "; ".join(f"rank {d[2] if len(d) > 2 and d[2] is not None else rank}: {d[0]}: {d[1]}"
                               for rank, d in failed)
            raise error_type(f"{what} failed: {detail}") from own
        return None

    def plan(self, local_step, global_step) -> tuple:
        """DCP's planning round: ``local_step() -> (kept, local plan)`` on every rank, the local plans gathered on
        rank 0, ``global_step(rank 0's kept, plans) -> per-rank plans`` there, scattered: returns ``(kept, this
        rank's plan)``. An error of any rank's local step (its ``state_dict()`` included), or of the global step,
        travels in the same gather and scatter and is raised on every rank (the failing rank its own, the others
        the lowest failing rank's, rebuilt) before any rank reads or writes."""
        kept, local, error = None, None, None
        try:
            kept, local = local_step()
        except Exception as exc:  # raised below, on every rank
            error = exc
        if self.group is None:
            if error is not None:
                raise error
            return kept, global_step(kept, [local])[0]
        gathered = [None] * self.world_size if self.rank == 0 else None
        with self._collective("checkpoint planning (gather)"):
            dist.gather_object((local, _describe(error)), gathered, dst=dist.get_global_rank(self.group, 0),
                               group=self.group)
        outgoing = None
        if self.rank == 0:
            described = [d for _, d in gathered]
            if any(d is not None for d in described):
                outgoing = [(None, described)] * self.world_size
            else:
                try:
                    outgoing = [(plan, None) for plan in global_step(kept, [plan for plan, _ in gathered])]
                except Exception as exc:
                    error = exc
                    outgoing = [(None, [_describe(exc)] + [None] * (self.world_size - 1))] * self.world_size
        box = [None]
        with self._collective("checkpoint planning (scatter)"):
            dist.scatter_object_list(box, outgoing, src=dist.get_global_rank(self.group, 0), group=self.group)
        plan, described = box[0]
        if described is not None:
            raise_gathered(described, error)
        return kept, plan

    def gather_outcomes(self, result, error, *, what: str, error_type) -> list | None:
        """All ranks' ``result`` on rank 0 (``None`` on the others); if any rank had an ``error``, raise
        ``error_type`` on every rank. Call it right after the :meth:`alive_outcome` that returned ``(result,
        error)``: its last beat told every rank whether any failed, so without a failure only rank 0 gathers (the
        results of every rank on every rank would grow with the square of the job's size)."""
        if self.group is not None and not self.peer_failed.is_set():
            assert error is None, "alive_outcome returned an error its heartbeat did not report"
            gathered = [None] * self.world_size if self.rank == 0 else None
            with self._collective("checkpoint collective (gather)"):
                dist.gather_object(result, gathered, dst=dist.get_global_rank(self.group, 0), group=self.group)
            return gathered
        gathered = self.all_gather((result, _describe(error)))
        self._raise_gathered([d for _, d in gathered], error, error_type, what)
        return [r for r, _ in gathered]

    def from_rank0(self, fn, *, what: str, error_type):
        """Run ``fn()`` on rank 0 (under :meth:`alive`) and return its value on every rank, or raise its error on
        every rank."""
        value, error = self.alive_outcome(fn if self.rank == 0 else None, what=what)
        value, described = self.broadcast((value, _describe(error)))
        if described is None:
            return value
        if error is not None:
            if error_type is None:
                raise error
            raise error_type(f"{what} failed on rank 0: {described[0]}: {described[1]}") from error
        if error_type is None:
            raise _rebuild(0, described)
        raise error_type(f"{what} failed on rank 0: {described[0]}: {described[1]}")

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            if self.failure is None and self.abandoned is None and self.data_group is not None:
                # else an abandoned transfer may hold it
                dist.destroy_process_group(self.data_group)
        self.group = self.data_group = None
