"""``MultiDCAccelerator`` with ``MultiDCPlugin(dp_shard=2, elastic=True)`` under real ``accelerate launch`` runs,
one per site (gloo, CPU, a real torchft lighthouse): each site shards the model with FSDP2 over its 2 processes. A
site SIGKILLed mid-training leaves the other training; restarted with the same command, each of its processes
receives the same-index process's shards (model, optimizer) and the LR scheduler and the job's step, and every
process of both sites ends bitwise identical, equal to a single-process replay of the committed steps."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests._resources import require_module, require_torchft

require_torchft()
require_module("accelerate", "accelerate")

from multidc.plugins import MultiDCPlugin  # noqa: E402
from tests._elastic import TIMEOUT_S, check_diloco_rejoined, check_rejoined, run_with_a_kill  # noqa: E402
from tests.hierarchical.elastic_reference import reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "plugins" / "_accelerate_elastic_script.py")
ACCELERATE = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file",
              str(ROOT / "examples" / "accelerate_config.yaml")]
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def test_a_killed_fsdp_site_rejoins_an_accelerate_run_live(tmp_path, lighthouse):
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, "--dp-shard", "2", "--steps", "30", "--sleep",
                          "0.05", script=SCRIPT, kill_at=8, accelerate=ACCELERATE)
    _, survivor = check_rejoined(run, 2, 30)
    assert survivor["lr"] == run["ranks"][("site1", 0)]["lr"]  # the LR schedule followed the committed steps
    assert set(survivor["sharded"]) == {"DTensor"}  # FSDP2 sharded every parameter over the site's ranks
    expected = reference(survivor["log"], 2, survivor["initial"], scheduled=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fragments,overlap", [(1, 0), (2, 1)], ids=["plain", "streaming-overlap"])
def test_a_killed_fsdp_site_rejoins_an_elastic_diloco_accelerate_run_live(tmp_path, lighthouse, fragments, overlap):
    # MultiDCPlugin(dp_shard=2, cross_site="diloco", elastic=True): a quorum per round; the restarted site's ranks
    # receive their peers' shards of the global and local parameters and of the outer and inner optimizer states
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, "--dp-shard", "2", "--diloco", "--fragments",
                          str(fragments), "--overlap", str(overlap), "--steps", "8", "--sleep", "0.1",
                          script=SCRIPT, kill_at=3, accelerate=ACCELERATE)
    assert set(run["ranks"][("site0", 0)]["sharded"]) == {"DTensor"}
    check_diloco_rejoined(run, 2, fragments, overlap)


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp", "pp"])
def test_elastic_layouts_other_than_data_parallel_are_refused(sizes):
    from multidc.hierarchical.elastic.shards import check_elastic_layout

    plugin = MultiDCPlugin(elastic=True, lighthouse="127.0.0.1:1", dp_shard=1, **sizes)
    assert plugin.layout.num_sites == 1  # this launch is one site, whatever num_sites counts
    with pytest.raises(ValueError, match=next(iter(sizes))):
        check_elastic_layout(plugin.layout.resolve(2), "MultiDCPlugin")
