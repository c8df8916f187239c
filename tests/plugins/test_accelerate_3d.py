"""MultiDCAccelerator on spawned gloo ranks (torchrun-style environment): parallel layouts (pipeline / FSDP2 shards /
tensor parallel, across 2 sites) against one-process training, and save_state / load_state through multidc's
checkpoints (S3 on a real SeaweedFS server, file://, local directories), resumed on another layout.

Layout cases run in one 4-rank spawn: an ordinary Accelerate loop where ``accelerator.pipeline_step`` replaces
forward + backward. Tolerance (fp32, 3 steps): rtol 1e-4, atol 2e-5 on losses (mean over data-parallel replicas),
global gradient norms and every weight; the same for resumed runs against the unbroken ones.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from multidc.hierarchical.tools.seaweed import weed_binary
from tests._resources import require_module, require_weed

require_module("accelerate", "accelerate")

from multidc.hierarchical.tools.ranks import run_ranks  # noqa: E402
from tests._tiny_models import EVAL_ROWS, TinyGPT, _optimizer, assert_parity, batch, loss_fn  # noqa: E402
from tests.plugins._accelerate_ckpt import resume_runs, save_runs  # noqa: E402

pytestmark = pytest.mark.timeout(240)
STEPS, GLOBAL_BATCH, CLIP = 3, 8, 0.5
WAN_ENV = {"MULTIDC_WAN_CHUNK_MB": "0.001", "MULTIDC_WAN_STREAMS": "2"}
CASES = {
    # sizes as plugin arguments; dp_shard inferred (2)
    "pp2xdp_shard2": dict(plugin=dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=2), dp=2),
    # model and optimizer prepared in separate calls: the optimizer must train the parallelized parameters
    "pp2xdp_shard2_model_then_optimizer": dict(
        plugin=dict(pipeline_parallel_size=2, pipeline_schedule="1f1b", microbatches=2), dp=2, separate=True,
    ),
    # sizes from the environment, as under `accelerate launch`; the site count from one MULTIDC_SITE name per node
    "sites2xdp_shard2": dict(env={"MULTIDC_DP_SHARD": "2", **WAN_ENV}, sites=["east", "east", "west", "west"], dp=4),
    "sites2xtp2": dict(env={"MULTIDC_NUM_SITES": "2", "MULTIDC_TP_SIZE": "2", **WAN_ENV},
                       plugin=dict(tensor_parallel="transformer"), dp=2),
}
ERROR_CASES = {
    "pp3_on_4_ranks": dict(env={"MULTIDC_PP_SIZE": "3"}),
    "pp2_without_blocks": dict(plugin=dict(pipeline_parallel_size=2), no_blocks=True, dp=2),
}


def reference(dp: int) -> dict:
    """One process, plain PyTorch, global batches; the LR scheduler steps once per data-parallel replica per
    optimizer step, as Accelerate's prepared scheduler does without split_batches."""
    torch.manual_seed(0)
    model = TinyGPT(2)
    opt, sched = _optimizer(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, GLOBAL_BATCH)
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        for _ in range(dp):
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = batch(99, GLOBAL_BATCH)
    with torch.no_grad():
        eval_loss = loss_fn(model(x[:EVAL_ROWS]), y[:EVAL_ROWS]).item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "eval_loss": eval_loss, "lr": sched.get_last_lr()}


