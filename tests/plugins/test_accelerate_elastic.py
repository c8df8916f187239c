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
from tests._resources import require_module

require_module("torchft", "elastic")
require_module("accelerate", "accelerate")

from multidc.plugins import MultiDCPlugin  # noqa: E402
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import diloco_reference, reference  # noqa: E402
from tests.hierarchical.test_elastic import TIMEOUT_S, _run_with_a_kill, check_rejoined  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "plugins" / "_accelerate_elastic_script.py")
ACCELERATE = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
              str(ROOT / "examples" / "accelerate_config.yaml")]
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def test_a_killed_site_rejoins_an_accelerate_run_live(tmp_path, lighthouse):
    run = _run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, "--steps", "30", "--sleep", "0.05",
                           script=SCRIPT, kill_at=8, accelerate=ACCELERATE)
    _, survivor = check_rejoined(run, 2, 30)
    assert survivor["lr"] == run["ranks"][("site1", 0)]["lr"]  # the LR schedule followed the committed steps
    expected = reference(survivor["log"], 2, survivor["initial"], scheduled=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_a_killed_one_process_site_rejoins_an_elastic_diloco_run_live(tmp_path, lighthouse):
    run = _run_with_a_kill(tmp_path, lighthouse.address, 2, 1, 1, "--diloco", "--steps", "8", "--sleep", "0.1",
                           script=SCRIPT, kill_at=3, accelerate=ACCELERATE)
    _, survivor = check_rejoined(run, 2, 8)
    expected = diloco_reference(survivor["log"], 1, survivor["initial"], sync_every=SYNC_EVERY, outer_lr=OUTER_LR,
                                outer_momentum=OUTER_MOMENTUM, scheduled=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)


def test_elastic_settings_are_checked_at_construction(monkeypatch):
    monkeypatch.delenv("MULTIDC_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="set MULTIDC_LIGHTHOUSE=host:port"):
        MultiDCPlugin(elastic=True)
    monkeypatch.setenv("MULTIDC_ELASTIC", "1")
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "127.0.0.1:29510")
    assert MultiDCPlugin().elastic and not MultiDCPlugin(elastic=False).elastic
    with pytest.raises(ValueError, match="elastic=True. runs data parallelism only"):
        MultiDCPlugin(dp_shard=2)


def test_a_site_run_without_a_launcher_trains_as_a_one_process_site(tmp_path, lighthouse):
    # plain `python script.py`: Accelerate starts no process group; the site's manager gets a one-rank group
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIDC_", "TORCHFT_", "ACCELERATE_"))}
    env |= {"MULTIDC_LIGHTHOUSE": lighthouse.address, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    code, log = run_script([sys.executable, SCRIPT, "--site", "site0", "--sites", "1", "--steps", "4", "--out",
                            str(tmp_path)], env, TIMEOUT_S)
    assert code == 0, log
    rank = torch.load(tmp_path / "site0_rank0.pt")
    assert [e["step"] for e in rank["log"]] == [0, 1, 2, 3] and rank["final_step"] == 4
