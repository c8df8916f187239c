"""WAN cut in the lab (network namespaces, root only): every rank of a DDP job fails within
``WanConfig.timeout_s`` plus a margin, with an error naming the sites and the link, and exits non-zero; the same
command, started again once the link is back, resumes from the last committed checkpoint and its losses continue
the unbroken run's (computed in one process). Without root: the executor's fail-fast rule and the error texts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks.fault_jobs.lab_job import LabJob, python_argv
from benchmarks.fault_jobs.train_job import reference_losses
from multidc.hierarchical import SiteLayout, WanError, errors
from multidc.hierarchical._executor import SerialExecutor
from multidc.hierarchical.tools.lab import Lab, lab_available
from multidc.hierarchical.tools.ranks import run_ranks
from multidc.plugins import Checkpointer

needs_lab = pytest.mark.skipif(lab_available() is not None, reason=f"no lab WAN here: {lab_available()}")

TIMEOUT_S = 10.0
# A rank inside a site waits timeout_s + 2 s (grace, so the WAN rank reports first), then the interpreter exits;
# the rest is slack for a 2-core machine shared with other jobs.
MARGIN_S = 8.0
STEPS, EVERY, CUT_AFTER = 20, 5, 11


def _argv(ckpt, *extra: str) -> list[str]:
    return python_argv("benchmarks.fault_jobs.train_job", "--ckpt", str(ckpt), "--timeout-s", f"{TIMEOUT_S:g}",
                       "--steps", str(STEPS), "--every", str(EVERY), *extra)


def _cut_after(lab: Lab, job: LabJob, step: int) -> tuple[float, float]:
    """Cut site 1's WAN link once rank 0 finished ``step``; return (monotonic, wall clock) of the cut."""
    job.wait_event(0, lambda e: e["event"] == "step" and e["step"] == step, timeout=90)
    lab.set_link(1, up=False)
    return time.monotonic(), time.time()


def _failure(job: LabJob, rank: int) -> str:
    failed = [e for e in job.ranks[rank].events() if e["event"] == "failed"]
    assert failed, f"rank {rank} reported no failure:{job.describe()}"
    return failed[-1]["message"]


def _losses(job: LabJob) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in job.ranks[0].events() if e["event"] == "step"}


@needs_lab
def test_wan_cut_fails_every_rank_in_time_and_restart_resumes_from_last_commit(tmp_path):
    ckpt = tmp_path / "ckpt"
    with Lab(2, "200mbit") as lab:
        with LabJob(lab, _argv(ckpt), [2, 2], tmp_path / "cut") as job:
            cut, _ = _cut_after(lab, job, CUT_AFTER)
            codes = job.wait(TIMEOUT_S + MARGIN_S + 20)
            assert codes == [1, 1, 1, 1], f"exit codes {codes} (None: still running){job.describe()}"
            for rank in job.ranks:
                assert rank.exit_time - cut <= TIMEOUT_S + MARGIN_S, (rank.rank, rank.exit_time - cut)
                message = _failure(job, rank.rank)
                assert "WanError: WAN collective between site '0' and site '1'" in message, message
                assert "timed out after 10 s" in message or "stalled inside site" in message, message
                assert "link" in message and "interface wan0 10.213.0." in message, message
            committed = [e["step"] for e in job.ranks[0].events() if e["event"] == "committed"]
            before = _losses(job)
        assert committed == [5, 10]
        lab.set_link(1, up=True)
        with LabJob(lab, _argv(ckpt), [2, 2], tmp_path / "resume") as job:
            assert job.wait(90) == [0, 0, 0, 0], job.describe()
            resumed = [next(e["step"] for e in r.events() if e["event"] == "resumed") for r in job.ranks]
            after = _losses(job)
    assert resumed == [committed[-1]] * 4  # no committed step lost
    assert sorted(after) == list(range(committed[-1] + 1, STEPS + 1))
    assert Checkpointer(ckpt).latest().step == STEPS
    reference = reference_losses(4, STEPS)
    for step, loss in {**before, **after}.items():
        assert loss == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step
    # The step that was cut off is redone from the checkpoint with the same result.
    assert after[CUT_AFTER] == pytest.approx(before[CUT_AFTER], rel=1e-5)


@needs_lab
def test_rank_off_the_wan_rail_fails_on_its_own_deadline_when_its_leader_hangs(tmp_path):
    """Sites [2, 1]: rank 1 never crosses the WAN; its leader (rank 0) catches the WanError and stays alive, so
    rank 1 must give up on its intra-site wait by itself, in time and with a message naming the sites."""
    with Lab(2, "200mbit") as lab:
        with LabJob(lab, _argv(tmp_path / "ckpt", "--linger-s", "60"), [2, 1], tmp_path / "cut") as job:
            _, wall = _cut_after(lab, job, 3)
            failed = {}
            for rank in range(3):
                event = job.wait_event(rank, lambda e: e["event"] == "failed", timeout=TIMEOUT_S + MARGIN_S + 20)
                failed[rank] = (event["t"] - wall, event["message"])
    for rank, (after_cut, message) in failed.items():
        assert after_cut <= TIMEOUT_S + MARGIN_S, (rank, after_cut)
        assert "WAN collective between site '0' and site '1'" in message, message
    assert "timed out after 10 s" in failed[0][1] and "rail-0 link (rank 0 of site '0' <-> rank 2" in failed[0][1]
    assert "timed out after 10 s" in failed[2][1]
    assert "stalled inside site '0': rank 1 (not on a WAN rail) waited 12 s for ranks [0]" in failed[1][1]


