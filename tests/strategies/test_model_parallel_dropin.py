"""``Parallel3DStrategy`` as a drop-in for Lightning's ``ModelParallelStrategy``: its constructor arguments with
their meaning (``data_parallel_size`` = data-parallel ranks over all sites), and a LightningModule written for it
(TP over ``device_mesh["tensor_parallel"]``, ``fully_shard`` over the 1-D ``device_mesh["data_parallel"]``),
unchanged, training across two sites like ``ModelParallelStrategy`` with only site-reduced gradients on the WAN.

The Lightning runs (tests/strategies/_model_parallel_script.py, 4 CPU ranks, tp 2 x data-parallel 2, 3 steps, no
clipping: ``ModelParallelStrategy`` cannot clip a model that mixes TP and non-TP parameters) are compared with
``ModelParallelStrategy``'s own run of the same module, not with numbers from an earlier run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests._batched import run_cases
from tests._launch import finish, start_training_script
from tests._resources import require_module

STEPS = 3  # tests/strategies/_model_parallel_script.STEPS; not imported: importing the script needs Lightning

SCRIPT = str(Path(__file__).with_name("_model_parallel_script.py"))


# ------------------------------------------------------------------------------------ data_parallel_size, no ranks

@pytest.mark.parametrize("sizes,shape", [
    (dict(num_sites=2, data_parallel_size=2, tensor_parallel_size=2, world_size=4), (2, 1, 1, 1, 2)),
    (dict(num_sites=2, data_parallel_size=4, tensor_parallel_size="auto", world_size=8), (2, 1, 1, 2, 2)),
    (dict(num_sites=2, data_parallel_size=8, dp_replicate=2, world_size=8), (2, 1, 2, 2, 1)),
    (dict(num_sites="auto", data_parallel_size=4, dp_shard=2, tensor_parallel_size=2, world_size=8), (2, 1, 1, 2, 2)),
    (dict(num_sites=2, data_parallel_size="auto", tensor_parallel_size=2, world_size=8), (2, 1, 1, 2, 2)),
])
def test_data_parallel_size_is_the_total_over_sites(sizes, shape):
    from multidc.hierarchical.parallel.layout import ParallelLayout

    layout = ParallelLayout(**sizes)
    assert layout.shape == shape
    assert layout.dp_size == (sizes["data_parallel_size"] if isinstance(sizes["data_parallel_size"], int)
                              else layout.num_sites * layout.dp_replicate * layout.dp_shard)


@pytest.mark.parametrize("sizes,message", [
    (dict(num_sites=2, dp_shard=2, data_parallel_size=2),
     r"data_parallel_size=2 counts the data-parallel ranks of all sites, but num_sites=2 x dp_replicate=1 x "
     r"dp_shard=2 = 4\. Pass data_parallel_size=4, or leave dp_shard unset"),
    (dict(num_sites=2, data_parallel_size=3),
     r"data_parallel_size=3 .* must be a multiple of num_sites=2 x dp_replicate=1 x dp_shard=auto = 2"),
    (dict(num_sites=2, data_parallel_size=2, tensor_parallel_size=2, world_size=8),
     r"data_parallel_size=2 x pipeline_parallel_size=1 x tensor_parallel_size=2 = 4 ranks, but the world has 8\. "
     r"Would fit: data_parallel_size=4, or pipeline_parallel_size=2, or tensor_parallel_size=4"),
    (dict(num_sites="auto", dp_replicate="auto", data_parallel_size=4),
     r"with data_parallel_size=4 at most one of \['num_sites', 'dp_replicate', 'dp_shard'\]"),
    (dict(data_parallel_size=0), r"data_parallel_size=0 must be a positive int, -1 or 'auto'"),
])
def test_data_parallel_size_that_the_sizes_cannot_make_names_them_and_the_fix(sizes, message):
    from multidc.hierarchical.parallel.layout import ParallelLayout

    with pytest.raises(ValueError, match=message):
        ParallelLayout(**sizes)


def test_parallel_3d_takes_every_model_parallel_strategy_argument_with_its_meaning():
    require_module("lightning", "lightning")
    from lightning.pytorch.strategies import ModelParallelStrategy

    from multidc.strategies import Parallel3DStrategy

    ours = inspect.signature(Parallel3DStrategy).parameters
    assert set(inspect.signature(ModelParallelStrategy).parameters) <= set(ours)
    strategy = Parallel3DStrategy(
        num_sites=2, data_parallel_size=2, tensor_parallel_size=2, save_distributed_checkpoint=False,
        process_group_backend="gloo", timeout=timedelta(seconds=42),
    )
    assert strategy.layout.resolve(4).shape == (2, 1, 1, 1, 2)
    assert strategy.process_group_backend == "gloo" and strategy._timeout == timedelta(seconds=42)
    assert not strategy._sharded_checkpoints()


def test_data_parallel_size_that_does_not_fit_the_world_fails_at_trainer_before_any_rank_starts():
    require_module("lightning", "lightning")
    from lightning.pytorch import Trainer

    from multidc.strategies import Parallel3DStrategy

    strategy = Parallel3DStrategy(num_sites=2, data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x .* = 4 ranks, but the world has 8\. Would fit: "
                                         r"data_parallel_size=4"):
        Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)


def _resolve_with_site_names(rank, world, names, data_parallel_size):
    import os

    from multidc.hierarchical.parallel.layout import ParallelLayout

    os.environ["MULTIDC_SITE"] = names[rank]  # as a launcher sets it per rank (cleared before the next case)
    try:
        return ParallelLayout(data_parallel_size=data_parallel_size, tensor_parallel_size=2).resolve_job().shape
    except ValueError as exc:
        return str(exc)


@pytest.fixture(scope="module")
def four_ranks():
    """The 4-rank cases of this module on one set of spawned ranks (starting ranks is the slow part)."""
    return run_cases({"two site names": (_resolve_with_site_names, (("east", "east", "west", "west"), 2)),
                      "four site names": (_resolve_with_site_names, (("a", "b", "c", "d"), 2)),
                      "hooked units": (_hooked_units, ())}, 4, timeout=240)


def test_site_count_from_names_is_checked_against_data_parallel_size_on_every_rank(four_ranks):
    """Without num_sites the count comes from MULTIDC_SITE, which only the ranks together know: each of them
    resolves data_parallel_size against it, and a conflict raises the same ValueError on every rank."""
    assert four_ranks["two site names"] == [(2, 1, 1, 1, 2)] * 4
    errors = four_ranks["four site names"]
    assert len(set(errors)) == 1 and "num_sites=4 was counted from the MULTIDC_SITE names" in errors[0], errors
    assert "data_parallel_size=2" in errors[0], errors


def _hooked_units(rank, world):
    """How many FSDP units get the replica reduction: blocks sharded inside the site (with and without TP) do; a
    unit sharded over the whole "data_parallel" mesh (FSDP reduces it across sites itself) does not."""
    from torch.distributed.fsdp import fully_shard

    from multidc.hierarchical.parallel.data_parallel import add_replica_reduction, replicate_topology
    from multidc.hierarchical.parallel.layout import ParallelLayout, submesh
    from multidc.hierarchical.parallel.tensor_parallel import apply_tensor_parallel
    from tests._tiny_models import TinyGPT

    counts = []
    for sizes, tp in ((dict(num_sites=2, dp_shard=2), False), (dict(num_sites=2, dp_shard=1, tensor_parallel_size=2),
                                                                True)):
        mesh = ParallelLayout(**sizes).build_mesh()
        model = TinyGPT(2)
        if tp:
            apply_tensor_parallel(list(model.layers), submesh(mesh, "tensor_parallel"))
        fully_shard(model.embed, mesh=submesh(mesh, "data_parallel"))  # across sites: FSDP's own flat reduction
        for block in (*model.layers, model.head):
            fully_shard(block, mesh=submesh(mesh, "dp_shard"))
        fully_shard(model, mesh=submesh(mesh, "dp_shard"))
        counts.append(add_replica_reduction(model, mesh, replicate_topology(mesh)))
    return counts


def test_replica_reduction_goes_to_exactly_the_units_sharded_inside_a_site(four_ranks):
    assert four_ranks["hooked units"] == [[3, 3]] * 4  # 2 layers + head; not the embedding


# ------------------------------------------------------------------------- a ModelParallelStrategy module, 4 ranks

RUNS = {
    "model_parallel": ["--strategy", "model_parallel"],  # ModelParallelStrategy(data_parallel_size=2, tp 2)
    "hierarchical": ["--strategy", "parallel_3d"],  # Parallel3DStrategy(num_sites=2, data_parallel_size=2, tp 2)
    "flat": ["--strategy", "parallel_3d", "--fsdp-across-sites"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same module under each strategy, the runs at once (12 ranks on 2 cores: each run's first process imports
    Lightning alone before it starts the others, which leaves a core idle); {run: log, losses, per-rank weights,
    bytes}."""
    require_module("lightning", "lightning")
    outs = {name: tmp_path_factory.mktemp(name) for name in RUNS}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every run
        trees = {name: stack.enter_context(start_training_script(SCRIPT, ["--out", str(outs[name]), "--clip", "0",
                                                                          *args]))
                 for name, args in RUNS.items()}
        logs = {}
        for name, tree in trees.items():
            code, logs[name] = finish(tree, 240)
            assert code == 0, f"{name}:\n{logs[name][-6000:]}"
    results = {}
    for name, out in outs.items():
        log = logs[name]
        with open(out / "run.json") as f:
            losses = json.load(f)["losses"]
        weights = [torch.load(out / f"weights_rank{rank}.pt") for rank in range(4)]
        sent = []
        for rank in range(4):
            with open(out / f"bytes_rank{rank}.json") as f:
                sent.append(json.load(f))
        results[name] = {"log": log, "losses": losses, "weights": weights, "bytes": sent}
    return results


