"""Who is in an elastic job (``multidc.hierarchical.elastic.members``), and what the job logs about it.

A second process of a site already in the job fails before it joins any quorum, naming the site and the live
member's manager, while the job goes on as if it had not come; a site restarted right after a crash waits until
the lighthouse drops the dead member, then rejoins. torchft logs warnings only unless ``MULTIDC_TORCHFT_LOG_LEVEL``
asks for more, and each site logs one line per change of the quorum's members, not one per step."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from multidc.hierarchical.tools.processes import ProcessTree
from tests._resources import require_torchft

require_torchft()

from multidc.hierarchical.elastic import start_lighthouse  # noqa: E402
from multidc.hierarchical.elastic.lighthouse import heard_replicas, torchft_log_level  # noqa: E402
from multidc.hierarchical.elastic.members import quorum_change, wait_for_site_name  # noqa: E402
from tests._elastic import (  # noqa: E402
    KILL_AT,
    TIMEOUT_S,
    check_second_member_refused,
    finish_all,
    progress,
    site_logs,
    start_site,
    wait_for_steps,
)

MULTIDC = [sys.executable, "-m", "multidc.hierarchical.tools.cli"]
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)




def test_a_second_process_of_a_live_site_is_refused_and_the_job_goes_on(tmp_path, lighthouse):
    check_second_member_refused(tmp_path, lighthouse.address, ["--steps", "40"])


def test_a_site_restarted_right_after_a_crash_waits_until_the_lighthouse_drops_it_then_rejoins(tmp_path):
    # the killed member's last heartbeat is still within the lighthouse's heartbeat timeout (12 s: longer than
    # LIVE_AFTER_S) when the restarted site looks: it must wait for it, not refuse it. The restart is started and
    # built before the kill and looks right after it: a torchrun start on loaded cores took longer than the 12 s
    # (CI, once), and the site then looked after the lighthouse had dropped its member
    server = start_lighthouse("127.0.0.1:0", min_sites=1, heartbeat_timeout_ms=12_000, join_timeout_ms=1000)
    address = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    names, go = ["site0", "site1"], tmp_path / "go"
    # the restart first (its log site1.0.log), the same command but held before its first look until `go` exists;
    # 120 steps: the first site1 is still training when the restart is built
    restart = start_site("site1", 1, 2, address, tmp_path, "--steps", "120", "--start-after", str(go))
    trees = {name: start_site(name, 1, 2, address, tmp_path, "--steps", "120") for name in names}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_steps(tmp_path, trees, KILL_AT, deadline, ["site1"])
        while not (tmp_path / "go.ready").exists():
            assert restart.process.poll() is None, site_logs(tmp_path, "site1")
            assert time.monotonic() < deadline, "the restart was never built"
            time.sleep(0.05)
        assert trees["site1"].process.poll() is None, "the first site1 ended before the restart was built"
        trees["site1"].kill()  # every process of the site
        killed_at = progress(tmp_path, "site1")
        (tmp_path / "site1.progress").unlink()
        go.touch()
        trees["site1"] = restart
        finish_all(trees, tmp_path, deadline - time.monotonic())
    finally:
        for tree in trees.values():
            tree.kill()
        restart.kill()
        server.shutdown()
    assert re.search(r"site 'site1' waits for its member site1:\S+ \(heard \d+\.\d s ago\) to leave the job",
                     (tmp_path / "site1.0.log").read_text()), site_logs(tmp_path, "site1")
    survivor, restarted = (torch.load(tmp_path / f"{name}_rank0.pt") for name in names)
    # it joined live, at the job's step, not from step 0; possibly the very quorum whose forming dropped its old
    # member (the survivor's quorum waited for that member's heartbeat to lapse, which also ends the name check)
    assert restarted["joined_at"] >= killed_at >= KILL_AT
    assert {e["step"]: e["sites"] for e in survivor["log"]}[restarted["joined_at"]] == [0, 1]
    assert restarted["final_step"] == survivor["final_step"] >= 40
    assert [e["step"] for e in survivor["log"]] == list(range(survivor["joined_at"], survivor["final_step"]))
    assert not [e for e in survivor["log"] + restarted["log"] if e["twice"]]
    for key, value in survivor["params"].items():
        assert torch.equal(value, restarted["params"][key]), key


def _signal_tree(tree: ProcessTree, signum: int) -> None:
    for pid in tree.members():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def test_a_member_back_after_its_replacement_joined_leaves_and_no_step_counts_the_site_twice(tmp_path, lighthouse):
    # site1 is cut off (every process stopped: no heartbeat, no transfer) until the lighthouse dropped it; its
    # replacement passes the name check and joins; then the old member comes back. It must leave at its first
    # quorum, with a message, while the others go on and never commit a step that counts site1 twice.
    url = f"http://{lighthouse.address}"
    names = ["site0", "site1"]
    end = tmp_path / "end-at"
    live = ["--steps", "20", "--max-steps", "5000", "--until", str(end)]  # the job goes on until the test ends it
    trees = {name: start_site(name, 1, 2, lighthouse.address, tmp_path, *live) for name in names}
    old = trees["site1"]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_steps(tmp_path, trees, KILL_AT, deadline)
        _signal_tree(old, signal.SIGSTOP)
        while any(r.alive for r in heard_replicas(url) if r.site == "site1"):  # the lighthouse drops it
            assert time.monotonic() < deadline, "the lighthouse never dropped the stopped member"
            time.sleep(0.1)
        (tmp_path / "site1.progress").unlink()
        trees["site1"] = start_site("site1", 1, 2, lighthouse.address, tmp_path, *live)
        while progress(tmp_path, "site1") < progress(tmp_path, "site0") - 1 or progress(tmp_path, "site1") == 0:
            assert time.monotonic() < deadline and trees["site1"].process.poll() is None, site_logs(tmp_path, "site1")
            time.sleep(0.05)
        back_at = progress(tmp_path, "site0")
        _signal_tree(old, signal.SIGCONT)
        code, _ = old.wait(max(1.0, deadline - time.monotonic()))
        log = (tmp_path / "site1.0.log").read_text()
        assert code != 0, log[-3000:]
        assert re.search(r"site 'site1' left the job at step \d+: its quorum also holds site1:\S+, another member "
                         r"of this site \(this one is behind", log), log[-3000:]
        (tmp_path / "end-at.tmp").write_text(str(max(progress(tmp_path, n) for n in names) + 5))
        (tmp_path / "end-at.tmp").rename(end)  # every site reads it before that step
        finish_all(trees, tmp_path, deadline - time.monotonic())
    finally:
        _signal_tree(old, signal.SIGCONT)
        for tree in [*trees.values(), old]:
            tree.kill()
    survivor, replacement = (torch.load(tmp_path / f"{name}_rank0.pt") for name in names)
    assert survivor["final_step"] == replacement["final_step"] > back_at
    assert not [e for e in survivor["log"] + replacement["log"] if e["twice"]]
    for key, value in survivor["params"].items():
        assert torch.equal(value, replacement["params"][key]), key


def test_the_lighthouse_status_tells_a_live_member_from_one_that_stopped_heartbeating():
    # what the check reads without registering: torchft 0.2's status page (the format is checked here)
    from torchft.coordination import LighthouseClient

    server = start_lighthouse("127.0.0.1:0", min_sites=1, heartbeat_timeout_ms=1500)
    url = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    stop = threading.Event()
    try:
        client = LighthouseClient(url, connect_timeout=datetime.timedelta(seconds=10))
        client.quorum(replica_id="us-east:a1", timeout=datetime.timedelta(seconds=10), address="http://h0:1234",
                      store_address="h0:29500", step=3, world_size=1)  # in the last quorum: its address is known
        client.heartbeat("eu-west:b2")  # heard once, then silent (crashed)

        def beat() -> None:  # a live member heartbeats every 100 ms, as torchft's manager does
            while not stop.wait(0.1):
                client.heartbeat("us-east:a1")

        threading.Thread(target=beat, daemon=True).start()
        heard = {r.replica_id: r for r in heard_replicas(url, timeout_s=10)}
        assert set(heard) == {"us-east:a1", "eu-west:b2"} and all(r.alive for r in heard.values())
        assert heard["us-east:a1"].address == "http://h0:1234" and heard["eu-west:b2"].address is None
        assert heard["us-east:a1"].site == "us-east"
        started = time.monotonic()
        assert wait_for_site_name(url, "eu-west", timeout_s=30, poll_s=0.1) is None  # free once dropped
        assert 0.5 < time.monotonic() - started < 10
        assert not {r.replica_id: r for r in heard_replicas(url)}["eu-west:b2"].alive
        assert wait_for_site_name(url, "ap-south", timeout_s=30) is None  # never heard: free at once
        started = time.monotonic()
        refusal = wait_for_site_name(url, "us-east", timeout_s=30, live_after_s=1.0, poll_s=0.1)
        assert 1.0 < time.monotonic() - started < 10
        assert refusal.startswith("site 'us-east' is already in the job: its member us-east:a1 (its torchft "
                                  "manager at http://h0:1234) still heartbeats to the lighthouse at "), refusal
    finally:
        stop.set()
        server.shutdown()


@pytest.mark.parametrize("before,after,expected", [
    ((), ("a:1",), "1 site(s) (a); joined: a; left: none"),
    (("a:1",), ("a:1", "b:2"), "2 site(s) (a, b); joined: b; left: none"),
    (("a:1", "b:2"), ("b:2", "a:1"), None),  # the same members
    (("a:1", "b:2"), ("a:1",), "1 site(s) (a); joined: none; left: b"),
    (("a:1", "b:2"), ("a:1", "b:3"), "2 site(s) (a, b); joined: b; left: b"),  # b restarted
])
def test_a_quorum_change_names_the_sites_that_joined_and_left(before, after, expected):
    assert quorum_change(before, after) == expected


@pytest.mark.parametrize("ids,me,at_step,expected", [
    (("a:1", "b:2"), 1, (0, 1), None),  # one member per site
    (("a:1", "b:2", "b:3"), 2, (0, 1), (["b:2"], True)),  # behind the job's step: it leaves
    (("a:1", "b:2", "b:3"), 1, (0, 1), (["b:3"], False)),  # at the step, the other behind: it stays
    (("a:1", "b:2", "b:3"), 1, (0, 1, 2), (["b:3"], False)),  # all at the step: the lowest id stays
    (("a:1", "b:2", "b:3"), 2, (0, 1, 2), (["b:2"], True)),  # ... and the others leave
])
def test_of_two_members_of_a_site_in_one_quorum_the_one_behind_or_else_the_higher_id_leaves(ids, me, at_step,
                                                                                          expected):
    from types import SimpleNamespace

    from multidc.hierarchical.elastic.members import in_quorum_twice

    quorum = SimpleNamespace(replica_ids=list(ids), replica_rank=me, max_world_size=len(at_step),
                             max_replica_rank=at_step.index(me) if me in at_step else None)
    assert in_quorum_twice(quorum) == expected


@pytest.mark.parametrize("value,expected", [(None, "warn"), ("INFO", "info"), ("warning", "warn"),
                                            ("debug", "debug"), ("loud", ValueError)])
def test_torchft_log_level_comes_from_its_variable(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("MULTIDC_TORCHFT_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("MULTIDC_TORCHFT_LOG_LEVEL", value)
    if expected is ValueError:
        with pytest.raises(ValueError, match="MULTIDC_TORCHFT_LOG_LEVEL='loud' is not a log level: set error, warn"):
            torchft_log_level()
    else:
        assert torchft_log_level() == expected


@pytest.mark.parametrize("level", [None, "info"])
def test_torchft_logs_warnings_only_unless_asked(tmp_path, level):
    # torchft's native INFO lines (about six per step on a site's rank 0, the lighthouse's every quorum) only when
    # MULTIDC_TORCHFT_LOG_LEVEL asks: here the lighthouse's first quorum status; the sites' side is checked on the
    # sites of check_second_member_refused (tests/_elastic.py)
    env = {"MULTIDC_TORCHFT_LOG_LEVEL": level} if level else {}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIDC_", "TORCHFT_", "RUST_LOG"))}
    output = tmp_path / "lighthouse.log"
    with output.open("w") as out:
        lighthouse = ProcessTree([*MULTIDC, "lighthouse", "--bind", "127.0.0.1:0", "--quorum-tick-ms", "10"],
                                 env=base | env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "multidc lighthouse: listening on" not in output.read_text():
            assert time.monotonic() < deadline and lighthouse.process.poll() is None, output.read_text()
            time.sleep(0.05)
        quiet_until = time.monotonic() + 0.5  # 50 quorum ticks: at info, each logs the quorum's status
        while "[INFO] [torchft::lighthouse]" not in output.read_text() and time.monotonic() < quiet_until + 10:
            if level is None and time.monotonic() > quiet_until:
                break
            time.sleep(0.05)
    finally:
        lighthouse.kill()
    assert ("[INFO] [torchft::lighthouse]" in output.read_text()) is (level == "info"), output.read_text()