def _train(accelerator, case: dict) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from multidc.hierarchical.parallel import data_parallel_coordinate

    torch.manual_seed(0)
    model = TinyGPT(2)
    opt, sched = _optimizer(model.parameters())
    x, y = zip(*(batch(step, GLOBAL_BATCH) for step in range(STEPS)))
    loader = DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=GLOBAL_BATCH // case["dp"])
    blocks = None if case.get("no_blocks") else model.blocks()
    if case.get("separate"):
        model = accelerator.prepare(model, blocks=blocks)
        opt, loader, sched = accelerator.prepare(opt, loader, sched)
    else:
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched, blocks=blocks)
    out = {"losses": [], "norms": [], "wan_per_step": [], "first_rows": None}
    for x, y in loader:
        out["first_rows"] = x if out["first_rows"] is None else out["first_rows"]
        out["losses"].append(accelerator.pipeline_step(model, x, y, loss_fn).item())
        out["norms"].append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        out["wan_per_step"].append(accelerator.wan_metrics().get("wan/bytes_sent"))
    x, y = batch(99, GLOBAL_BATCH)
    out["eval_loss"] = accelerator.pipeline_eval_step(model, x[:EVAL_ROWS], y[:EVAL_ROWS], loss_fn).item()
    out["params"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for n, p in model.named_parameters()}
    out["dp_rank"] = data_parallel_coordinate(accelerator.device_mesh)[0]
    out["mesh"] = (accelerator.device_mesh.mesh_dim_names, tuple(accelerator.device_mesh.shape))
    out["lr"] = sched.get_last_lr()
    if accelerator.topology is not None:  # after the compared state: a no_sync micro-step must not touch the WAN
        before = accelerator.topology.wan_stats.snapshot()["bytes_sent"]
        with accelerator.no_sync(model):
            accelerator.pipeline_step(model, x, y, loss_fn)
        out["no_sync_bytes"] = accelerator.topology.wan_stats.snapshot()["bytes_sent"] - before
    return out


