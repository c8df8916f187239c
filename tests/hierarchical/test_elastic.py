"""Elastic sites on torchft, through ``multidc.hierarchical.elastic.ElasticSite`` (tests/hierarchical/
_elastic_script.py, one ``torchrun`` per site, gloo on CPU, a real torchft lighthouse in this process).

One site is SIGKILLed (all its processes) mid-training: the others keep committing steps without it, no step is
lost or applied twice, the killed site restarts with the same command, receives the live state from a peer site and
rejoins; the job ends with every site, every rank bitwise identical, equal to a single-process replay of the
committed steps (each averaged over the sites that took part; with int8 on the WAN hop, within its rounding).
A lighthouse restart leaves the sites training; a site started with another model or another number of ranks
fails alone, saying what differs, while the live sites go on."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from tests._resources import require_torchft

require_torchft()

from multidc.hierarchical.elastic import start_lighthouse  # noqa: E402
from tests._elastic import (  # noqa: E402
    KILL_AT,
    STEPS,
    TIMEOUT_S,
    check_odd_site_fails_alone,
    check_rejoined,
    finish_all,
    first_quorum_beside_an_idle_site,
    free_port,
    run_with_a_kill,
    site_logs,
    start_site,
    wait_for_steps,
)
from tests.hierarchical.elastic_reference import reference  # noqa: E402

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)
















@pytest.mark.parametrize("sites,per_site,extra,atol", [
    (3, 1, [], 1e-6),
    (2, 2, ["--ddp", "--compression", "int8"], 1e-3),  # DDP's buckets through the elastic hook; int8 rounding
], ids=["3x1", "2x2-ddp-int8"])
def test_a_killed_site_leaves_the_others_training_and_rejoins_live(tmp_path, lighthouse, sites, per_site, extra,
                                                                    atol):
    # the survivors train on until the restarted site took part in a step (or --max-steps): 400 steps (~20 s idle)
    # ended them before it was back twice on loaded cores (a torchrun start took longer); 3000 keeps them waiting
    # for the 240 s the test allows, and costs nothing when the restart is quick
    run = run_with_a_kill(tmp_path, lighthouse.address, sites, per_site, sites - 1, "--max-steps", "3000", *extra)
    first, survivor = check_rejoined(run, sites, STEPS)
    # from the state the survivor started with (received from a peer if it joined after step 0)
    expected = reference(survivor["log"], per_site, survivor["initial"])
    for name, value in first["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=atol)  # int8: the codec's rounding


def test_the_sites_survive_a_lighthouse_restart(tmp_path, lighthouse):
    names = ["site0", "site1"]
    trees = {name: start_site(name, 1, 2, lighthouse.address, tmp_path) for name in names}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_steps(tmp_path, trees, KILL_AT, deadline)
        lighthouse.restart(down_s=2.0)
        finish_all(trees, tmp_path, deadline - time.monotonic())
    finally:
        for tree in trees.values():
            tree.kill()
    ranks = [torch.load(tmp_path / f"{name}_rank0.pt") for name in names]
    for rank in ranks:
        assert rank["num_sites"] == 2 and [e["step"] for e in rank["log"]] == list(range(rank["joined_at"],
                                                                                          rank["final_step"]))
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name






@pytest.mark.parametrize("per_site,extra,message", [
    (1, ["--hidden", "32"], "tensor shapes differ: "),
    (2, [], "site_size: 2 here, 1 there"),
], ids=["another-model", "another-site-size"])
def test_a_site_that_differs_fails_alone_with_what_differs(tmp_path, lighthouse, per_site, extra, message):
    check_odd_site_fails_alone(tmp_path, lighthouse.address, ["--steps", "20"], per_site, list(extra),
                               [message])




def test_a_site_that_reaches_no_lighthouse_fails_on_every_rank_saying_so(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    tree = start_site("site0", 2, 1, address, tmp_path, "--quorum-timeout-s", "3")
    try:
        code, _ = tree.wait(TIMEOUT_S)
    finally:
        tree.kill()
    log = "".join(p.read_text() for p in tmp_path.glob("site0.*.log"))
    assert code != 0 and not (tmp_path / "site0.progress").exists()
    # each rank raises it (after the same wait); torchrun may stop one before it prints
    assert "LighthouseUnreachable: no torchft lighthouse " f"answers at http://{address}" in log, log[-3000:]


def test_sites_that_start_from_different_weights_end_with_identical_ranks(tmp_path, lighthouse):
    # torchft's first quorum makes the sites equal rank index by rank index, from different source sites: the
    # ranks of one site must still end up holding one state (each site seeds its model differently here)
    names = ["site0", "site1"]
    trees = {name: start_site(name, 2, 2, lighthouse.address, tmp_path, "--seed-per-site", "--steps", "6")
             for name in names}
    finish_all(trees, tmp_path)
    ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt") for name in names for r in range(2)]
    for rank in ranks:
        assert rank["joined_at"] == 0
        for name, value in rank["initial"].items():
            assert torch.equal(value, ranks[0]["initial"][name]), name  # one starting state everywhere
        for name, value in rank["params"].items():
            assert torch.equal(value, ranks[0]["params"][name]), name
    expected = reference(ranks[0]["log"], 2, ranks[0]["initial"])
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("per_site", [1, 2])
def test_a_step_its_quorums_first_site_discarded_is_saved_by_the_site_that_committed_it(tmp_path, lighthouse,
                                                                                         per_site):
    # site0, the first of every quorum, discards step 4 (a local error) while site1 commits it: after the next
    # quorum site1 is the one site that holds the job's state and leads; no step has two writers; save_once right
    # after each commit writes every step once, step 5 on site1 at the next quorum
    names, discard = ["site0", "site1"], 4
    trees = {name: start_site(name, per_site, 2, lighthouse.address, tmp_path, "--steps", "10",
                         *(["--discard-at", str(discard)] if name == "site0" else []))
             for name in names}
    finish_all(trees, tmp_path)
    ranks = {name: torch.load(tmp_path / f"{name}_rank0.pt") for name in names}
    for name in names:  # the ranks of a site agree on what they save
        others = [torch.load(tmp_path / f"{name}_rank{r}.pt")["leads"] for r in range(1, per_site)]
        assert all(leads == ranks[name]["leads"] for leads in others)
    assert discard not in [e["step"] for e in ranks["site0"]["log"]]
    assert discard in [e["step"] for e in ranks["site1"]["log"]]
    final = ranks["site0"]["final_step"]
    def writers(moment: str) -> dict[int, set]:  # job step -> the sites that would save it (a step may repeat)
        out: dict[int, set] = {}
        for name, rank in ranks.items():
            for n in rank["leads"][moment]:
                out.setdefault(n, set()).add(name)
        return out

    after_quorum, after_commit, once = writers("quorum"), writers("commit"), writers("once")
    assert all(len(sites) == 1 for sites in [*after_quorum.values(), *after_commit.values()])  # never two
    assert set(after_quorum) == set(range(1, final + 1)), after_quorum  # a writer for every step, the gap filled
    assert after_quorum[discard + 1] == {"site1"}
    assert set(after_commit) == set(range(1, final + 1)) - {discard + 1}, after_commit  # the leader's gap
    assert set(once) == set(range(1, final + 1)) and once[discard + 1] == {"site1"}, once  # every step, the gap too
    assert sum(len(rank["leads"]["once"]) for rank in ranks.values()) == final  # each step once


def test_steps_that_keep_failing_stop_every_site_with_the_last_failure(tmp_path):
    # site1 stalls longer than the WAN timeout inside every step: every step fails; after max_failed_steps in a
    # row both sites raise, saying why, instead of retrying for ever (a long join timeout keeps them in one quorum)
    server = start_lighthouse("127.0.0.1:0", min_sites=1, heartbeat_timeout_ms=10_000, join_timeout_ms=20_000)
    address = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    common = ("--timeout-s", "1", "--max-failed-steps", "3", "--steps", "50")
    trees = {"site0": start_site("site0", 1, 2, address, tmp_path, *common),
             "site1": start_site("site1", 1, 2, address, tmp_path, *common, "--stall-s", "3")}
    try:
        for name, tree in trees.items():
            code, _ = tree.wait(TIMEOUT_S)
            log = site_logs(tmp_path, name)
            assert code != 0, log
            assert f"site '{name}': 3 steps in a row failed and were discarded (max_failed_steps=3)" in log, log
            assert "the last failure: " in log, log
    finally:
        for tree in trees.values():
            tree.kill()
        server.shutdown()


def test_a_site_built_long_before_its_first_step_holds_up_no_quorum(tmp_path):
    # a site builds its ElasticSite in a framework's setup (data loaders, a validation sanity check) well before its
    # first step. torchft's lighthouse makes a new quorum wait for every site that heartbeats but has not asked to
    # join: a site must not heartbeat before its first quorum. With the manager started at construction, site0's
    # first quorum waited until it timed out (120 s) and site0 failed
    site0 = first_quorum_beside_an_idle_site(tmp_path, ["--hold-s", "600"], ["--steps", "3"])
    assert site0["final_step"] == 3




class _Answers:
    """A torchft manager client that answers the given quorums, one per call."""

    def __init__(self, quorums):
        self.quorums = iter(quorums)

    def _quorum(self, **kwargs):
        return next(self.quorums)


def _answer(qid, members, step, heal=False):
    """A torchft quorum answer with the fields ``QuorumIdentity`` reads."""
    from types import SimpleNamespace

    return SimpleNamespace(quorum_id=qid, replica_ids=members, max_step=step, store_address="s:1", heal=heal)


def test_a_restarted_lighthouse_that_repeats_quorum_ids_still_reconfigures_every_site():
    """torchft's manager reconfigures (and rendezvouses under ``torchft/<quorum_id>``) only when the id changes; a
    restarted lighthouse numbers its quorums from 1 again. Each distinct quorum must get an id no earlier one had,
    the same one in every member, and keep it while it lasts."""
    from multidc.hierarchical.elastic.transport import QuorumIdentity

    quorum = _answer
    site_a = QuorumIdentity(_Answers([quorum(1, ["a"], 0), quorum(2, ["a", "b"], 0), quorum(2, ["a", "b"], 1),
                                     quorum(1, ["a"], 2), quorum(2, ["a", "b"], 2), quorum(2, ["a", "b"], 3)]))
    site_b = QuorumIdentity(_Answers([quorum(2, ["a", "b"], 0), quorum(2, ["a", "b"], 1),
                                     quorum(1, ["b"], 2), quorum(2, ["a", "b"], 2), quorum(2, ["a", "b"], 3)]))
    results = [site_a._quorum() for _ in range(6)]  # the lighthouse restarts after the third quorum
    ids_a = [result.quorum_id for result in results]
    ids_b = [site_b._quorum().quorum_id for _ in range(5)]
    assert ids_a[1] == ids_a[2] and ids_a[4] == ids_a[5]  # one id while a quorum lasts
    assert len(set(ids_a)) == 4 and ids_a[4] not in ids_a[:4]  # the lighthouse's repeated id 2: a new quorum here
    assert ids_b[0] == ids_a[1] and ids_b[3] == ids_b[4] == ids_a[4]  # its members agree on it
    assert results[0].store_address == "s:1" and results[0].max_step == 0  # the rest is torchft's result


@pytest.mark.parametrize("case", ["committed alone", "committed what c failed", "discarded alone"])
def test_a_site_that_missed_a_restarted_lighthouses_first_quorum_reconfigures_with_the_others(case):
    """Seen in the fault benchmark: a restarted lighthouse formed its first quorum of sites a and b before c's
    request came, then numbered the next one, of a, b and c, 2 again, as before the restart. c must not keep its
    old rails for good. When a and b committed a step alone, c sees it (``max_step`` jumps, or c is behind and
    heals) and every member takes the same new id at once; when they discarded it, c cannot tell, the next step
    fails everywhere, and the lighthouse's new id after that failure gives every member the same new id."""
    from multidc.hierarchical.elastic.transport import QuorumIdentity

    quorum = _answer

    def ids(quorums):
        identity = QuorumIdentity(_Answers(quorums))
        return [identity._quorum().quorum_id for _ in quorums]

    abc, ab = ["a", "b", "c"], ["a", "b"]
    before = [quorum(2, abc, 2), quorum(2, abc, 3)]  # the old lighthouse
    if case == "committed alone":  # all commit step 3, then a and b step 4 alone
        alone, shared = [quorum(1, ab, 4)], [5, 6]
    elif case == "committed what c failed":  # step 3 fails everywhere; a and b commit it alone
        alone, shared = [quorum(1, ab, 3)], [4, 5]
    else:  # all commit step 3; a and b discard step 4 alone, then step 4 fails for all: a new lighthouse id
        alone, shared = [quorum(1, ab, 4)], [4, 4, 5]
    got = {}
    for site in abc:
        later = [quorum(2 if i < 1 or case != "discarded alone" else 3, abc, step,
                        heal=site == "c" and case == "committed what c failed" and i == 0)
                 for i, step in enumerate(shared)]
        got[site] = ids([*before, *(alone if site != "c" else []), *later])
        got[site] = got[site][:2] + got[site][-len(shared):]
    old = got["c"][1]
    if case == "discarded alone":
        assert got["a"] == got["b"] and got["c"][2] == old != got["a"][2]  # c cannot tell: this step fails
        assert got["a"][3:] == got["c"][3:] and got["c"][3] not in (old, got["a"][2]) and got["c"][4] == got["c"][3]
    else:
        assert got["a"] == got["b"] == got["c"], got  # agreed at once
        assert got["c"][2] != old and got["c"][3] == got["c"][2]  # new rails, kept while the quorum lasts


