"""``MultiDCPlugin(elastic=True)`` under real ``accelerate launch`` runs, one per site (gloo, CPU, a real torchft
lighthouse in this process): a site SIGKILLed mid-training leaves the other training, restarts with the same
command, receives the live model / optimizer / LR scheduler state and the job's step at ``prepare``, and both end
bitwise identical, equal to a single-process replay of the committed steps (or DiLoCo rounds). Plus the settings
checks, in process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests._launch import run_script
from tests._resources import require_module, require_torchft

require_torchft()
require_module("accelerate", "accelerate")

from multidc.hierarchical import DiLoCoConfig  # noqa: E402
from multidc.plugins import Checkpointer, MultiDCPlugin, RNGState, list_checkpoints  # noqa: E402
from tests._elastic import (  # noqa: E402
    TIMEOUT_S,
    check_diloco_rejoined,
    check_rejoined,
    finish_all,
    run_alone,
    run_with_a_kill,
    start_site,
)
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import diloco_reference, reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "plugins" / "_accelerate_elastic_script.py")
ACCELERATE = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
              str(ROOT / "examples" / "accelerate_config.yaml")]
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_killed_site_rejoins_an_accelerate_run_live(tmp_path, lighthouse, layout):
    # fsdp: MultiDCPlugin(dp_shard=2), FSDP2 over each site's 2 processes; each rank's shards are averaged with, and
    # healed from, the same-index rank of the other site
    extra = ["--dp-shard", "2"] if layout == "fsdp" else []
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, *extra, "--steps", "30", "--sleep", "0.05",
                           script=SCRIPT, kill_at=8, accelerate=ACCELERATE)
    _, survivor = check_rejoined(run, 2, 30)
    assert survivor["lr"] == run["ranks"][("site1", 0)]["lr"]  # the LR schedule followed the committed steps
    assert set(survivor["sharded"]) == ({"DTensor"} if layout == "fsdp" else {"Parameter"})
    expected = reference(survivor["log"], 2, survivor["initial"], scheduled=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fragments,overlap,dp_shard", [(1, 0, 0), (2, 0, 0), (2, 1, 0), (1, 0, 2), (2, 1, 2)],
                         ids=["plain", "streaming", "overlap", "fsdp-plain", "fsdp-streaming-overlap"])
def test_a_killed_site_rejoins_an_elastic_diloco_run_live(tmp_path, lighthouse, fragments, overlap, dp_shard):
    # one process per site, or (fsdp) MultiDCPlugin(dp_shard=2) over 2: a quorum per round; the restarted site's
    # ranks receive their peers' (shards of the) global and local parameters and outer and inner optimizer states
    extra, per_site = (["--dp-shard", str(dp_shard)], dp_shard) if dp_shard else ([], 1)
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, per_site, 1, *extra, "--diloco", "--fragments",
                           str(fragments), "--overlap", str(overlap), "--steps", "8", "--sleep", "0.1", script=SCRIPT,
                           kill_at=3, accelerate=ACCELERATE)
    assert set(run["ranks"][("site0", 0)]["sharded"]) == ({"DTensor"} if dp_shard else {"Parameter"})
    check_diloco_rejoined(run, per_site, fragments, overlap)


@pytest.mark.parametrize("mode", ["allreduce", "diloco"])
def test_elastic_checkpoints_are_saved_once_by_the_sites_present_and_resume_the_job(tmp_path, lighthouse, mode):
    # save_state on both sites every `every` job steps; site0, the first of the quorum, SIGKILLed: site1 alone saves
    # the steps in between (a second writer of a step would fail: steps must grow); a checkpoint of such a step,
    # load_state'd right after prepare, resumes a new run at the job's step, equal to the replay of the committed ones
    diloco = mode == "diloco"
    every = 2 * SYNC_EVERY if diloco else 4  # job steps: inner steps under DiLoCo
    ckpts = tmp_path / "ckpts"
    extra = ["--diloco", "--steps", "10", "--sleep", "0.1"] if diloco else ["--steps", "30", "--sleep", "0.05"]
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 1, 0, *extra, "--ckpt-dir", str(ckpts), "--ckpt-every",
                           str(every), script=SCRIPT, kill_at=3 if diloco else 8, accelerate=ACCELERATE)
    _, survivor = check_rejoined(run, 2, 10 if diloco else 30)
    ends = {e["t0"] + SYNC_EVERY if diloco else e["step"] + 1: e for e in survivor["log"]}  # job step after each
    saved = [info.step for info in list_checkpoints(str(ckpts))]
    assert saved == [s for s in sorted(ends) if s % every == 0], (saved, sorted(ends))
    alone = [s for s in saved if ends[s]["sites"] == [1]]
    assert alone, f"no checkpoint was saved while site0 was down ({survivor['log']})"
    step = alone[0]
    before = [e for e in survivor["log"] if (e["t0"] if diloco else e["step"]) < step]
    more = 2 if diloco else 4
    resumed = run_alone(tmp_path / "resume", lighthouse.address, *(["--diloco"] if diloco else []), "--steps",
                        str(len(before) + more), "--resume", str(ckpts), "--resume-step", str(step), script=SCRIPT,
                        accelerate=ACCELERATE)
    assert [e["step"] for e in resumed["log"]] == list(range(len(before), len(before) + more))
    if diloco:
        assert resumed["log"][0]["t0"] == step
        expected = diloco_reference(before + resumed["log"], 1, survivor["initial"], sync_every=SYNC_EVERY,
                                    outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, scheduled=True)
    else:
        expected = reference(before + resumed["log"], 1, survivor["initial"], scheduled=True)
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)


def test_a_save_before_the_quorum_of_a_step_its_first_site_discarded_is_written_once(tmp_path, lighthouse):
    # save_state between scheduler.step() and zero_grad() every 4 job steps on both sites; site0, the first of every
    # quorum, discards step 7 after its transfers completed while site1 commits it: site1's save of job step 8 is
    # written at the next quorum (zero_grad) by site1, the others by site0, each once; step 8's loads as the replay's
    ckpts = tmp_path / "ckpts"
    common = ["--steps", "12", "--sleep", "0.02", "--ckpt-dir", str(ckpts), "--save-before-quorum"]
    trees = {name: start_site(name, 1, 2, lighthouse.address, tmp_path, *common, *extra, script=SCRIPT,
                         accelerate=ACCELERATE)
             for name, extra in (("site0", ["--discard-at", "7"]), ("site1", []))}
    finish_all(trees, tmp_path)
    first, other = (torch.load(tmp_path / f"{name}_rank0.pt") for name in ("site0", "site1"))
    assert (first["discarded"], other["discarded"]) == (1, 0)
    assert [e["step"] for e in other["log"]] == list(range(12)) and other["log"][7]["sites"] == [0, 1]
    assert 8 in other["written"] and sorted(first["written"] + other["written"]) == [4, 8, 12]  # each once
    assert [info.step for info in list_checkpoints(str(ckpts))] == [4, 8, 12]
    mine = RNGState().state_dict()  # step 8 holds the random streams of the save_state call, not of the quorum
    try:
        Checkpointer(str(ckpts)).load({"rng": RNGState()}, 8)
        assert torch.equal(torch.get_rng_state(), other["rng_at_save"][8])
    finally:
        RNGState().load_state_dict(mine)
    resumed = run_alone(tmp_path / "resume", lighthouse.address, "--steps", "10", "--resume", str(ckpts),
                        "--resume-step", "8", script=SCRIPT, accelerate=ACCELERATE)
    assert [e["step"] for e in resumed["log"]] == [8, 9]
    expected = reference([e for e in other["log"] if e["step"] < 8] + resumed["log"], 1, other["initial"],
                         scheduled=True)
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_elastic_settings_are_checked_at_construction(monkeypatch):
    monkeypatch.delenv("MULTIDC_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="set MULTIDC_LIGHTHOUSE=host:port"):
        MultiDCPlugin(elastic=True)
    monkeypatch.setenv("MULTIDC_ELASTIC", "1")
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "127.0.0.1:29510")
    assert MultiDCPlugin().elastic and not MultiDCPlugin(elastic=False).elastic
    assert MultiDCPlugin(dp_shard=2).layout.num_sites == 1  # FSDP2 inside the site: this launch is one site
    from multidc.hierarchical.elastic.shards import check_elastic_layout

    for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"dp_replicate": 2}):
        with pytest.raises(ValueError, match=next(iter(sizes))):  # refused at the launch, on every rank
            check_elastic_layout(MultiDCPlugin(dp_shard=1, **sizes).layout.resolve(2), "MultiDCPlugin")
    overlapped = DiLoCoConfig(sync_every=4, fragments=2, overlap_steps=1)
    assert MultiDCPlugin(cross_site="diloco", diloco=overlapped).elastic  # every DiLoCo variant
    with pytest.raises(ValueError, match="overlap_steps=1 must be below the smallest gap between two fragments"):
        MultiDCPlugin(cross_site="diloco", diloco=DiLoCoConfig(sync_every=4, fragments=3, overlap_steps=1))


def test_a_site_run_without_a_launcher_trains_as_a_one_process_site(tmp_path, lighthouse):
    # plain `python script.py`: Accelerate starts no process group; the site's manager gets a one-rank group
    code, log = _without_launcher(tmp_path, lighthouse.address, "--steps", "4")
    assert code == 0, log
    rank = torch.load(tmp_path / "site0_rank0.pt")
    assert [e["step"] for e in rank["log"]] == [0, 1, 2, 3] and rank["final_step"] == 4


@pytest.mark.parametrize("mode", ["allreduce", "diloco"])
def test_load_state_after_the_site_joined_is_refused(tmp_path, lighthouse, mode):
    # the live state it received at joining would be overwritten: refused, saying when to call it
    code, log = _without_launcher(tmp_path, lighthouse.address, "--steps", "4", "--resume", str(tmp_path / "ckpt"),
                                  "--resume-late", *(["--diloco"] if mode == "diloco" else []))
    assert code != 0
    assert ("RuntimeError: load_state with MultiDCPlugin(elastic=True) comes right after prepare, before the first "
            "job_step, training forward or zero_grad: this site has joined the job") in log, log[-3000:]


def _without_launcher(tmp_path, lighthouse: str, *extra: str) -> tuple[int, str]:
    """site0, a job of one site, run as plain ``python script.py`` (one process); (exit code, log)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIDC_", "TORCHFT_", "ACCELERATE_"))}
    env |= {"MULTIDC_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return run_script([sys.executable, SCRIPT, "--site", "site0", "--sites", "1", "--out", str(tmp_path), *extra],
                      env, TIMEOUT_S)
