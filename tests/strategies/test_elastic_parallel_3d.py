"""``Parallel3DStrategy(elastic=True)`` through a Lightning ``Trainer``: each site one ``torchrun`` of 2 ranks that
shard the model with FSDP2 (``dp_shard=2``), a real torchft lighthouse. A site SIGKILLed mid-``fit`` leaves the other
training; restarted with the same command, each of its ranks receives the same-index rank's shards (model and
optimizer) and the job's step, and every rank of both sites ends bitwise identical, equal to a single-process replay
of the committed steps. Plus the settings it refuses, in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._resources import require_module, require_torchft

require_torchft()
require_module("lightning", "lightning")

from multidc.plugins import list_checkpoints  # noqa: E402
from multidc.strategies import Parallel3DStrategy  # noqa: E402
from tests._elastic import TIMEOUT_S, check_rejoined, run_alone, run_with_a_kill  # noqa: E402
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import diloco_reference, reference  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parent / "_elastic_lightning_script.py")
DILOCO_SCRIPT = str(Path(__file__).resolve().parent / "_elastic_diloco_lightning_script.py")
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def test_a_killed_fsdp_site_rejoins_a_parallel_3d_fit_live(tmp_path, lighthouse):
    # site0, the checkpoint writer, is SIGKILLed: site1 alone saves the steps in between (each rank its shards),
    # each once; such a checkpoint resumes a 1-rank elastic parallel_3d fit (another layout) at the job's step
    ckpts = tmp_path / "ckpts"
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 0, "--strategy", "parallel_3d", "--max-steps", "60",
                          "--sleep", "0.05", "--ckpt-dir", str(ckpts), script=SCRIPT, hold=True)
    first, survivor = check_rejoined(run, 2, 60)
    assert set(survivor["sharded"]) == {"DTensor"}  # FSDP2 sharded every parameter over the site's ranks
    expected = reference(survivor["log"], 2, survivor["initial"], scheduled=True)
    for name, value in first["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    saved = {info.step for name in os.listdir(ckpts) for info in list_checkpoints(str(ckpts / name))}
    assert sorted(saved) == list(range(10, 61, 10)), sorted(saved)  # every one, once (one folder per step)
    degraded = [e["step"] + 1 for e in survivor["log"] if e["sites"] == [1]]
    step = next(step for step in sorted(saved) if step in degraded)
    resumed = run_alone(tmp_path / "resume", lighthouse.address, "--strategy", "parallel_3d", "--max-steps",
                        str(step + 5), "--resume", str(ckpts / f"step={step}.ckpt"), script=SCRIPT)
    assert [e["step"] for e in resumed["log"]] == list(range(step, step + 5))
    at_save = reference([e for e in survivor["log"] if e["step"] < step], 2, survivor["initial"], scheduled=True)
    expected = reference(resumed["log"], 1, at_save, scheduled=True)
    for name, value in resumed["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("fragments", [1, 2], ids=["plain", "streaming"])
def test_a_killed_fsdp_site_rejoins_an_elastic_diloco_parallel_3d_fit_live(tmp_path, lighthouse, fragments):
    # cross_site="diloco": a quorum per round; each rank of the restarted site receives its peer's shards of the
    # global and local parameters and of the outer and inner optimizer states
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, "--strategy", "parallel_3d", "--max-steps", "64",
                          "--sleep", "0.05", "--fragments", str(fragments), script=DILOCO_SCRIPT, kill_at=16,
                          hold=True)
    ranks = run["ranks"]
    survivor, restarted = ranks[("site0", 0)], ranks[("site1", 0)]
    assert set(survivor["sharded"]) == {"DTensor"}
    for key, rank in ranks.items():
        assert rank["final_step"] == 64, key
        for name, value in rank["params"].items():  # the global parameters, bitwise identical everywhere
            assert torch.equal(value, survivor["params"][name]), (key, name)
    rounds = survivor["log"]
    assert [e["step"] for e in rounds] == list(range(len(rounds))) and rounds[-1]["sites"] == [0, 1]
    assert any(e["sites"] == [0] and e["t0"] >= run["killed_at"] for e in rounds)  # trained on alone
    assert restarted["first_t"] > run["killed_at"] and all(e["sites"] == [0, 1] for e in restarted["log"])
    heals = [{"site": 1, "source": 0, "t0": restarted["first_t"]}]
    expected, local = diloco_reference(survivor["syncs"], 2, survivor["initial"], sync_every=SYNC_EVERY,
                                       outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, scheduled=True,
                                       fragments=fragments, heals=heals, until=64, with_local=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)
    for rank in (survivor, restarted):
        for name, value in rank["local"].items():
            torch.testing.assert_close(value, local[rank["site"]][name], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("sizes", "what"), [({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                                             ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
                                             ({"dp_replicate": 2}, "dp_replicate")])
def test_elastic_parallel_3d_refuses_what_it_does_not_run(sizes, what):
    from multidc.hierarchical.elastic.shards import check_elastic_layout

    strategy = Parallel3DStrategy(elastic=True, lighthouse="127.0.0.1:1", dp_shard=1, **sizes)
    assert strategy.layout.num_sites == 1  # the job is one site
    with pytest.raises(ValueError, match=what):
        check_elastic_layout(strategy.layout.resolve(2), "Parallel3DStrategy")