def test_a_site_asked_for_a_state_it_does_not_serve_answers_within_the_wan_timeout():
    """torchft's state server holds a request until the site serves a state, for the transport's whole (heal)
    timeout; a site sent to heal from a peer that never got its quorum must fail that heal within seconds."""
    import datetime
    import urllib.error
    import urllib.request

    from multidc.hierarchical.elastic.transport import state_server

    server = state_server("127.0.0.1", datetime.timedelta(seconds=600), wait_s=1.0)
    try:
        url = f"{server.address()}3/full"
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError, match="serves no state"):
            urllib.request.urlopen(url, timeout=60)
        assert time.monotonic() - started < 10
        server.send_checkpoint([1], step=3, state_dict={"w": torch.arange(4.0)}, timeout=datetime.timedelta(60))
        state = server.recv_checkpoint(0, server.metadata(), step=3, timeout=datetime.timedelta(seconds=60))
        assert torch.equal(state["w"], torch.arange(4.0))
        server.disallow_checkpoint()  # the commit: served no longer
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url, timeout=60)
    finally:
        server.shutdown(wait=False)


def test_a_site_that_its_quorum_makes_a_source_holds_requests_until_it_serves():
    """A source still copying its state when the healing site asks must not fail that heal after wait_s."""
    import datetime
    import threading
    import types

    from multidc.hierarchical.elastic.transport import state_server

    server = state_server("127.0.0.1", datetime.timedelta(seconds=600), wait_s=0.5)
    try:
        server.expect(types.SimpleNamespace(recover_dst_replica_ranks=[1]))
        got = {}

        def heal():
            got["state"] = server.recv_checkpoint(0, server.metadata(), step=5,
                                                  timeout=datetime.timedelta(seconds=60))

        healer = threading.Thread(target=heal)
        healer.start()
        time.sleep(2.0)  # four times wait_s: the request must still be held
        server.send_checkpoint([1], step=5, state_dict={"w": torch.ones(3)}, timeout=datetime.timedelta(60))
        healer.join(30)
        assert torch.equal(got["state"]["w"], torch.ones(3))
        server.disallow_checkpoint()
        server.expect(types.SimpleNamespace(recover_dst_replica_ranks=[]))  # the next quorum: no heal from here
        started = time.monotonic()
        with pytest.raises(Exception, match="500|serves no state"):
            server.recv_checkpoint(0, server.metadata(), step=6, timeout=datetime.timedelta(seconds=60))
        assert time.monotonic() - started < 10
    finally:
        server.shutdown(wait=False)