def _run_case(case: dict, rank: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from multidc.plugins import MultiDCAccelerator, MultiDCPlugin

    env = {**case.get("env", {}), **({"MULTIDC_SITE": case["sites"][rank]} if "sites" in case else {})}
    os.environ.update(env)
    accelerator = None
    try:
        accelerator = MultiDCAccelerator(multidc_plugin=MultiDCPlugin(**case.get("plugin", {})))
        return _train(accelerator, case)
    except ValueError as exc:
        return {"error": str(exc)}
    finally:
        for key in env:
            del os.environ[key]
        if accelerator is not None and accelerator.topology is not None:
            accelerator.topology.close()
        AcceleratorState._reset_state(reset_partial_state=True)  # next case: a fresh Accelerator, same group
        GradientState._reset_state()


def _four_ranks(rank, world, checkpoint_args):
    """Every 4-rank part of this file in one spawn (starting ranks is the slow part)."""
    out = {name: _run_case(case, rank) for name, case in {**CASES, **ERROR_CASES}.items()}
    out["saved"] = save_runs(rank, world, *checkpoint_args) if checkpoint_args else None
    return out


def _launch_env(world: int) -> list[dict]:
    return [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
            for r in range(world)]


@pytest.fixture(scope="module")
def spawned(request, tmp_path_factory):
    """The 4-rank spawn; its checkpoint part (S3 on SeaweedFS, file://) only when a SeaweedFS server can run."""
    server, checkpoint_args = None, None
    if weed_binary() is not None:
        server = request.getfixturevalue("s3_server")
        url = f"{server.make_bucket(f'acc-{uuid.uuid4().hex[:10]}')}/run"
        tmp = tmp_path_factory.mktemp("accelerate_ckpt")
        tag = uuid.uuid4().hex[:10]
        for site in ("0", "1"):  # region-local: a bucket per site (on one server here)
            server.make_bucket(f"accr-{tag}-{site}")
        checkpoint_args = (url, server.storage_options(), f"file://{tmp}/pp", str(tmp), f"s3://accr-{tag}-{{site}}/run")
    save_args = checkpoint_args and (*checkpoint_args[:3], checkpoint_args[4])
    per_rank = run_ranks(_four_ranks, 4, save_args, env=_launch_env(4), timeout=240)
    return per_rank, checkpoint_args


@pytest.fixture(scope="module")
def results(spawned):
    per_rank, _ = spawned
    return {name: [ranks[name] for ranks in per_rank] for name in {**CASES, **ERROR_CASES}}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_trains_like_one_process(results, name):
    ranks = results[name]
    assert all("error" not in r for r in ranks), ranks[0].get("error")
    ref = reference(CASES[name]["dp"])
    assert_parity(ranks, ref)
    for r in ranks:
        assert r["lr"] == pytest.approx(ref["lr"], rel=1e-6), "the scheduler must step once per replica"


def test_mesh_is_exposed_with_the_layout_sizes(results):
    axes = ("site", "pp", "dp_replicate", "dp_shard", "tp")
    assert results["pp2xdp_shard2"][0]["mesh"] == (axes, (1, 2, 1, 2, 1))
    assert results["sites2xdp_shard2"][0]["mesh"] == (axes, (2, 1, 1, 2, 1))
    assert results["sites2xtp2"][0]["mesh"] == (axes, (2, 1, 1, 1, 2))


@pytest.mark.parametrize("name", list(CASES))
def test_batches_follow_the_data_parallel_coordinate_not_the_rank(results, name):
    by_replica: dict[int, torch.Tensor] = {}
    for r in results[name]:
        first = by_replica.setdefault(r["dp_rank"], r["first_rows"])
        assert torch.equal(first, r["first_rows"]), "TP/PP peers of one replica must get the same batch"
    assert len(by_replica) == CASES[name]["dp"]
    rows = GLOBAL_BATCH // CASES[name]["dp"]
    x, _ = batch(0, GLOBAL_BATCH)
    for index, first in by_replica.items():
        assert torch.equal(first, x[index * rows : (index + 1) * rows])


@pytest.mark.parametrize("name", ["sites2xdp_shard2", "sites2xtp2"])
def test_replicas_cross_sites_through_the_wan_path_and_no_sync_sends_nothing(results, name):
    for r in results[name]:
        assert all(b and b > 0 for b in r["wan_per_step"]), r["wan_per_step"]
        assert r["no_sync_bytes"] == 0


@pytest.mark.parametrize("name,words", [
    ("pp3_on_4_ranks", ["pipeline_parallel_size=3", "does not divide 4"]),
    ("pp2_without_blocks", ["pipeline_parallel_size=2 needs the model's ordered blocks"]),
])
def test_bad_layouts_fail_on_every_rank_with_a_clear_error(results, name, words):
    for r in results[name]:
        assert "error" in r, f"{name} must fail"
        for word in words:
            assert word in r["error"], r["error"]


@pytest.mark.parametrize("kwargs,env,message", [
    (dict(tensor_parallel="megatron"), {}, "tensor_parallel='megatron'"),
    (dict(pipeline_schedule="1f1b"), {}, "need pipeline_parallel_size"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="zigzag"), {}, "schedule='zigzag' is not supported"),
    (dict(pipeline_parallel_size=2, microbatches=0), {}, "microbatches=0 must be a positive int"),
    (dict(dp_shard=2, site="us-east"), {}, "site='us-east' with a parallel layout"),
    (dict(), {"MULTIDC_PP_SIZE": "two"}, "pipeline_parallel_size='two' (from MULTIDC_PP_SIZE)"),
    (dict(tensor_parallel_size=0), {}, "tensor_parallel_size=0"),
])
def test_plugin_rejects_bad_layout_settings(monkeypatch, kwargs, env, message):
    from multidc.plugins import MultiDCPlugin

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as info:
        MultiDCPlugin(**kwargs)
    assert message in str(info.value)


def test_plugin_layout_is_plain_data_parallel_unless_a_size_is_given(monkeypatch):
    from multidc.plugins import MultiDCPlugin

    assert MultiDCPlugin(num_sites=2).layout is None
    monkeypatch.setenv("MULTIDC_PP_SIZE", "2")
    monkeypatch.setenv("MULTIDC_PP_MICROBATCHES", "4")
    plugin = MultiDCPlugin(num_sites=2)
    assert plugin.layout.resolve(8).sizes["dp_shard"] == 2 and plugin.layout.num_sites == 2
    assert plugin.pipeline.microbatches == 4 and plugin.pipeline.schedule == "1f1b"


# ------------------------------------------------------------------------------------ save_state / load_state
@pytest.fixture(scope="module")
def checkpoints(spawned):
    """4 ranks trained and saved (DDP over 2 sites -> S3; pp 2 x dp_shard 2 -> file://); 2 ranks resume both."""
    per_rank, checkpoint_args = spawned
    if checkpoint_args is None:  # spawned found no SeaweedFS binary: skip naming it (fail under make test)
        require_weed()
    resumed = run_ranks(resume_runs, 2, *checkpoint_args, env=_launch_env(2), timeout=200)
    return [ranks["saved"] for ranks in per_rank], resumed


