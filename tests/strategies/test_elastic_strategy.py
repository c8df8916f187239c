"""``HierarchicalDDPStrategy(elastic=True)`` through a Lightning ``Trainer``, one ``torchrun`` per site (gloo, CPU,
a real torchft lighthouse): a site SIGKILLed mid-``fit`` leaves the other training, restarts with the same command,
receives the live model / optimizer / scheduler state and the job's step, and both end at ``max_steps`` bitwise
identical, equal to a single-process replay of the committed steps. Plus the settings checks, in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._resources import require_cuda, require_module, require_torchft

require_torchft()
require_module("lightning", "lightning")

from multidc.hierarchical import DiLoCoConfig  # noqa: E402
from multidc.plugins import Checkpointer, RNGState, list_checkpoints  # noqa: E402
from multidc.strategies import DiLoCoStrategy, HierarchicalDDPStrategy  # noqa: E402
from tests._elastic import (  # noqa: E402
    TIMEOUT_S,
    Lighthouse,
    check_second_member_refused,  # noqa: E402
    finish_all,
    first_quorum_beside_an_idle_site,
    run_alone,
    run_with_a_kill,
    site_logs,
    start_site,
)
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import diloco_reference, reference  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parent / "_elastic_lightning_script.py")
DILOCO_SCRIPT = str(Path(__file__).resolve().parent / "_elastic_diloco_lightning_script.py")
MAX_STEPS = 100
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_a_killed_site_rejoins_a_lightning_fit_live(tmp_path, lighthouse, accelerator):
    # gpu: each site's rank on the GPU (NCCL inside the site, the WAN hop over torchft's gloo group); skipped
    # without one (tests/gpu says how to run them)
    if accelerator == "gpu":
        require_cuda()
    # the survivor holds before its last step until the restarted site is back (a condition, not a step count)
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 1, 1, "--max-steps", str(MAX_STEPS), "--sleep", "0.08",
                          "--accelerator", accelerator, script=SCRIPT, hold=True)
    killed_at = run["killed_at"]
    survivor, restarted = run["ranks"][("site0", 0)], run["ranks"][("site1", 0)]
    assert survivor["final_step"] == restarted["final_step"] == MAX_STEPS
    assert survivor["device"] == restarted["device"] == ("cuda" if accelerator == "gpu" else "cpu")
    for name, value in survivor["params"].items():
        assert torch.equal(value, restarted["params"][name]), name
    assert [e["step"] for e in survivor["log"]] == list(range(survivor["joined_at"], MAX_STEPS))
    assert any(e["sites"] == [0] and e["step"] > killed_at for e in survivor["log"])  # trained on alone
    assert restarted["joined_at"] > killed_at and all(e["sites"] == [0, 1] for e in restarted["log"])
    for rank in (survivor, restarted):  # the last step's WAN figures, logged as under hierarchical_ddp
        wan = rank["wan"]
        assert sorted(wan) == ["wan/MBps", "wan/bytes_sent", "wan/comm_s", "wan/wait_s"], wan
        assert wan["wan/bytes_sent"] > 0 and wan["wan/comm_s"] == wan["wan/wait_s"] > 0 and wan["wan/MBps"] > 0, wan
    # the LR schedule follows the committed steps: a discarded step (the one in flight at the kill) steps nothing;
    # the replay runs on the CPU: GPU rounding differs a little from it, never between the sites
    expected = reference(survivor["log"], 1, survivor["initial"], scheduled=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6 if accelerator == "cpu" else 1e-4)


def test_a_second_process_of_a_live_site_is_refused_by_a_lightning_fit(tmp_path, lighthouse):
    # the check is ElasticSite's, before the first quorum: under a Trainer the second process fails in the
    # strategy's first step, and the fit of both sites goes on as if it had not come
    check_second_member_refused(tmp_path, lighthouse.address, ["--max-steps", "40", "--sleep", "0.05"], script=SCRIPT)


def test_checkpoints_are_saved_once_by_the_sites_present_and_load(tmp_path, lighthouse):
    # site0, the leader, is SIGKILLed: site1 alone (a degraded quorum) saves the checkpoints of the steps in between,
    # each once and committed; the job's checkpoint of such a step loads into a new elastic fit, which continues
    # the job's step count from there, its weights those of a replay of the committed steps
    # (site1 holds before its last step until site0 is back: the steps between need not outlast a restart)
    ckpts, max_steps = tmp_path / "ckpts", 40
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 1, 0, "--max-steps", str(max_steps), "--sleep", "0.08",
                           "--ckpt-dir", str(ckpts), script=SCRIPT, kill_at=12, hold=True)
    survivor, restarted = run["ranks"][("site1", 0)], run["ranks"][("site0", 0)]
    assert survivor["final_step"] == restarted["final_step"] == max_steps
    degraded = [e["step"] + 1 for e in survivor["log"] if e["sites"] == [1]]  # steps completed by site1 alone
    saved = {info.step: info for name in os.listdir(ckpts) for info in list_checkpoints(str(ckpts / name))}
    assert sorted(saved) == list(range(10, max_steps + 1, 10)), sorted(saved)  # every one, once (a folder a step)
    alone = [step for step in saved if step in degraded]
    assert alone, f"no checkpoint was saved while site0 was down (degraded steps {degraded})"
    step = alone[0]
    resumed = run_alone(tmp_path / "resume", lighthouse.address, "--max-steps", str(step + 5), "--resume",
                        str(ckpts / f"step={step}.ckpt"), script=SCRIPT)
    assert resumed["final_step"] == step + 5 and [e["step"] for e in resumed["log"]] == list(range(step, step + 5))
    before = [e for e in survivor["log"] if e["step"] < step]
    expected = reference(before + resumed["log"], 1, survivor["initial"], scheduled=True)
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_a_step_its_first_site_discards_is_saved_once_by_a_site_that_committed_it(tmp_path, lighthouse, accelerator):
    # site0, the first site of every quorum, discards step 19 after its transfers completed (a failure it alone saw)
    # while site1 commits it: ModelCheckpoint's save of step 20 on site1 waits for the next quorum, which shows
    # site0 behind, and site1 writes it there, from the state of step 20; the others are site0's, each written once
    # (gpu: the deferred checkpoint holds CUDA tensors; the resumed fit and the replay run on the CPU)
    if accelerator == "gpu":
        require_cuda()
    ckpts = tmp_path / "ckpts"
    common = ("--max-steps", "30", "--sleep", "0.02", "--ckpt-dir", str(ckpts), "--accelerator", accelerator)
    trees = {"site0": start_site("site0", 1, 2, lighthouse.address, tmp_path, *common, "--discard-at", "19",
                                 script=SCRIPT),
             "site1": start_site("site1", 1, 2, lighthouse.address, tmp_path, *common, script=SCRIPT)}
    finish_all(trees, tmp_path)
    first, other = (torch.load(tmp_path / f"{name}_rank0.pt") for name in ("site0", "site1"))
    assert (first["discarded"], other["discarded"]) == (1, 0)
    assert [e["step"] for e in other["log"]] == list(range(30)) and other["log"][19]["sites"] == [0, 1]
    assert 20 in other["written"] and sorted(first["written"] + other["written"]) == [10, 20, 30]  # each once
    saved = {info.step for name in os.listdir(ckpts) for info in list_checkpoints(str(ckpts / name))}
    assert sorted(saved) == [10, 20, 30]
    for name, value in first["params"].items():
        assert torch.equal(value, other["params"][name]), name
    resumed = run_alone(tmp_path / "resume", lighthouse.address, "--max-steps", "22", "--resume",
                        str(ckpts / "step=20.ckpt"), script=SCRIPT)
    assert [e["step"] for e in resumed["log"]] == [20, 21]
    # the checkpoint holds the random streams as they were at the save, not as after the next batch's draw
    mine = RNGState().state_dict()
    try:
        Checkpointer(str(ckpts / "step=20.ckpt")).load({"rng": RNGState()}, "latest")
        assert torch.equal(torch.get_rng_state(), other["rng_at_save"][20])
    finally:
        RNGState().load_state_dict(mine)
    before = [e for e in other["log"] if e["step"] < 20]
    expected = reference(before + resumed["log"], 1, other["initial"], scheduled=True)
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6 if accelerator == "cpu" else 1e-4)


def test_a_discarded_step_leaves_the_weights_and_the_lr_schedule_alone(tmp_path, lighthouse):
    # site1 stalls inside step 5 longer than the WAN timeout: that step fails and is discarded; the LR schedule
    # still follows the committed steps only (a replay with the schedule of the committed steps matches)
    common = ("--max-steps", "20", "--sleep", "0.02", "--timeout-s", "2")
    trees = {"site0": start_site("site0", 1, 2, lighthouse.address, tmp_path, *common, script=SCRIPT),
             "site1": start_site("site1", 1, 2, lighthouse.address, tmp_path, *common, "--stall-at", "5", "--stall-s",
                            "5", script=SCRIPT)}
    finish_all(trees, tmp_path)
    ranks = [torch.load(tmp_path / f"{name}_rank0.pt") for name in ("site0", "site1")]
    assert ranks[0]["discarded"] >= 1, "no step was discarded"
    assert [e["step"] for e in ranks[0]["log"]] == list(range(20))
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name
    expected = reference(ranks[0]["log"], 1, ranks[0]["initial"], scheduled=True)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fragments,overlap,accelerator", [(1, 0, "cpu"), (2, 0, "cpu"), (2, 1, "cpu"), (2, 1, "gpu")],
                         ids=["plain", "streaming", "overlap", "overlap-gpu"])
def test_a_killed_site_rejoins_an_elastic_diloco_fit_live(tmp_path, lighthouse, fragments, overlap, accelerator):
    # DiLoCoStrategy(elastic=True): a quorum per round (streaming: per fragment sync); the restarted site receives
    # the global parameters, its peer's own, the outer and inner optimizer states and the job's inner step, and both
    # sites end at max_steps with identical global parameters, each site's own equal to the replay's. gpu: each
    # site's rank on the GPU, the overlapped sync's background thread included; skipped without one
    if accelerator == "gpu":
        require_cuda()
    # the survivor holds two rounds before the end until the killed site is back (hold): it still trains then
    max_steps = 96
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 1, 1, "--max-steps", str(max_steps), "--sleep", "0.05",
                           "--fragments", str(fragments), "--overlap", str(overlap), "--accelerator", accelerator,
                           script=DILOCO_SCRIPT, kill_at=24, hold=True)
    survivor, restarted = run["ranks"][("site0", 0)], run["ranks"][("site1", 0)]
    assert run["survivors_went_on"], "the surviving site stopped while the other was down"
    assert survivor["final_step"] == restarted["final_step"] == max_steps
    assert survivor["device"] == restarted["device"] == ("cuda" if accelerator == "gpu" else "cpu")
    for name, value in survivor["params"].items():
        assert torch.equal(value, restarted["params"][name]), name
    rounds = survivor["log"]
    assert [e["step"] for e in rounds] == list(range(len(rounds))) and rounds[-1]["sites"] == [0, 1]
    assert any(e["sites"] == [0] and e["t0"] >= run["killed_at"] for e in rounds)  # trained on alone
    assert restarted["first_t"] > run["killed_at"]  # rejoined live, at the job's step
    assert all(e["sites"] == [0, 1] for e in restarted["log"])
    heals = [{"site": 1, "source": 0, "t0": restarted["first_t"]}]
    expected, local = diloco_reference(survivor["syncs"], 1, survivor["initial"], sync_every=SYNC_EVERY,
                                       outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, scheduled=True,
                                       fragments=fragments, overlap=overlap, heals=heals,
                                       until=max_steps, with_local=True)
    atol = 1e-5 if accelerator == "cpu" else 1e-4  # the replay runs on the CPU
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=atol)
    for rank in (survivor, restarted):
        for name, value in rank["local"].items():
            torch.testing.assert_close(value, local[rank["site"]][name], rtol=0, atol=atol)


def test_elastic_diloco_checkpoints_are_saved_once_by_the_sites_present_and_resume_the_job(tmp_path, lighthouse):
    # DiLoCoStrategy(elastic=True) with a ModelCheckpoint every 2 rounds on both sites; site0, the leader, is
    # SIGKILLed: site1 alone saves the rounds in between, each once; such a checkpoint resumes a new elastic fit at
    # the job's round, and its rounds continue the replay of the committed ones (outer momentum included)
    # (site1 holds two rounds before the end until site0 is back: the rounds between need not outlast a restart)
    ckpts, every, max_steps = tmp_path / "ckpts", 2 * SYNC_EVERY, 64
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 1, 0, "--max-steps", str(max_steps), "--sleep", "0.08",
                           "--ckpt-dir", str(ckpts), script=DILOCO_SCRIPT, kill_at=24, hold=True)
    survivor, restarted = run["ranks"][("site1", 0)], run["ranks"][("site0", 0)]
    assert survivor["final_step"] == restarted["final_step"] == max_steps
    saved = {info.step: info for name in os.listdir(ckpts) for info in list_checkpoints(str(ckpts / name))}
    assert sorted(saved) == list(range(every, max_steps + 1, every)), sorted(saved)  # every one, once
    # a checkpoint saved at the end of a round that site1 ran alone (its save is site1's: the leader then)
    alone = sorted(e["t0"] + SYNC_EVERY for e in survivor["log"] if e["sites"] == [1] and
                   (e["t0"] + SYNC_EVERY) in saved)
    assert alone, f"no checkpoint was saved while site0 was down (rounds {survivor['log']})"
    step = alone[0]
    resumed = run_alone(tmp_path / "resume", lighthouse.address, "--max-steps", str(step + 2 * SYNC_EVERY),
                        "--resume", str(ckpts / f"step={step}.ckpt"), script=DILOCO_SCRIPT)
    assert resumed["final_step"] == step + 2 * SYNC_EVERY
    assert [e["t0"] for e in resumed["log"]] == [step, step + SYNC_EVERY] and resumed["log"][0]["sites"] == [0]
    before = [e for e in survivor["log"] if e["t0"] < step]
    assert resumed["log"][0]["step"] == len(before)  # the job's round count continues
    expected = diloco_reference(before + resumed["log"], 1, survivor["initial"], sync_every=SYNC_EVERY,
                                outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, scheduled=True)
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)


# A fit that elastic mode cannot follow: {case: (the script's arguments, what its refusal says)}.
REFUSED = {
    "loss-scaling": (["--precision", "16-mixed"], "elastic with fp16 loss scaling"),
    "epoch-scheduler": (["--interval", "epoch"], "elastic=True steps LR schedulers once per committed step; LambdaLR "
                                                 "has interval='epoch'"),
}


@pytest.fixture(scope="module")
def refused_fits(tmp_path_factory):
    """Each fit of ``REFUSED``, a one-site job of its own, all at once (each is one process beside its torchrun);
    ``{case: (exit code, its log, its folder)}``."""
    lighthouse, trees, ended = Lighthouse(), {}, {}
    try:
        for case, (extra, _) in REFUSED.items():
            out = tmp_path_factory.mktemp(case)
            trees[case] = (start_site("site0", 1, 1, lighthouse.address, out, "--max-steps", "5", *extra,
                                      script=SCRIPT), out)
        for case, (tree, out) in trees.items():
            code, _ = tree.wait(TIMEOUT_S)
            ended[case] = (code, site_logs(out, "site0"), out)
    finally:
        for tree, _ in trees.values():
            tree.kill()
        lighthouse.server.shutdown()
    return ended


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_fit_that_elastic_mode_cannot_follow_is_refused_before_training(refused_fits, case):
    code, log, out = refused_fits[case]
    assert code != 0 and REFUSED[case][1] in log, log
    assert not (out / "site0.progress").exists()  # no step ran


def test_a_site_in_its_setup_holds_up_no_quorum(tmp_path):
    # site1's strategy built its ElasticSite, then the fit's setup goes on (on_fit_start sleeps): another job's
    # first quorum forms at once (with the manager started at construction it waited until it timed out)
    site0 = first_quorum_beside_an_idle_site(tmp_path, ["--max-steps", "5", "--setup-s", "600"],
                                             ["--max-steps", "3"], script=SCRIPT)
    assert site0["final_step"] == 3


def test_elastic_settings_are_checked_at_construction(monkeypatch):
    monkeypatch.delenv("MULTIDC_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="set MULTIDC_LIGHTHOUSE=host:port"):
        HierarchicalDDPStrategy(elastic=True)
    monkeypatch.setenv("MULTIDC_ELASTIC", "1")
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "10.0.0.5")
    with pytest.raises(ValueError, match="must be host:port"):
        HierarchicalDDPStrategy()
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "10.0.0.5:29510")
    assert HierarchicalDDPStrategy().elastic and not HierarchicalDDPStrategy(elastic=False).elastic
    config = DiLoCoConfig(sync_every=4)
    assert DiLoCoStrategy(diloco=config).elastic
    assert DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=4, fragments=2, overlap_steps=1)).elastic  # every variant
    with pytest.raises(ValueError, match="overlap_steps=1 must be below the smallest gap between two fragments"):
        DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=4, fragments=3, overlap_steps=1))