def test_a_source_whose_quorum_ended_without_serving_releases_held_requests():
    """A source's manager can fail to reconfigure and skip the send (the fault benchmark saw the healing site then
    wait out the 600 s heal timeout): once the source's quorum call returns, held requests end within wait_s."""
    import datetime
    import threading
    import types

    from multidc.hierarchical.elastic.transport import state_server

    server = state_server("127.0.0.1", datetime.timedelta(seconds=600), wait_s=1.0)
    try:
        server.expect(types.SimpleNamespace(recover_dst_replica_ranks=[1]))  # a source, never serving
        failed = {}

        def heal():
            started = time.monotonic()
            try:
                server.recv_checkpoint(0, server.metadata(), step=5, timeout=datetime.timedelta(seconds=60))
            except Exception as exc:  # noqa: BLE001  (what urllib raises for the server's error)
                failed["after"], failed["error"] = time.monotonic() - started, str(exc)

        healer = threading.Thread(target=heal)
        healer.start()
        time.sleep(3.0)  # held while the quorum call is in flight
        assert healer.is_alive()
        server.quorum_done()  # the source's quorum call returned without a send
        healer.join(10)
        assert not healer.is_alive() and 3.0 <= failed["after"] < 6.0, failed
    finally:
        server.shutdown(wait=False)


