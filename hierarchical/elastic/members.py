"""Who is in an elastic job: a site's name held by one member at a time, and one log line per change of members.

Invariant: a process that starts a site whose name a live member of the job holds never registers with the
lighthouse (its torchft manager, whose heartbeats and quorum requests would make it a second member of that site, is
never started), so the job's quorums never hold a site twice and the live sites see nothing of it. A member that
has stopped heartbeating (crashed) leaves after the lighthouse's heartbeat timeout; a newcomer waits for that.

A member that the check cannot stop (a site cut off from the lighthouse until its replacement joined, then back;
two processes of one site started within a poll of each other) shows up in a quorum beside another member of its
name. Then the one behind the job's step leaves before that quorum's step trains (``in_quorum_twice``), and the step
is discarded where its WAN transfers expected the leaver. torchft's quorum answer tells a member its own step only,
so two cases stay open: both members behind (the old one back before its replacement finished healing) both leave,
and two at the job's step while another site heals both stay, that step counting the site twice (each logs it).
"""

from __future__ import annotations

import logging
import time

from multidc.hierarchical import _env
from multidc.hierarchical.elastic.lighthouse import HeardReplica, heard_replicas

_log = logging.getLogger("multidc.hierarchical.elastic")

LIVE_AFTER_S = 5.0
"""A member of the site that still heartbeats this long after the newcomer first looked is alive, not dying
(torchft's and ``multidc lighthouse``'s default heartbeat timeout, in seconds)."""


def wait_for_site_name(url: str, name: str, *, timeout_s: float, live_after_s: float = LIVE_AFTER_S,
                       poll_s: float = 0.25) -> str | None:
    """Wait until no live member of the job holds site ``name`` (per the lighthouse at ``url``).

    Returns None when the name is free: no member of it heartbeats, or the ones that did stopped and the lighthouse
    dropped them. Returns why this process must not join when a member still heartbeats ``live_after_s`` after the
    first look, or when one is still present after ``timeout_s``. A lighthouse that does not answer is asked again
    until ``timeout_s``, and then, like one without torchft 0.2's status page, left to the quorum (logged)."""
    looked, said = time.monotonic(), set()
    while True:
        try:
            heard = heard_replicas(url, timeout_s=min(10.0, timeout_s))
        except ValueError as exc:
            _log.warning("site %r joins without checking that no other member holds its name: %s", name, exc)
            return None
        except OSError as exc:
            heard, error = None, exc
        now = time.monotonic()
        held = [r for r in heard or () if r.alive and r.site == name]
        if heard is not None and not held:
            return None
        for member in held:
            if now - member.heard_s_ago > looked + live_after_s:  # a heartbeat that came after the grace
                return _taken(url, name, member, f"{now - looked:.1f} s after this process first looked")
            if member.replica_id not in said:
                said.add(member.replica_id)
                _log.info("site %r waits for its member %s (heard %.1f s ago) to leave the job: the lighthouse drops "
                          "a member whose heartbeats stop after its heartbeat timeout", name, member.replica_id,
                          member.heard_s_ago)
        if now - looked > timeout_s:
            if heard is None:
                _log.warning("site %r could not read the lighthouse's status page at %s for %g s (%s): it joins "
                             "without checking that no other member holds its name", name, url, timeout_s, error)
                return None
            return _taken(url, name, held[0], f"still present after {timeout_s:g} s of waiting for it to leave")
        time.sleep(poll_s)


def _taken(url: str, name: str, member: HeardReplica, when: str) -> str:
    where = f"its torchft manager at {member.address}" if member.address else "not yet in a quorum"
    return (f"site {name!r} is already in the job: its member {member.replica_id} ({where}) still heartbeats to the "
            f"lighthouse at {url}, heard {member.heard_s_ago:.1f} s ago, {when}. A site's name is held by one "
            f"member at a time: stop that member first (a restart waits until the lighthouse drops it), or start "
            f"this one under another name ({_env.SITE} or site=).")


def quorum_change(before: tuple[str, ...], after: tuple[str, ...]) -> str | None:
    """What changed between two quorums' members (torchft replica ids, ``<site>:<uuid>``), for a log line; None if
    nothing did. A restarted site leaves under its old id and joins under its new one."""
    if tuple(sorted(before)) == tuple(sorted(after)):
        return None

    def sites(ids) -> str:
        return ", ".join(sorted(_site_of(rid) for rid in ids)) or "none"

    joined, left = set(after) - set(before), set(before) - set(after)
    return f"{len(after)} site(s) ({sites(after)}); joined: {sites(joined)}; left: {sites(left)}"


def in_quorum_twice(quorum) -> tuple[list[str], bool] | None:
    """``(the other members of this site's name, whether this member leaves)`` when a torchft quorum answer holds this
    member's site more than once; None when it does not.

    The member behind the job's step leaves (the quorum would heal it: a member back from a cut-off after its
    replacement joined); when every member of the quorum is at the job's step (two processes started together), all
    but the lowest replica id leave. Every rank of a member decides alike from the same answer. The answer holds this
    member's step only, so members of one name decide without each other's: two behind both leave, and two at the
    job's step while another site heals both stay (see the module's docstring)."""
    ids = list(quorum.replica_ids)  # sorted by replica id; replica_rank indexes them (torchft 0.2)
    me = ids[quorum.replica_rank]
    same = sorted(rid for rid in ids if _site_of(rid) == _site_of(me))
    if len(same) < 2:
        return None
    behind = quorum.max_replica_rank is None
    everyone_at_step = quorum.max_world_size == len(ids)
    return [rid for rid in same if rid != me], behind or (everyone_at_step and me != same[0])


def _site_of(replica_id: str) -> str:
    return replica_id.rpartition(":")[0] or replica_id
