"""``Parallel3DStrategy(elastic=True)`` through a Lightning ``Trainer``: each site one ``torchrun`` of 2 ranks that
shard the model with FSDP2 (``dp_shard=2``), a real torchft lighthouse. A site SIGKILLed mid-``fit`` leaves the other
training; restarted with the same command, each of its ranks receives the same-index rank's shards (model and
optimizer) and the job's step, and every rank of both sites ends bitwise identical, equal to a single-process replay
of the committed steps. Plus the settings it refuses, in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._resources import require_module, require_torchft

require_torchft()
require_module("lightning", "lightning")

from multidc.strategies import Parallel3DStrategy  # noqa: E402
from tests._elastic import TIMEOUT_S, check_rejoined, run_with_a_kill  # noqa: E402
from tests.hierarchical.elastic_reference import reference  # noqa: E402

SCRIPT = str(Path(__file__).resolve().parent / "_elastic_lightning_script.py")
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def test_a_killed_fsdp_site_rejoins_a_parallel_3d_fit_live(tmp_path, lighthouse):
    run = run_with_a_kill(tmp_path, lighthouse.address, 2, 2, 1, "--strategy", "parallel_3d", "--max-steps", "120",
                          "--sleep", "0.05", script=SCRIPT, hold=True)
    first, survivor = check_rejoined(run, 2, 120)
    assert set(survivor["sharded"]) == {"DTensor"}  # FSDP2 sharded every parameter over the site's ranks
    expected = reference(survivor["log"], 2, survivor["initial"], scheduled=True)
    for name, value in first["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("sizes", "what"), [({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                                             ({"pipeline_parallel_size": 2}, "pipeline_parallel_size")])
def test_elastic_parallel_3d_refuses_what_it_does_not_run(sizes, what):
    from multidc.hierarchical.elastic.shards import check_elastic_layout

    strategy = Parallel3DStrategy(elastic=True, lighthouse="127.0.0.1:1", dp_shard=1, **sizes)
    assert strategy.layout.num_sites == 1  # the job is one site
    with pytest.raises(ValueError, match=what):
        check_elastic_layout(strategy.layout.resolve(2), "Parallel3DStrategy")


def test_elastic_parallel_3d_refuses_diloco():
    from multidc.hierarchical import DiLoCoConfig

    with pytest.raises(ValueError, match="allreduce' only"):
        Parallel3DStrategy(elastic=True, lighthouse="127.0.0.1:1", cross_site="diloco",
                           diloco=DiLoCoConfig(sync_every=4))