def test_state_transfers_notice_a_vanished_peer_within_the_wan_timeout_not_the_heal_timeout():
    """A link cut mid-heal leaves a half-open connection: the fault benchmark saw a healing site block 7+ minutes in
    a read of the state (heal_timeout_s=600). Both ends of a state transfer must probe the peer (TCP keepalive
    after wait_s idle) and give up on unacknowledged data after wait_s + 5 s."""
    import datetime
    import http.client

    from multidc.hierarchical.elastic.transport import _dead_peer_timeout, state_server

    def options(sock):
        return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))

    server = state_server("127.0.0.1", datetime.timedelta(seconds=600), wait_s=3.0)
    try:
        assert options(server._server.socket) == (1, 3, 8000)  # the listening socket: its connections inherit
        opened, real = [], http.client.HTTPConnection.getresponse

        def spy(self):  # the request is sent: the connection is open
            opened.append(options(self.sock))
            return real(self)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(http.client.HTTPConnection, "getresponse", spy)
            with pytest.raises(Exception, match="500|serves no state"):
                server.recv_checkpoint(0, server.metadata(), step=1, timeout=datetime.timedelta(seconds=60))
        assert opened == [(1, 3, 8000)], opened
    finally:
        server.shutdown(wait=False)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # Linux: accepted sockets inherit the options
        _dead_peer_timeout(listener, 3.0)
        with socket.create_connection(listener.getsockname()) as _client, listener.accept()[0] as accepted:
            assert options(accepted) == (1, 3, 8000)


def test_every_deferred_save_runs_before_the_first_error_is_raised():
    # ElasticSite.start_step runs the saves it kept for the quorum: one that fails does not skip the next
    from multidc.hierarchical.elastic.writer import run_all

    ran = []

    def fail() -> None:
        ran.append("first")
        raise OSError("the store refused the upload")

    with pytest.raises(OSError, match="refused the upload"):
        run_all([fail, lambda: ran.append("second")])
    assert ran == ["first", "second"]
