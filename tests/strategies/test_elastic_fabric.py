"""``Fabric(strategy=HierarchicalDDPFabricStrategy(elastic=True))``: one ``torchrun`` of 2 ranks per site (gloo, CPU, a
real torchft lighthouse). A site SIGKILLed mid-training leaves the other training; restarted with the same command,
it receives the live model, optimizer and LR scheduler (``strategy.elastic_state``) and the job's step, and every
rank of both sites ends bitwise identical, equal to a single-process replay of the committed steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._resources import require_module, require_torchft

require_torchft()
require_module("lightning", "lightning")

from tests._elastic import TIMEOUT_S, check_rejoined, run_with_a_kill  # noqa: E402
from tests.hierarchical.elastic_reference import reference  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parent / "_elastic_fabric_script.py")
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def test_a_killed_site_rejoins_a_fabric_run_live(tmp_path, lighthouse):
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, "--steps", "30", "--sleep", "0.05", script=SCRIPT,
                          kill_at=8)
    _, survivor = check_rejoined(run, 2, 30)
    assert survivor["lr"] == run["ranks"][("site1", 0)]["lr"]  # the LR schedule followed the committed steps
    expected = reference(survivor["log"], 2, survivor["initial"], scheduled=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


def test_the_environment_turns_elastic_on_for_fabric_and_parallel_3d(monkeypatch):
    from multidc.strategies import HierarchicalDDPFabricStrategy, Parallel3DStrategy

    monkeypatch.setenv("MULTIDC_ELASTIC", "1")
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "127.0.0.1:29510")
    assert HierarchicalDDPFabricStrategy().elastic and Parallel3DStrategy().elastic
    assert Parallel3DStrategy().layout.num_sites == 1  # this job is one site
    monkeypatch.delenv("MULTIDC_LIGHTHOUSE")
    with pytest.raises(ValueError, match="MULTIDC_LIGHTHOUSE"):
        HierarchicalDDPFabricStrategy()