def _assert_close_params(ranks: list[dict], reference: dict) -> None:
    merged = {}
    for r in ranks:
        merged.update(r["params"])
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-4, atol=2e-5, msg=name)


def test_s3_checkpoint_from_4_ranks_2_sites_resumes_on_2_ranks_1_site_like_the_unbroken_run(checkpoints):
    saved, resumed = checkpoints
    unbroken = saved[0]["ddp"]
    assert [r["ddp"]["committed"] for r in saved] == [[4]] * 4  # the async save, awaited
    for rank, r in enumerate(resumed):
        run = r["ddp"]
        assert run["info"] == (4, 4), "load_state(url) must pick the newest committed checkpoint (step 4)"
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(unbroken["losses"][4:]),
                                   rtol=1e-4, atol=2e-5)
        _assert_close_params([run], saved[0]["ddp"]["params"])
        assert torch.equal(run["draw"], saved[rank]["ddp"]["draws"][4]), "RNG streams of saved rank r % 4"
        assert run["iteration"] == 5 and run["lr"] == pytest.approx([0.2 / 7])


def test_region_local_save_state_from_the_environment_resumes_from_this_sites_region(checkpoints):
    """The resumed run above trained on from the region-local load (its model zeroed before): the same losses,
    weights and RNG streams as the unbroken run."""
    saved, resumed = checkpoints
    assert saved[0]["ddp"]["saved"][-1].endswith("/run/step_0000000004") and "accr-" in saved[0]["ddp"]["saved"][-1]
    for r in resumed:
        step, url = r["regional"]
        assert step == 4 and url.endswith("-0/run/step_0000000004"), url  # this site's region


def test_load_state_with_a_step_loads_that_checkpoint(checkpoints):
    _, resumed = checkpoints
    assert [r["older"] for r in resumed] == [(2, 3)] * 2


def test_pipeline_checkpoint_resumes_in_plain_data_parallel_like_the_unbroken_run(checkpoints):
    saved, resumed = checkpoints
    for r in resumed:
        assert r["pp"]["info"] == (2, 4)
        torch.testing.assert_close(torch.tensor(r["pp"]["losses"]), torch.tensor(saved[0]["pp"]["losses"][2:]),
                                   rtol=1e-4, atol=2e-5)
    reference = {}
    for r in saved:  # each pipeline rank holds its stage's parameters
        reference.update(r["pp"]["params"])
    _assert_close_params([resumed[0]["pp"]], reference)


def test_local_directories_keep_accelerates_format_unless_opted_in(checkpoints):
    _, resumed = checkpoints
    local = resumed[0]["local"]
    assert "model.safetensors" in local["plain_files"] and not any(f.startswith("step_") for f in local["plain_files"])
    assert local["sharded"] == [0] and local["where"].endswith("/step_0000000000")
    assert local["found"] == 0, "load_state of a local multidc checkpoint root goes through multidc"


def test_single_process_save_state_to_a_file_url_round_trips(tmp_path):
    """``python train.py`` (no launcher, no process group): save_state / load_state through multidc still work."""
    from tests.plugins._accelerate_ckpt import fresh_accelerator, prepared, train

    url = f"file://{tmp_path}/run"
    with fresh_accelerator(step_scheduler_with_optimizer=False) as acc:
        unbroken = train(acc, *prepared(acc, range(3)), save_at={1: (url, True)})
    with fresh_accelerator(step_scheduler_with_optimizer=False) as acc:
        model, opt, loader, sched = prepared(acc, range(1, 3))
        assert acc.load_state(url).step == 1
        resumed = train(acc, model, opt, loader, sched, first_step=1)
    assert unbroken["committed"] == [1]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(unbroken["losses"][1:]), rtol=0, atol=0)
    _assert_close_params([resumed], unbroken["params"])