# ------------------------------------------------------------------------------------------ without the lab
def test_after_a_failed_job_every_queued_and_later_job_fails_at_once():
    executor, gate = SerialExecutor("test"), torch.futures.Future()

    def failing():
        gate.wait()
        raise WanError("WAN collective between site 'a' and site 'b' timed out after 10 s")

    first = executor.submit(failing)
    queued = executor.submit(lambda: "must not run")
    gate.set_result(None)
    with pytest.raises(WanError, match="timed out after 10 s"):
        first.wait()
    for future in (queued, executor.submit(lambda: "must not run either")):
        started = time.monotonic()
        with pytest.raises(WanError, match="not run: an earlier collective .* timed out after 10 s"):
            future.wait()
        assert time.monotonic() - started < 1
    assert isinstance(executor.failure, WanError)
    executor.shutdown()


def test_a_healthy_executor_runs_jobs_in_order():
    executor, order = SerialExecutor("test"), []
    futures = [executor.submit(lambda i=i: order.append(i) or i) for i in range(5)]
    assert [f.wait() for f in futures] == list(range(5)) and order == list(range(5))
    executor.shutdown()


def _topo(rank, site_ranks=((0, 1), (2, 3)), names=("us-east", "eu-west")):
    layout = SiteLayout(site_ranks=site_ranks, site_names=names)
    site = layout.site_of(rank)
    local = site_ranks[site].index(rank)
    return SimpleNamespace(layout=layout, rank=rank, site=site, site_name=names[site],
                           rail=local if local < layout.num_rails else None)


def test_wan_timeout_message_names_sites_rail_link_and_what_to_do(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    text = errors._wan_message(_topo(3), 10.0, 1, 4, RuntimeError("Operation timed out!"))
    assert text.startswith("WAN collective between site 'us-east' and site 'eu-west' timed out after 10 s: rank 3 "
                           "(site 'eu-west') got no data for chunk 2/4 over the rail-1 link (rank 1 of site "
                           "'us-east' <-> rank 3 of site 'eu-west'; this end: interface lo 127.0.0.1)")
    assert "MULTIDC_WAN_TIMEOUT_S" in text and "last committed checkpoint" in text
    broken = errors._wan_message(_topo(0), 10.0, 0, 1, RuntimeError("Connection closed by peer"))
    assert "failed: rank 0 (site 'us-east') lost the connection during chunk 1/1" in broken


def test_site_stall_message_names_the_rank_off_the_rail_and_its_peers():
    topo = _topo(1, site_ranks=((0, 1), (2,)), names=("0", "1"))
    text = errors._site_message(topo, 12.0, 0, 3, "share", RuntimeError("Operation timed out!"))
    assert text.startswith("WAN collective between site '0' and site '1' stalled inside site '0': rank 1 (not on a "
                           "WAN rail) waited 12 s for ranks [0] of its own site to hand over the WAN result of "
                           "chunk 1/3.")
    three = _topo(0, site_ranks=((0,), (1,), (2,)), names=("a", "b", "c"))
    assert "between sites 'a', 'b' and 'c'" in errors._wan_message(three, 5, 0, 1, RuntimeError("x"))


def _checkpoint_collective_times_out(rank, world, url, done):
    import os
    import time

    from multidc.hierarchical import Topology, WanError
    from multidc.plugins import Checkpointer

    topology = Topology.build(num_sites=2)
    ckpt = Checkpointer(url, timeout_s=2, topology=topology)
    if rank == 1:  # the other site never joins the save, as if the WAN were cut; alive until rank 0's save ended
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    started = time.monotonic()
    try:
        ckpt.save({"loop": {"step": 1}}, step=1)
        outcome = "no error"
    except WanError as exc:
        outcome = str(exc)
    seconds = time.monotonic() - started
    open(done, "w").close()
    return outcome, seconds


def test_checkpoint_collective_that_times_out_raises_wan_error_naming_the_sites(tmp_path):
    message, seconds = run_ranks(_checkpoint_collective_times_out, 2, str(tmp_path / "ckpt"), str(tmp_path / "done"),
                                 timeout=60)[0]
    assert message.startswith("checkpoint collective") and "between site '0' and site '1' timed out after 2 s" \
        in message, message
    assert seconds < 2 + 5, seconds
