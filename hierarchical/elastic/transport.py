"""The transport pieces of an elastic site around torchft's: quorum ids unique within a job, and the HTTP state
server a rejoining site heals from, with bounded waits.

Invariant: a request for the live state never waits on a peer that is gone or on a source that will not serve it
for longer than about ``WanConfig.timeout_s`` (plus TCP's probes); only a source that its quorum made a source and
that is still preparing its state holds requests for the heal timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import socket
import threading
import time
import urllib.request


class QuorumIdentity:
    """The manager's client, with each lighthouse quorum given an id no earlier quorum of this job had.

    torchft's manager reconfigures the rail groups only when the quorum id changes, and rendezvouses them under
    ``<store>/torchft/<quorum_id>/<rank>`` (``Manager._async_quorum``, torchft 0.2). The lighthouse numbers its quorums
    from 1 in memory, so after a lighthouse restart the ids repeat: a site whose last id comes again keeps a group
    with the old members, and the others rendezvous among keys left by the earlier quorum of that id (gloo then
    dials ports closed long ago and times out). Here a quorum gets a new id, a hash of the lighthouse's id, the
    members and ``max_step`` (the same in every member's answer), whenever

    * its lighthouse id or members differ from this site's last quorum;
    * ``max_step`` grew by more than one since this site's last quorum: the others ran a quorum without it (a
      restarted lighthouse formed its first quorum before this site's request came), which may have repeated
      this site's last id and members;
    * this site heals while its lighthouse id and members are unchanged: it failed a step the others committed,
      and (the lighthouse gives a new id to a quorum after a member's failed step) that step was not in this
      site's last quorum.

    Every member decides from the same answer and its own last quorum, which it shared with the others unless it
    missed one (then the others' lighthouse id or members changed): they agree on the id, and it differs from
    earlier ones. One case takes a failed step to converge: the quorum a site missed discarded its step, so neither
    ``max_step`` nor its own step tells it; it keeps its rails while the others rebuild theirs, the step fails
    everywhere, and the lighthouse's new id after that failure rebuilds every member's."""

    def __init__(self, client, on_quorum=None) -> None:
        self._client, self._seen, self._id, self._on_quorum = client, None, -1, on_quorum
        self._max_step: int | None = None  # of this site's last quorum

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        if self._on_quorum is not None:
            self._on_quorum(quorum)
        seen = (quorum.quorum_id, tuple(quorum.replica_ids))
        missed = self._max_step is not None and quorum.max_step > self._max_step + 1
        if seen != self._seen or missed or quorum.heal:
            key = f"{seen[0]}|{','.join(seen[1])}|{quorum.max_step}".encode()
            self._seen, self._id = seen, int.from_bytes(hashlib.blake2b(key, digest_size=7).digest(), "big")
        self._max_step = quorum.max_step
        return _Renumbered(quorum, self._id)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class _Renumbered:
    """A torchft ``QuorumResult`` with another ``quorum_id``."""

    def __init__(self, quorum, quorum_id: int) -> None:
        self._quorum, self.quorum_id = quorum, quorum_id

    def __getattr__(self, name: str):
        return getattr(self._quorum, name)


def state_server(host: str, timeout: datetime.timedelta, wait_s: float):
    """torchft's HTTP state server, advertised under ``host`` (torchft's own uses the host's name, which other
    sites may not resolve to this host), that makes a request for a state it is not about to serve wait
    ``wait_s`` at most. torchft's server holds each request until the site serves a state (``HTTPTransport.do_GET``
    waits on its lock for the transport's whole ``timeout``): a site told to heal from a peer that never got that
    quorum (the lighthouse restarted between their answers) would wait ``heal_timeout_s`` instead of failing the
    heal and trying again at the next quorum. A site whose quorum names it a source (``expect``) holds requests
    until its quorum call returns (``quorum_done``; ``timeout`` at most): it is still copying its state
    (``state_dict``, to CPU) before it serves it. The fault benchmark saw a source whose manager failed to
    reconfigure skip the send, and the healing site wait out the whole heal timeout (600 s) on it."""
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing._rwlock import RWLock

    sending = threading.Event()  # this rank's quorum made it a source of the live state

    def acquire(lock: threading.Lock, started: float, limit: float) -> None:
        """``lock``, waiting while this rank is about to serve (up to ``limit``), else ``wait_s`` from ``started``."""
        while not lock.acquire(timeout=0.25):
            waited = time.monotonic() - started
            if waited > limit or (waited > wait_s and not sending.is_set()):
                raise TimeoutError(f"this site serves no state now (waited {waited:.0f} s)")

    class _ReadWait(RWLock):
        def r_acquire(self) -> None:  # RWLock.r_acquire with bounded waits (``acquire``)
            started = time.monotonic()
            acquire(self._num_r_lock, started, self.timeout)
            try:
                self._num_r += 1
                if self._num_r == 1:
                    try:
                        acquire(self._w_lock, started, self.timeout)
                    except TimeoutError:
                        self._num_r -= 1
                        raise
            finally:
                self._num_r_lock.release()

    class _Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            _dead_peer_timeout(self.sock, wait_s)

    class _Handler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(_Connection, req)

    class _Advertised(HTTPTransport):
        def __init__(self) -> None:
            super().__init__(timeout=timeout, num_chunks=0)
            lock = _ReadWait(timeout=timeout.total_seconds())
            lock.w_acquire()  # torchft's server starts disallowed (its lock held for writing)
            self._checkpoint_lock = lock
            _dead_peer_timeout(self._server.socket, wait_s)  # inherited by the connections it accepts

        def _load_from_address(self, address: str, timeout: datetime.timedelta):
            """torchft's, over a connection that notices a peer gone (link cut, process killed, connection
            forgotten) within about ``wait_s`` + 5 s instead of waiting ``heal_timeout_s`` for a byte."""
            from torchft.checkpointing._serialization import _streaming_load

            with urllib.request.build_opener(_Handler).open(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=False)  # torchft's: the state holds non-tensor values

        @staticmethod
        def expect(quorum) -> None:
            """Called with each quorum: whether it makes this rank send its state to healing sites."""
            if quorum.recover_dst_replica_ranks:
                sending.set()
            else:
                sending.clear()

        @staticmethod
        def quorum_done() -> None:
            """The quorum call returned: this rank serves its state by now (requests get it at once), or it never
            will (e.g. torchft's manager failed to reconfigure and skipped the send): held requests end within
            ``wait_s`` of their start instead of the heal timeout."""
            sending.clear()

        def address(self) -> str:
            scheme, rest = super().address().split("://", 1)
            return f"{scheme}://{host}:{rest.split(':', 1)[1]}"

    return _Advertised()


def _dead_peer_timeout(sock: socket.socket, wait_s: float) -> None:
    """TCP keepalive probes after ``wait_s`` idle (one a second, five at most) and a user timeout of ``wait_s``
    + 5 s for unacknowledged data: a connection to a peer that is gone fails within that instead of hanging
    (a link cut mid-transfer leaves a half-open connection that nothing else times out). Linux options; other
    systems keep their defaults."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", max(1, int(wait_s))), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 5),
                        ("TCP_USER_TIMEOUT", int((wait_s + 5) * 1000))):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