@pytest.mark.timeout(800)
def test_module_trains_like_under_model_parallel_strategy_with_identical_replicas(runs):
    reference, ours = runs["model_parallel"], runs["hierarchical"]
    assert len(ours["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=1e-7)
    for rank in range(4):
        assert set(ours["weights"][rank]) == set(reference["weights"][rank])
        for name, value in ours["weights"][rank].items():
            torch.testing.assert_close(value, reference["weights"][rank][name], rtol=1e-6, atol=1e-7, msg=name)
            assert torch.equal(value, ours["weights"][0][name]), (rank, name)  # every rank, both sites: the same
    assert "cross the WAN flat" not in ours["log"]


@pytest.mark.timeout(800)
def test_only_site_reduced_gradients_cross_the_wan_and_fewer_bytes_than_flat_fsdp(runs):
    """Flat (ModelParallelStrategy's FSDP over both sites): every step all-gathers each rank's parameter shard across
    the site boundary in forward (and again in backward for the resharded blocks) and reduce-scatters its gradients
    there. Hierarchical: FSDP stays inside the site; each rank sends its site's gradient once per step, 2 (k-1)/k
    of its bytes for k = 2 sites, i.e. exactly its parameter bytes."""
    for flat, ours in zip(runs["model_parallel"]["bytes"], runs["hierarchical"]["bytes"]):
        assert ours["fsdp_cross_site"] == 0 and flat["wan_stats"] == 0, (flat, ours)
        assert ours["wan_stats"] == STEPS * ours["param_bytes"], ours
        # lower bound for flat from the parameter sizes: the forward all-gather and the reduce-scatter each send
        # the half of the (TP-local) parameter bytes that the other site's rank holds, every step
        assert flat["param_bytes"] * 2 == ours["param_bytes"]
        assert flat["fsdp_cross_site"] >= STEPS * 2 * flat["param_bytes"], flat
        assert ours["wan_stats"] < flat["fsdp_cross_site"], (flat, ours)


@pytest.mark.timeout(800)
def test_fsdp_across_sites_keeps_the_flat_sharding_and_says_why(runs):
    flat, reference = runs["flat"], runs["model_parallel"]
    assert "fsdp_across_sites=True keeps it there: that module's gradients cross the WAN flat" in flat["log"]
    assert [b["fsdp_cross_site"] for b in flat["bytes"]] == [b["fsdp_cross_site"] for b in reference["bytes"]]
    assert all(b["wan_stats"] == 0 for b in flat["bytes"])
    torch.testing.assert_close(torch.tensor(flat["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=1e-7)
