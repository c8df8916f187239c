"""WAN cut in the lab (network namespaces, root only): every rank of a DDP job fails within
``WanConfig.timeout_s`` plus a margin, with an error naming the sites and the link, and exits non-zero; the same
command, started again once the link is back, resumes from the last committed checkpoint and its losses continue
the unbroken run's (computed in one process)."""

from __future__ import annotations

import time

import pytest

from multidc.hierarchical.lab import Lab, lab_available
from multidc.plugins import Checkpointer
from tests.faults.lab_job import LabJob, python_argv
from tests.faults.train_job import reference_losses

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=f"no lab WAN here: {lab_available()}")

TIMEOUT_S = 10.0
# A rank inside a site waits timeout_s + 2 s (grace, so the WAN rank reports first), then the interpreter exits;
# the rest is slack for a 2-core machine shared with other jobs.
MARGIN_S = 8.0
STEPS, EVERY, CUT_AFTER = 20, 5, 11


def _argv(ckpt, *extra: str) -> list[str]:
    return python_argv("tests.faults.train_job", "--ckpt", str(ckpt), "--timeout-s", f"{TIMEOUT_S:g}",
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
