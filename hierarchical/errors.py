"""The WAN error type and the text of every inter-site failure.

``WanError`` is what a hierarchical collective (the all-reduce, the DDP hook) or a checkpoint collective of a
multi-site job raises when the link between sites fails or times out. Every message has one shape: what failed
between which sites, the rank and its end of the link, whether it timed out or lost the connection, what to do,
and gloo's own words.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multidc.hierarchical.topology import Topology


class WanError(RuntimeError):
    """A hierarchical collective failed or timed out because of the WAN between sites.

    The message names the sites, the rail link (the ranks at both ends, this end's interface and address) and
    whether it timed out (after ``WanConfig.timeout_s``) or the connection broke. After it, the topology is
    unusable: every later collective on it fails at once with the same error (the process groups may hold
    unmatched operations). Restart the job; it resumes from the last committed checkpoint.
    """


def timed_out(exc: BaseException) -> bool:
    """Whether a gloo error is a timeout (rather than a lost connection)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _sites(topo: Topology) -> str:
    names = [repr(name) for name in topo.layout.site_names]
    if len(names) == 2:
        return f"site {names[0]} and site {names[1]}"
    return f"sites {', '.join(names[:-1])} and {names[-1]}"


def _rail_link(topo: Topology) -> str:
    """``the rail-0 link (rank 0 of site '0' <-> rank 2 of site '1'; this end: interface wan0 10.213.0.10)``."""
    ends = " <-> ".join(f"rank {r} of site {topo.layout.site_names[topo.layout.site_of(r)]!r}"
                        for r in topo.layout.rail_ranks(topo.rail))
    return f"the rail-{topo.rail} link ({ends}; this end: {_local_interface()})"


def _local_interface() -> str:
    """The interface gloo uses (``GLOO_SOCKET_IFNAME``) and its IPv4 address, as far as they can be told."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if not name:
        return f"host {socket.gethostname()} (GLOO_SOCKET_IFNAME unset)"
    try:
        import fcntl  # POSIX only

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return f"interface {name} {socket.inet_ntoa(packed[20:24])}"
    except (ImportError, OSError):
        return f"interface {name}"


_ADVICE = ("Check the network between the sites (`multidc doctor` measures it), then restart the job with the "
           "same command: it resumes from the last committed checkpoint. If the link is only slow or a site "
           "regularly lags (checkpointing, data loading), raise WanConfig.timeout_s / MULTIDC_WAN_TIMEOUT_S.")


def _failure_text(topo: Topology, what: str, timeout_s: float, exc: BaseException, *, missing: str, lost: str,
                  over: str, suspect: str = "a rank of another site") -> str:
    """The one shape of every inter-site failure message: what failed between which sites, timed out (no
    ``missing`` over ``over``) or lost the connection (``lost``), who may have stopped or died (``suspect``),
    the advice, and gloo's own words."""
    me = f"rank {topo.rank} (site {topo.site_name!r})"
    if timed_out(exc):
        happened = (f"timed out after {timeout_s:g} s: {me} got no {missing} over {over}. The link between the sites "
                    f"is down or congested, or {suspect} stopped.")
    else:
        happened = (f"failed: {me} lost the connection {lost} over {over}. {suspect[0].upper()}{suspect[1:]} died or "
                    "the link was reset.")
    return f"{what} between {_sites(topo)} {happened} {_ADVICE} [gloo: {exc}]"


def _wan_message(topo: Topology, timeout_s: float, i: int, chunks: int, exc: BaseException) -> str:
    chunk = f"chunk {i + 1}/{chunks}"
    return _failure_text(topo, "WAN collective", timeout_s, exc, missing=f"data for {chunk}", lost=f"during {chunk}",
                         over=_rail_link(topo))


def wan_failure(topology: Topology, what: str, timeout_s: float, exc: BaseException) -> WanError:
    """A ``WanError`` for another collective of a multi-site job (e.g. a checkpoint's) that failed or timed out.

    Names the sites, this rank and its end of the link; the original error stays in the message.
    """
    # the group spans both sites: the rank that stopped answering may be in this one
    return WanError(_failure_text(topology, what, timeout_s, exc, missing="answer from the other ranks",
                                  lost="to the other ranks", suspect="a rank (of either site)",
                                  over=f"the link between the sites (this end: {_local_interface()})"))


def _site_message(topo: Topology, seconds: float, i: int, chunks: int, what: str, exc: BaseException) -> str:
    peers = [r for r in topo.layout.site_ranks[topo.site] if r != topo.rank]
    role = f"on rail {topo.rail}" if topo.rail is not None else "not on a WAN rail"
    task = f"{'reduce' if what == 'reduce' else 'hand over the WAN result of'} chunk {i + 1}/{chunks}"
    if timed_out(exc):
        head = f"waited {seconds:g} s for ranks {peers} of its own site to {task}"
    else:
        head = f"lost the connection to ranks {peers} of its own site while waiting for them to {task}"
    return (f"WAN collective between {_sites(topo)} stalled inside site {topo.site_name!r}: rank {topo.rank} "
            f"({role}) {head}. Those ranks wait on (or failed) the WAN transfer between the sites, or one of them "
            f"died. {_ADVICE} [gloo: {exc}]")
