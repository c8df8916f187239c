"""3D/4D parallelism against one-process training: parallelize() on gloo ranks, and Parallel3DStrategy in a
Lightning Trainer run. Per-rank parameter memory against full / (tp * pp * shard).

Tolerance for every parity check (fp32, 3 steps): rtol 1e-4, atol 2e-5 on losses, global gradient norms and
every weight (the only differences are reduction order).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os

import pytest
import torch

from multidc.hierarchical.tools.ranks import run_ranks
from tests._launch import finish, start_training_script
from tests._resources import require_module
from tests._tiny_models import assert_parity, parallel_run, reference_run

FOUR_RANK_CASES = {
    "tp2xpp2": dict(
        layout=dict(pipeline_parallel_size=2, tensor_parallel_size=2), tp="transformer",
        pipeline=dict(schedule="1f1b"), memory=True,
    ),
    "dp_shard2xpp2": dict(  # optimizer built before prepare_parallel, as under Accelerate
        layout=dict(pipeline_parallel_size=2, dp_shard=2), pipeline=dict(schedule="gpipe"), memory=True,
        optimizer_first=True,
    ),
    "sites2xdp_shard2": dict(layout=dict(num_sites=2, dp_shard=2), no_sync_probe=True),
    "sites2xdp_replicate2": dict(layout=dict(num_sites=2, dp_replicate=2, dp_shard=1)),
    "sites2xdp_shard2_int8": dict(layout=dict(num_sites=2, dp_shard=2), compression="int8"),
}
EXACT_CASES = [name for name, case in FOUR_RANK_CASES.items() if "compression" not in case]
EIGHT_RANK_CASES = {  # (case, per-rank parameter memory divisor)
    "sites2xpp2xtp2": (dict(
        layout=dict(num_sites=2, pipeline_parallel_size=2, tensor_parallel_size=2), tp="transformer",
        pipeline=dict(schedule="interleaved_1f1b"), memory=True,
    ), 4),  # tp 2 x pp 2 x shard 1
    # the README's layout: FSDP shards over TP shards inside each site
    "sites2xdp_shard2xtp2": (dict(layout=dict(num_sites=2, dp_shard=2, tensor_parallel_size=2), tp="transformer",
                                  memory=True), 4),  # tp 2 x shard 2
}
for _case in (*FOUR_RANK_CASES.values(), *(c for c, _ in EIGHT_RANK_CASES.values())):
    _case["global_batch"] = 8


def _cases(rank, world, cases):
    results = [parallel_run(rank, world, case) for case in cases]
    return results + [_flat_fsdp_is_detected(rank, world)]


def _flat_fsdp_is_detected(rank, world):
    """A ModelParallelStrategy-style configure_model (fully_shard over "data_parallel") crosses sites; ours not."""
    from torch.distributed.fsdp import fully_shard

    from multidc.hierarchical.parallel.data_parallel import fsdp_mesh_crosses_sites
    from multidc.hierarchical.parallel.layout import ParallelLayout, submesh
    from multidc.hierarchical.parallel.parallelize import parallelize
    from tests._tiny_models import TinyGPT

    mesh = ParallelLayout(num_sites=2).build_mesh()
    flat, ours = TinyGPT(), TinyGPT()
    fully_shard(flat, mesh=submesh(mesh, "data_parallel"))
    parallelize(ours, mesh, blocks=ours.blocks())
    return fsdp_mesh_crosses_sites(flat, mesh), fsdp_mesh_crosses_sites(ours, mesh)


@pytest.fixture(scope="module")
def four_rank_results():
    """All 4-rank cases in one spawn (starting ranks is the slow part); {case: per-rank results}."""
    per_rank = run_ranks(_cases, 4, list(FOUR_RANK_CASES.values()), timeout=300)
    results = {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(FOUR_RANK_CASES)}
    results["flat_fsdp_detected"] = [ranks[-1] for ranks in per_rank]
    return results


def test_fsdp_over_data_parallel_axis_is_flagged_as_crossing_sites(four_rank_results):
    assert four_rank_results["flat_fsdp_detected"] == [(True, False)] * 4


@pytest.mark.parametrize("name", EXACT_CASES)
def test_four_rank_layout_trains_like_one_process(four_rank_results, name):
    assert_parity(four_rank_results[name], reference_run(FOUR_RANK_CASES[name]))


def test_int8_wan_compression_keeps_replicas_bitwise_identical_and_close_to_exact(four_rank_results):
    """int8 on the WAN hop (error feedback on): every rank ends with the same weights, bit for bit, within 1e-2
    of exact training after 3 steps (per-chunk int8 scales, lr 0.2)."""
    results = four_rank_results["sites2xdp_shard2_int8"]
    reference = reference_run(FOUR_RANK_CASES["sites2xdp_shard2_int8"])
    for name, value in results[0]["params"].items():
        for other in results[1:]:
            assert torch.equal(other["params"][name], value), name
        torch.testing.assert_close(value, reference["params"][name], rtol=0, atol=1e-2, msg=name)
    exact = four_rank_results["sites2xdp_shard2"][0]["params"]
    assert any(not torch.equal(exact[n], v) for n, v in results[0]["params"].items()), "int8 must change something"


def test_sites_exchange_replicas_only_through_the_hierarchical_wan_path(four_rank_results):
    for case in ("sites2xdp_shard2", "sites2xdp_replicate2"):
        for result in four_rank_results[case]:
            wan = result["wan"]
            # 4 FSDP units (embedding, 2 blocks, head) x 3 steps, each reduced over the WAN once per step
            assert wan["calls"] == 12 and wan["bytes_sent"] > 0, (case, wan)


def test_accumulation_step_without_sync_sends_nothing_over_the_wan(four_rank_results):
    for result in four_rank_results["sites2xdp_shard2"]:
        before, no_sync, sync = result["wan"], result["wan_after_no_sync_step"], result["wan_after_sync_step"]
        assert no_sync["bytes_sent"] == before["bytes_sent"] and no_sync["calls"] == before["calls"]
        assert sync["bytes_sent"] > no_sync["bytes_sent"]


@pytest.mark.parametrize("name,divisor", [("tp2xpp2", 4), ("dp_shard2xpp2", 4)])
def test_per_rank_parameter_memory_is_full_over_tp_pp_shard(four_rank_results, name, divisor):
    for result in four_rank_results[name]:
        local, full = result["memory"]
        assert local * divisor == full, (name, local, full)


def _eight_rank_cases(rank, world, cases):
    return [parallel_run(rank, world, case) for case in cases]


@pytest.fixture(scope="module")
def eight_rank_results():
    """Both 8-rank cases in one spawn; {case: per-rank results}."""
    per_rank = run_ranks(_eight_rank_cases, 8, [c for c, _ in EIGHT_RANK_CASES.values()], timeout=400)
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(EIGHT_RANK_CASES)}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", list(EIGHT_RANK_CASES))
def test_eight_ranks_train_like_one_process_with_a_fraction_of_the_memory(eight_rank_results, name):
    case, divisor = EIGHT_RANK_CASES[name]
    results = eight_rank_results[name]
    assert_parity(results, reference_run(case))
    for result in results:
        local, full = result["memory"]
        assert local * divisor == full, (name, local, full)
        assert result["wan"]["bytes_sent"] > 0


# ------------------------------------------------------------------------------------------------ Lightning

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "gpt_3d.py")
MODEL_PARALLEL_SCRIPT = os.path.join(os.path.dirname(__file__), "_model_parallel_script.py")
LIGHTNING_ARGS = dict(devices=4, sites=2, pp=2, tp=1, schedule="1f1b", microbatches=2, layers=2, hidden=16,
                      batch_size=4, max_steps=3, clip=0.05)
LIGHTNING_LAYOUTS = {"sites2xpp2": dict(pp=2, tp=1), "sites2xtp2": dict(pp=1, tp=2)}


def _load_example():
    spec = importlib.util.spec_from_file_location("gpt_3d_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    """The module's Lightning runs, 4 ranks each, all at once (each run's first process imports Lightning alone before
    it starts the others, which leaves a core idle): examples/gpt_3d.py in each of ``LIGHTNING_LAYOUTS``, and
    _model_parallel_script.py with 2 sites and tp 2; ``{name: (exit code, output, out dir)}``."""
    require_module("lightning", "lightning")
    runs = {layout: (EXAMPLE, [f"--{k.replace('_', '-')}={v}" for k, v in {**LIGHTNING_ARGS, **sizes}.items()], {})
            for layout, sizes in LIGHTNING_LAYOUTS.items()}
    runs["model_parallel"] = (MODEL_PARALLEL_SCRIPT, [], {"MULTIDC_NUM_SITES": "2", "MULTIDC_TP_SIZE": "2"})
    dirs = {name: tmp_path_factory.mktemp(name) for name in runs}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every run
        trees = {name: stack.enter_context(start_training_script(script, [*args, "--out", str(dirs[name])], env))
                 for name, (script, args, env) in runs.items()}
        return {name: (*finish(tree, 300), dirs[name]) for name, tree in trees.items()}


def _merged_weights(out_dir, ranks: int) -> dict:
    merged = {}
    for rank in range(ranks):
        merged.update(torch.load(out_dir / f"weights_rank{rank}.pt"))
    return merged


def _example_reference(example, a: dict) -> dict:
    """One process, plain PyTorch: same seed, model, optimizer, LR schedule, clipping; the global batches."""
    import lightning.pytorch as pl

    pl.seed_everything(0)
    model = example.GPT(hidden=a["hidden"], layers=a["layers"], max_steps=a["max_steps"])
    config = model.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    data = example.bigram_data(model.hparams.vocab, model.hparams.seq, rows=4096)
    dp = a["devices"] // (a["pp"] * a["tp"])
    val = example.bigram_data(model.hparams.vocab, model.hparams.seq, rows=example.VAL_BATCHES * a["batch_size"] * dp,
                              sample_seed=example.VAL_SEED)
    # Lightning trains with DistributedSampler(shuffle=True, seed=0): epoch 0 is randperm(seed 0), and replica r
    # takes every dp-th index from r, so global batch t is the t-th block of dp * batch_size indices.
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    rows = a["batch_size"] * dp
    losses = []
    for step in range(a["max_steps"]):
        x, y = data[order[step * rows : (step + 1) * rows]]
        loss = example.next_token_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a["clip"])
        assert norm > a["clip"], "the case must actually clip"
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # validation: equal batches on every replica, so the mean of means is the mean
        val_loss = example.next_token_loss(model(val.tensors[0]), val.tensors[1]).item()
    return {"losses": losses, "val_loss": val_loss, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LIGHTNING_LAYOUTS))
def test_lightning_parallel_3d_example_trains_like_one_process(lightning_runs, layout):
    """examples/gpt_3d.py on 4 ranks: pipeline (pipeline_step) or tensor parallel (configure_model) x 2 sites; the
    loss falls; then trainer.validate on the same, already parallel model (configure_model and setup run again)."""
    args = {**LIGHTNING_ARGS, **LIGHTNING_LAYOUTS[layout]}
    code, out, out_dir = lightning_runs[layout]
    assert code == 0, out[-6000:]  # it exits non-zero when the training loss does not fall
    with open(out_dir / "run.json") as f:
        run = json.load(f)
    assert len(run["losses"]) == args["max_steps"] and run["losses"][-1] < run["losses"][0], run["losses"]
    assert f"loss: first {run['losses'][0]:.3f} -> last {run['losses'][-1]:.3f}" in out
    reference = _example_reference(_load_example(), args)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=1e-4, atol=2e-5)
    assert math.isclose(run["val_loss"], reference["val_loss"], rel_tol=1e-4, abs_tol=2e-5), (run, reference)
    merged = _merged_weights(out_dir, args["devices"])
    assert set(merged) == set(reference["params"])
    for name, value in merged.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=2e-5, msg=name)
    assert run["wan"]["bytes_sent"] > 0


@pytest.mark.timeout(400)
def test_model_parallel_strategy_module_runs_unchanged_with_sites_and_reduces_them_hierarchically(lightning_runs):
    """_model_parallel_script.py: TP + fully_shard over device_mesh["data_parallel"] in configure_model; its FSDP
    stays inside each site (test_model_parallel_dropin.py compares it with ModelParallelStrategy)."""
    import tests.strategies._model_parallel_script as script
    from tests._tiny_models import TinyGPT, loss_fn

    code, out, out_dir = lightning_runs["model_parallel"]
    assert code == 0, out[-6000:]
    assert "cross the WAN flat" not in out
    with open(out_dir / "bytes_rank0.json") as f:
        sent = json.load(f)
    assert sent["fsdp_cross_site"] == 0 and sent["wan_stats"] > 0, sent
    with open(out_dir / "run.json") as f:
        run = json.load(f)
    torch.manual_seed(0)  # seed_everything(0) before the module, as the script
    model = TinyGPT(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    data = script.dataset(run["replicas"])
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))  # Lightning's shuffled sampler
    rows, losses = script.ROWS_PER_REPLICA * run["replicas"], []
    for step in range(script.STEPS):
        x, y = data[order[step * rows : (step + 1) * rows]]
        loss = loss_fn(model(x), y)
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), script.CLIP) > script.CLIP
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-4, atol=2e-5)
    for name, value in _merged_weights(out_dir, 4).items():
        torch.testing.assert_close(value, dict(model.named_parameters())[name].detach(), rtol=1e-4, atol=2e-5)


def test_parallel_3d_name_reads_layout_from_env_and_bad_sizes_fail_at_trainer(monkeypatch):
    require_module("lightning", "lightning")
    from lightning.pytorch import Trainer

    from multidc.strategies import Parallel3DStrategy

    monkeypatch.setenv("MULTIDC_NUM_SITES", "2")
    monkeypatch.setenv("MULTIDC_PP_SIZE", "2")
    monkeypatch.setenv("MULTIDC_PP_SCHEDULE", "gpipe")
    trainer = Trainer(accelerator="cpu", devices=4, strategy="parallel_3d", logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, Parallel3DStrategy)
    assert strategy.layout.resolve(4).shape == (2, 2, 1, 1, 1)
    assert strategy.pipeline_config.schedule == "gpipe"
    with pytest.raises(ValueError, match="= 8 ranks, but the world has 4"):
        Trainer(accelerator="cpu", devices=4, strategy=Parallel3DStrategy(dp_shard=2), logger=False)


def test_parallel_3d_leaves_the_site_count_to_the_ranks_when_they_name_their_sites(monkeypatch):
    """With MULTIDC_SITE (one name per node) and no num_sites, the launcher cannot know the count: build_mesh
    counts the names on every rank (tested in test_parallel_layout); without names the pre-launch check stays."""
    require_module("lightning", "lightning")
    from lightning.pytorch import Trainer

    from multidc.strategies import Parallel3DStrategy

    def strategy():
        return Parallel3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, dp_shard=1)

    with pytest.raises(ValueError, match="= 4 ranks, but the world has 8"):
        Trainer(accelerator="cpu", devices=8, strategy=strategy(), logger=False)
    monkeypatch.setenv("MULTIDC_SITE", "us-east")
    assert Trainer(accelerator="cpu", devices=8, strategy=strategy(), logger=False).strategy.layout.counts_site_names
