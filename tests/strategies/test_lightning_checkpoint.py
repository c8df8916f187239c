"""Lightning checkpoints through multidc's Checkpointer with both multidc strategies.

Trainer runs (_lightning_ckpt_script.py, CPU, gloo) save to a real SeaweedFS S3 server (hierarchical_ddp,
4 ranks / 2 sites, async, credentials from the AWS environment) and to a local path (parallel_3d, dp_shard 2 x
pp 2), then resume with ``ckpt_path="last"`` on another layout (2 ranks / 1 site; dp_shard 2 without pipeline)
past a planted half-written checkpoint. Region-local: hierarchical_ddp and diloco (2 sites x 1 rank, one server per
site) with a ``{site}`` dirpath, diloco resumed with a mapping site -> URL as dirpath. Losses and weights are
compared with one process trained in this test on the same global batches (rtol 1e-5 / 1e-4), diloco's with its
unbroken run; RNG streams with the ones saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import uuid

import pytest
import torch

from tests import _launch
from tests._resources import require_module

require_module("lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

import tests.strategies._lightning_ckpt_script as script  # noqa: E402
from multidc.hierarchical.tools.processes import ProcessTree  # noqa: E402
from multidc.plugins import Checkpointer, CheckpointSaveError, ObjectStore, list_checkpoints  # noqa: E402
from multidc.plugins.checkpoint.format import decode_any, decode_commit  # noqa: E402
from multidc.strategies import HierarchicalDDPStrategy, Parallel3DStrategy  # noqa: E402
from multidc.strategies._checkpointing import LightningCheckpoints, locate  # noqa: E402
from tests._tiny_models import loss_fn  # noqa: E402
from tests.conftest import AUTH_KEYS, READONLY_KEYS  # noqa: E402

pytestmark = pytest.mark.timeout(480)  # the shared fixture: 3 Trainer launches twice, at once
_LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def _run_at_once(runs: dict[str, tuple], timeout: float = 240) -> dict[str, dict]:
    """Run the script (it launches its own ranks) once for each of ``runs`` (``{name: (out dir, args, env)}``), all
    at once; ``{name: its output and every rank's report and weights}``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIDC_", "AWS_")) and k not in _LAUNCH}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every run
        trees = {}
        for name, (out_dir, args, env) in runs.items():
            out_dir.mkdir(parents=True, exist_ok=True)
            trees[name] = stack.enter_context(ProcessTree(
                [sys.executable, script.__file__, *args, "--out", str(out_dir)],
                env={**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}))
        ended = {name: _launch.finish(tree, timeout) for name, tree in trees.items()}
    return {name: _report(runs[name][0], *ended[name]) for name in runs}


def _report(out_dir, code: int, log: str) -> dict:
    run = {"log": log, "code": code, "ranks": [], "weights": {}, "exits": {}, "rank_weights": []}
    for rank in range(8):
        if (out_dir / f"exit_rank{rank}.json").exists():
            run["exits"][rank] = json.loads((out_dir / f"exit_rank{rank}.json").read_text())
        if (out_dir / f"rank{rank}.json").exists():
            run["ranks"].append(json.loads((out_dir / f"rank{rank}.json").read_text()))
            run["rank_weights"].append(torch.load(out_dir / f"weights_rank{rank}.pt"))
            run["weights"].update(run["rank_weights"][-1])
    return run


def _reference(module_cls, data, rows: int, steps: int) -> tuple[list[float], dict]:
    """One process, same seed, model, optimizer and schedule; global batch t is what Lightning's
    DistributedSampler(shuffle=True, seed=0) hands the replicas together: block t of randperm(seed=epoch)."""
    pl.seed_everything(0)
    module = module_cls()
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    per_epoch, losses = len(data) // rows, []
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        x, y = data[order[k * rows : (k + 1) * rows]]
        if module_cls is script.Regressor:
            loss = torch.nn.functional.mse_loss(module.net(x), y)
        else:
            loss = loss_fn(module.model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in module.named_parameters()}


def _plant_half_written(store: ObjectStore, *names: str) -> None:
    """What a crash mid-save leaves: shard data, no COMMIT.json."""
    for name in names:
        store.put(f"{name}/data/rank00000.distcp", b"half-written")


def _assert_parity(run: dict, first_step: int, losses: list[float], params: dict, rtol: float, atol: float):
    for rank in run["ranks"]:
        got = [rank["losses"][str(s)] for s in range(first_step, len(losses) + 1)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses[first_step - 1 :]), rtol=rtol, atol=atol)
    assert set(run["weights"]) == set(params)
    for name, value in run["weights"].items():
        torch.testing.assert_close(value, params[name], rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def runs(s3_server, s3_auth_server, tmp_path_factory):
    """The runs of both strategies, the first runs at once, then the resumed ones at once (each launch's first
    process imports Lightning alone before it starts the others, which leaves a core idle):

    hierarchical_ddp: 4 ranks / 2 sites, 8 steps, async saves every 4 steps to S3; then "last" on 2 ranks / 1 site to
    step 12. parallel_3d: dp_shard 2 x pp 2 on 4 ranks, 2 steps, default_root_dir local; then "last" on 2 ranks
    (dp_shard 2, no pp). Half-written checkpoints are planted before each resume. regional: hierarchical_ddp on
    2 sites x 1 rank with a ``{site}`` dirpath over two S3 servers (one per site, per-site credentials from
    MULTIDC_CKPT_STORAGE_OPTIONS, no AWS environment), 8 steps; then "last" on the same layout to step 12, past a
    commit record planted in one region only. diloco: the same sites and options, another pair of buckets, 12 steps
    with ``checkpoint_replicas=1`` keeping every checkpoint; then from the step-8 one (a ``{site}`` path) to step 12
    again, with ``ModelCheckpoint(dirpath=)`` a mapping site -> URL over the same buckets.
    """
    bucket = s3_auth_server.make_bucket("lightning-ckpt")
    root = f"{bucket}/run"
    env = {"AWS_ENDPOINT_URL": s3_auth_server.endpoint, "AWS_ACCESS_KEY_ID": AUTH_KEYS[0],
           "AWS_SECRET_ACCESS_KEY": AUTH_KEYS[1], "AWS_DEFAULT_REGION": "us-east-1"}
    tmp, tmp_3d = tmp_path_factory.mktemp("ddp"), tmp_path_factory.mktemp("p3d")
    servers = {"0": s3_server, "1": s3_auth_server}
    tag = uuid.uuid4().hex[:8]
    template = f"s3://lreg-{{site}}-{tag}/run"
    for site, server in servers.items():
        server.make_bucket(f"lreg-{site}-{tag}")
    regional_env = {"MULTIDC_NUM_SITES": "2", "MULTIDC_CKPT_STORAGE_OPTIONS": json.dumps(
        {site: server.storage_options() for site, server in servers.items()})}
    regional = ["--strategy", "hierarchical_ddp", "--root", template, "--every", "4", "--devices", "2"]
    for site, server in servers.items():
        server.make_bucket(f"ldil-{site}-{tag}")
    diloco_template = f"s3://ldil-{{site}}-{tag}/run"
    diloco = ["--strategy", "diloco", "--every", "4", "--devices", "2", "--max-steps", "12", "--top-k", "-1",
              "--replicas", "1"]
    common = ["--strategy", "hierarchical_ddp", "--root", root, "--every", "4"]
    common_3d = ["--strategy", "parallel_3d", "--root", str(tmp_3d / "run"), "--every", "2"]
    first = _run_at_once({
        "ddp": (tmp / "first", [*common, "--devices", "4", "--max-steps", "8", "--async"],
                {**env, "MULTIDC_NUM_SITES": "2"}),
        "3d": (tmp_3d / "first", [*common_3d, "--devices", "4", "--pp", "2", "--max-steps", "2"], {}),
        "regional": (tmp / "regional-first", [*regional, "--max-steps", "8", "--async"], regional_env),
        "diloco": (tmp / "diloco-first", [*diloco, "--root", diloco_template], regional_env)})
    for name, run in first.items():
        assert run["code"] == 0, f"{name}:\n{run['log'][-6000:]}"
    fs = s3_auth_server.filesystem()
    listing = sorted(p.split("/ckpts/", 1)[1] for p in fs.find(f"{root}/ckpts"))
    store = ObjectStore(f"{root}/ckpts", storage_options=s3_auth_server.storage_options())
    commit = decode_commit(store.get("last.ckpt/step_0000000008/COMMIT.json"), "last.ckpt")
    _plant_half_written(store, "last.ckpt/step_0000000012", "epoch=2-step=12.ckpt/step_0000000012")
    _plant_half_written(ObjectStore(tmp_3d / "run" / "checkpoints"), "epoch=9-step=99.ckpt/step_0000000099")
    regions = {site: ObjectStore(template.replace("{site}", site) + "/ckpts", storage_options=server.storage_options())
               for site, server in servers.items()}
    regional_listing = {site: sorted(store.fs.find(store.path(""))) for site, store in regions.items()}
    record = regions["0"].get("last.ckpt/step_0000000008/COMMIT.json")
    regions["0"].put("last.ckpt/step_0000000016/COMMIT.json", record)  # committed in region 0 only: not "last"
    diloco_regions = {site: ObjectStore(diloco_template.replace("{site}", site) + "/ckpts",
                                        storage_options=server.storage_options()) for site, server in servers.items()}
    diloco_record = decode_any(diloco_regions["1"].get("epoch=1-step=8.ckpt/step_0000000008/COMMIT.json"), "step 8")
    mapping = json.dumps({site: diloco_template.replace("{site}", site) for site in servers})
    resumed = _run_at_once({
        "ddp": (tmp / "resumed", [*common, "--devices", "2", "--max-steps", "12", "--ckpt-path", "last"], env),
        "3d": (tmp_3d / "resumed", [*common_3d, "--devices", "2", "--max-steps", "4", "--ckpt-path", "last"], {}),
        "regional": (tmp / "regional-resumed", [*regional, "--max-steps", "12", "--ckpt-path", "last"], regional_env),
        "diloco": (tmp / "diloco-resumed", [*diloco, "--root", mapping, "--ckpt-path",
                                            f"{diloco_template}/ckpts/epoch=1-step=8.ckpt"], regional_env)})
    for name, run in resumed.items():
        assert run["code"] == 0, f"{name}:\n{run['log'][-6000:]}"
    reference = _reference(script.Regressor, script.regressor_data(), script.REGRESSOR_ROWS, 12)
    return {"ddp": {"first": first["ddp"], "resumed": resumed["ddp"], "listing": listing, "commit": commit,
                    "reference": reference},
            "regional": {"first": first["regional"], "resumed": resumed["regional"], "reference": reference,
                         "template": template, "listing": regional_listing,
                         "after": {site: sorted(store.fs.find(store.path(""))) for site, store in regions.items()},
                         "roots": {site: store.path("") for site, store in regions.items()}},
            "diloco": {"first": first["diloco"], "resumed": resumed["diloco"], "record": diloco_record,
                       "after": {site: sorted(store.list_files("")) for site, store in diloco_regions.items()}},
            "3d": {"first": first["3d"], "resumed": resumed["3d"], "root": tmp_3d / "run",
                   "reference": _reference(script.GPT, script.gpt_data(), script.GPT_ROWS, 4)}}


# ----------------------------------------------------------------------------- hierarchical_ddp on S3
@pytest.fixture(scope="module")
def ddp_runs(runs):
    return runs["ddp"]


def test_ddp_resumes_last_from_s3_on_another_layout_like_an_unbroken_run(ddp_runs):
    losses, params = ddp_runs["reference"]
    first, resumed = ddp_runs["first"], ddp_runs["resumed"]
    assert [r["world_size"] for r in first["ranks"]] == [4] * 4 and len(resumed["ranks"]) == 2
    for rank in first["ranks"]:
        got = [rank["losses"][str(s)] for s in range(1, 9)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses[:8]), rtol=1e-5, atol=1e-6)
    _assert_parity(resumed, 9, losses, params, rtol=1e-5, atol=1e-6)  # model, AdamW state, LR schedule
    for rank in resumed["ranks"]:
        assert rank["global_step"] == 12 and rank["epoch"] == 3  # loop state
        assert rank["lr"] == pytest.approx(0.02 / (1 + 0.1 * 12))


def test_last_skips_half_written_checkpoints_and_rng_resumes_from_the_saved_rank(ddp_runs):
    first, resumed = ddp_runs["first"], ddp_runs["resumed"]
    for rank, report in enumerate(resumed["ranks"]):
        # last.ckpt and epoch=1-step=8.ckpt hold step 8, committed within S3's 1 s timestamp resolution
        assert report["ckpt_path"].endswith("/step_0000000008/COMMIT.json"), report["ckpt_path"]
        assert report["loaded_rng"] == first["ranks"][rank]["saved_rng"]["8"]  # rank r <- saved rank r % 4
    assert resumed["ranks"][0]["loaded_rng"] != resumed["ranks"][1]["loaded_rng"]


def test_model_checkpoint_naming_last_and_top_k_removal_on_s3(ddp_runs):
    files = ddp_runs["listing"]
    committed = sorted(f for f in files if f.endswith("COMMIT.json"))
    # save_top_k=1 removed epoch=0-step=4 once epoch=1-step=8 committed; last.ckpt kept only its newest step
    assert committed == ["epoch=1-step=8.ckpt/step_0000000008/COMMIT.json",
                         "last.ckpt/step_0000000008/COMMIT.json"]
    assert sorted(f for f in files if f.startswith("last.ckpt/")) == [
        "last.ckpt/step_0000000008/COMMIT.json", *(f"last.ckpt/step_0000000008/data/rank0000{r}.distcp"
                                                   for r in range(4))]


def test_every_rank_writes_a_share_and_one_copy_of_the_replicated_state_is_stored(ddp_runs):
    commit = ddp_runs["commit"]
    writers = set()
    for fqn, meta in commit.metadata.state_dict_metadata.items():
        if not fqn.startswith(("state_dict.", "optimizer_states.")) or not hasattr(meta, "chunks"):
            continue
        assert sum(c.sizes.numel() for c in meta.chunks) == meta.size.numel(), fqn  # one copy, no overlap
        writers |= {commit.locations[idx].file for idx in commit.locations if idx.fqn == fqn}
    assert writers == {f"data/rank0000{r}.distcp" for r in range(4)}


def test_credentials_never_reach_the_output(ddp_runs):
    for run in (ddp_runs["first"], ddp_runs["resumed"]):
        assert AUTH_KEYS[1] not in run["log"]


# ----------------------------------------------------------------------------- hierarchical_ddp, one store per site
@pytest.fixture(scope="module")
def regional_runs(runs):
    return runs["regional"]


def test_site_template_checkpoints_resume_last_committed_in_every_region_like_an_unbroken_run(regional_runs):
    losses, params = regional_runs["reference"]
    first, resumed = regional_runs["first"], regional_runs["resumed"]
    assert [r["world_size"] for r in first["ranks"]] == [2, 2] and len(resumed["ranks"]) == 2
    for rank in first["ranks"]:
        got = [rank["losses"][str(s)] for s in range(1, 9)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses[:8]), rtol=1e-5, atol=1e-6)
    _assert_parity(resumed, 9, losses, params, rtol=1e-5, atol=1e-6)
    for rank, report in enumerate(resumed["ranks"]):
        # the newest step committed in every region (step 16's record is in region 0 only), as the template
        assert report["ckpt_path"].startswith(f"{regional_runs['template']}/ckpts/"), report["ckpt_path"]
        assert report["ckpt_path"].endswith("/step_0000000008/COMMIT.json"), report["ckpt_path"]
        assert report["global_step"] == 12 and report["loaded_rng"] == first["ranks"][rank]["saved_rng"]["8"]
    assert "from other regions" not in resumed["log"]  # each site read its own region only (else a warning)


def test_each_region_holds_its_sites_shards_and_top_k_removal_removes_every_regions_part(regional_runs):
    for phase, step, gone in (("listing", 8, 4), ("after", 12, 8)):
        for site, files in regional_runs[phase].items():
            root = regional_runs["roots"][site]
            names = [f[len(root) + 1:] for f in files]
            expected = [f"{name}/step_{step:010d}/{leaf}" for name in (f"epoch={step // 4 - 1}-step={step}.ckpt",
                                                                      "last.ckpt")
                        for leaf in ("COMMIT.json", f"data/rank0000{site}.distcp")]
            assert names == sorted(expected), (phase, site, names)  # epoch=..-step={gone} gone from both
            assert not any(f"step={gone}.ckpt" in n for n in names)


# ----------------------------------------------------------------------------- diloco, one store per site
@pytest.fixture(scope="module")
def diloco_runs(runs):
    return runs["diloco"]


def test_diloco_under_a_site_template_resumes_each_sites_model_like_the_unbroken_run(diloco_runs):
    first, resumed = diloco_runs["first"], diloco_runs["resumed"]
    assert len(first["ranks"]) == len(resumed["ranks"]) == 2
    for rank in (0, 1):  # one site per rank: each resumed its own site's model, optimizer and DiLoCo state
        got = [resumed["ranks"][rank]["losses"][str(s)] for s in range(9, 13)]
        want = [first["ranks"][rank]["losses"][str(s)] for s in range(9, 13)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
        for name, value in resumed["rank_weights"][rank].items():
            torch.testing.assert_close(value, first["rank_weights"][rank][name], rtol=1e-5, atol=1e-6, msg=name)
    # the sites' models differ (the last sync was at step 10): each resumed its own
    assert first["rank_weights"][0]["net.0.weight"].ne(first["rank_weights"][1]["net.0.weight"]).any()
    assert "from other regions" not in resumed["log"]  # each site read its own region only (else a warning)


def test_diloco_site_models_are_in_their_own_region_with_a_copy_in_the_other(diloco_runs):
    parts = diloco_runs["record"].parts
    for region, other in (("0", "1"), ("1", "0")):
        keys = set(parts[region].metadata.state_dict_metadata)
        # its own site's model and, with checkpoint_replicas=1, a copy of the other site's (its own state)
        assert {k.split(".", 1)[0] for k in keys if k.startswith("site_")} == {"site_0", "site_1"}, region
        assert f"data/rank0000{region}.distcp" in parts[region].files, region
        assert f"data/copy-rank0000{other}.distcp" in parts[region].files, region


def test_a_mapping_dirpath_saves_into_every_region_and_versions_a_name_that_exists_there(diloco_runs):
    for site, files in diloco_runs["after"].items():
        # step 12's names existed in the regions (the first run's): ModelCheckpoint asked through the mapping, and
        # the resumed run saved them as -v1, in both regions, its own shards and the other site's copy
        for name in ("epoch=2-step=12-v1.ckpt", "last-v1.ckpt"):
            other = 1 - int(site)
            assert {f for f in files if f.startswith(f"{name}/")} == {
                f"{name}/step_0000000012/{leaf}" for leaf in ("COMMIT.json", f"data/rank0000{site}.distcp",
                                                              f"data/copy-rank0000{other}.distcp")}, (site, files)


@pytest.fixture(scope="module")
def parallel_3d_runs(runs):
    return runs["3d"]


def test_parallel_3d_pipeline_checkpoint_resumes_without_pipeline_like_an_unbroken_run(parallel_3d_runs):
    losses, params = parallel_3d_runs["reference"]
    first, resumed = parallel_3d_runs["first"], parallel_3d_runs["resumed"]
    for rank in first["ranks"]:
        got = [rank["losses"][str(s)] for s in (1, 2)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses[:2]), rtol=1e-4, atol=2e-5)
    _assert_parity(resumed, 3, losses, params, rtol=1e-4, atol=2e-5)
    for report in resumed["ranks"]:
        assert report["ckpt_path"].endswith("/checkpoints/epoch=0-step=2.ckpt/step_0000000002/COMMIT.json")
        assert report["global_step"] == 4
    committed = sorted(str(p.relative_to(parallel_3d_runs["root"])) for p in
                       parallel_3d_runs["root"].rglob("COMMIT.json"))
    assert committed == ["checkpoints/epoch=1-step=4.ckpt/step_0000000004/COMMIT.json"]


def test_every_rank_ends_its_process_groups_before_interpreter_exit(ddp_runs, parallel_3d_runs):
    """The scripts never call destroy_process_group (as most Lightning scripts): the strategies end the groups at
    exit, else gloo aborts a rank now and then in interpreter finalization (SIGABRT, pytorch/pytorch#179291)."""
    runs = {"ddp first": (ddp_runs["first"], 4), "ddp resumed": (ddp_runs["resumed"], 2),
            "3d first": (parallel_3d_runs["first"], 4), "3d resumed": (parallel_3d_runs["resumed"], 2)}
    for name, (run, ranks) in runs.items():
        assert sorted(run["exits"]) == list(range(ranks)), name
        assert not any(e["groups_alive_at_exit"] for e in run["exits"].values()), name
        if name.startswith("ddp"):  # every gloo worker ended too (DTensor specs that torch keeps hold 3D's meshes)
            assert all(e["gloo_threads_at_exit"] == 0 for e in run["exits"].values()), (name, run["exits"])


# ----------------------------------------------------------------------------- in-process
def _lightning_dict(step: int, value: float) -> dict:
    return {"state_dict": {"w": torch.full((64, 4), value)}, "optimizer_states": [], "global_step": step,
            "epoch": 0, "loops": {"fit_loop": {}}}


def test_last_is_the_newest_committed_checkpoint_then_the_highest_step(tmp_path):
    for name, step in (("a.ckpt", 3), ("b.ckpt", 5)):
        Checkpointer(tmp_path / name).save({"x": torch.ones(2)}, step=step)
    _plant_half_written(ObjectStore(tmp_path), "c.ckpt/step_0000000009")
    commit = {n: tmp_path / n / f"step_000000000{s}" / "COMMIT.json" for n, s in (("a.ckpt", 3), ("b.ckpt", 5))}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HierarchicalDDPStrategy(), logger=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path)])

    def last():
        return trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                                model_connected=False)

    os.utime(commit["a.ckpt"], (1000, 1000))
    os.utime(commit["b.ckpt"], (2000, 2000))
    assert last() == str(commit["b.ckpt"])
    os.utime(commit["a.ckpt"], (3000, 3000))  # a run rewound to step 3 committed after step 5: newest wins
    assert last() == str(commit["a.ckpt"])
    os.utime(commit["b.ckpt"], (3000, 3000))
    assert last() == str(commit["b.ckpt"])
    ddp = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False,
                     callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    with pytest.warns(UserWarning, match="no last checkpoint"):  # other strategies: Lightning's rule, unchanged
        assert ddp._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False) is None


def test_async_upload_error_surfaces_at_close_and_keeps_the_previous_checkpoint(s3_auth_server):
    root = s3_auth_server.make_bucket("lightning-async") + "/ckpts"
    writer = LightningCheckpoints(storage_options=s3_auth_server.storage_options())
    writer.save(_lightning_dict(2, 1.0), f"{root}/previous.ckpt")
    readonly = s3_auth_server.storage_options(key=READONLY_KEYS[0], secret=READONLY_KEYS[1])
    failing = LightningCheckpoints(async_save=True, storage_options=readonly)
    failing.save(_lightning_dict(4, 2.0), f"{root}/next.ckpt")  # returns after the snapshot
    failing.remove(f"{root}/previous.ckpt")  # top-k removal waits for the pending save to commit
    with pytest.raises(CheckpointSaveError, match="lightning-async") as info:
        failing.close()
    assert READONLY_KEYS[1] not in str(info.value)
    assert writer.find_last(root) == {f"{root}/previous.ckpt/step_0000000002/COMMIT.json"}
    writer.close()


def test_deferred_removal_runs_once_the_next_checkpoint_committed(tmp_path):
    writer = LightningCheckpoints(async_save=True)
    writer.save(_lightning_dict(2, 1.0), tmp_path / "old.ckpt")
    writer.save(_lightning_dict(4, 2.0), tmp_path / "new.ckpt")  # waits for old's upload first
    writer.remove(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt" / "step_0000000002" / "COMMIT.json").exists()  # new one still uploading
    writer.close()
    assert not (tmp_path / "old.ckpt").exists()
    assert writer.find_last(tmp_path) == {f"{tmp_path}/new.ckpt/step_0000000004/COMMIT.json"}


@pytest.mark.parametrize(("path", "expected"), [
    ("s3://b/run/last.ckpt", ("s3://b/run/last.ckpt", "latest")),
    ("s3://b/run/last.ckpt/step_0000000008", ("s3://b/run/last.ckpt", "step_0000000008")),
    ("/x/last.ckpt/step_0000000008/COMMIT.json", ("/x/last.ckpt", "step_0000000008")),
    ("/x/epoch=0-step=4.ckpt/", ("/x/epoch=0-step=4.ckpt", "latest")),
])
def test_paths_map_to_a_checkpointer_root_and_a_checkpoint(path, expected):
    assert locate(path) == expected


def test_a_mapping_path_maps_to_one_root_per_site_naming_the_same_checkpoint():
    from multidc.strategies._checkpoint_paths import path_key, url_of

    root, which = locate({1: "s3://b1/run/last.ckpt/step_0000000008/", "0": "s3://b0/run/last.ckpt/step_0000000008"})
    assert which == "step_0000000008"
    assert url_of(root) == {"0": "s3://b0/run/last.ckpt", "1": "s3://b1/run/last.ckpt"}
    assert path_key(url_of(root)) == root  # what the ranks agree on, and back
    assert locate("s3://ckpt-{site}/run/last.ckpt/COMMIT.json") == ("s3://ckpt-{site}/run/last.ckpt", "latest")
    with pytest.raises(ValueError, match="names different checkpoints per site"):
        locate({"0": "s3://b0/last.ckpt/step_0000000008", "1": "s3://b1/last.ckpt/step_0000000004"})


def test_last_under_a_site_template_waits_for_the_strategy_and_other_trainers_keep_lightnings_rule(tmp_path):
    from multidc.plugins._lightning_patches import DeferredLast

    template = str(tmp_path / "ckpt-{site}")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HierarchicalDDPStrategy(), logger=False,
                         callbacks=[ModelCheckpoint(dirpath=template)])
    found = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False)
    assert isinstance(found, DeferredLast) and found.dirs == (template,)  # resolved in resume_start, after set-up
    assert not list(tmp_path.iterdir())  # nothing touched the template as a path
    ddp = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False,
                     callbacks=[ModelCheckpoint(dirpath=template)])
    with pytest.warns(UserWarning, match="no last checkpoint"):
        assert ddp._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False) is None


@pytest.fixture
def one_site(tmp_path, monkeypatch):
    """This process as a job of one rank (a gloo group of one) in one site: its topology."""
    import torch.distributed as dist

    from multidc.hierarchical import Topology

    for name in ("MULTIDC_SITE", "MULTIDC_NUM_SITES", "MULTIDC_CKPT_URL", "MULTIDC_CKPT_STORAGE_OPTIONS",
                 "MULTIDC_CKPT_REPLICAS"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield Topology.build()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("source", "setting"), [("argument", "checkpoint_storage_options['1']"),
                                                 ("environment", "MULTIDC_CKPT_STORAGE_OPTIONS['1']")])
def test_refused_credentials_of_one_region_name_the_setting_the_strategy_took_them_from(
        one_site, s3_server, s3_auth_server, monkeypatch, source, setting):
    from multidc.plugins import ObjectStoreAuthError

    tag = uuid.uuid4().hex[:8]  # one site, a mapping of two regions: rank 0 writes the commit record into both
    path = {"0": s3_server.make_bucket(f"cred0-{tag}") + "/last.ckpt",
            "1": s3_auth_server.make_bucket(f"cred1-{tag}") + "/last.ckpt"}
    options = {"0": s3_server.storage_options(),
               "1": s3_auth_server.storage_options(key=AUTH_KEYS[0], secret="wrong-secret")}
    if source == "environment":
        monkeypatch.setenv("MULTIDC_CKPT_STORAGE_OPTIONS", json.dumps(options))
    writer = LightningCheckpoints(storage_options=options if source == "argument" else None)
    writer.topology = one_site
    try:
        with pytest.raises(ObjectStoreAuthError) as info:
            writer.save(_lightning_dict(2, 1.0), path)
    finally:
        writer.close()
    message = str(info.value)
    assert "region '1'" in message and setting in message, message
    assert "storage_options['1']" not in message.replace(setting, ""), message  # not the Checkpointer's argument
    assert "wrong-secret" not in message


def test_whether_a_regional_name_exists_raises_naming_a_region_that_cannot_be_read(s3_server):
    from multidc.plugins import ObjectStoreError, RetryPolicy
    from multidc.plugins.checkpoint.regions import Regions
    from multidc.strategies._checkpoint_paths import exists_anywhere

    bucket, options = s3_server.make_bucket(f"exists-{uuid.uuid4().hex[:8]}"), s3_server.storage_options()
    unreachable = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
                   "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    regions = Regions({"0": f"{bucket}/ckpts/a.ckpt", "1": "s3://far/ckpts/a.ckpt"}, {"0": options, "1": unreachable},
                      local="0", retry=RetryPolicy(attempts=1))
    # ModelCheckpoint asks before naming a checkpoint: "no" from a region it could not read could reuse a name
    with pytest.raises(ObjectStoreError, match=r"cannot tell whether checkpoint s3://far/ckpts/a.ckpt exists .*"
                                               r"region '1'.*Bring region '1' back"):
        exists_anywhere(regions)
    gone = Regions({"0": f"{bucket}/ckpts/a.ckpt", "1": "s3://no-such-bucket-4d1e/ckpts/a.ckpt"},
                   {"0": options, "1": options}, local="0")
    assert exists_anywhere(gone) is False  # a region whose bucket is gone holds nothing
    gone.stores["0"].put("step_0000000001/COMMIT.json", b"{}")
    assert exists_anywhere(gone) is True


def test_bad_checkpoint_arguments_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="checkpoint_async='yes' must be True or False"):
        HierarchicalDDPStrategy(checkpoint_async="yes")
    with pytest.raises(ValueError, match="checkpoint_storage_options must be a dict"):
        Parallel3DStrategy(checkpoint_storage_options=["endpoint"])
    with pytest.raises(ValueError, match=r"checkpoint_replicas=-1 must be an int >= 0"):
        HierarchicalDDPStrategy(checkpoint_replicas=-1)
    writer = LightningCheckpoints(replicas=1)
    with pytest.raises(ValueError, match=r"checkpoint_replicas=1 .* names one store: put \{site\} in it"):
        writer.save({"state_dict": {}}, "/tmp/one-store/last.ckpt")  # before anything is written
    writer.close()
    with pytest.raises(TypeError, match="checkpoint_storage_options=..., not per save"):
        HierarchicalDDPStrategy().save_checkpoint({}, "/tmp/x.ckpt", storage_options={"anon": True})


def test_a_users_checkpoint_io_brings_back_lightnings_files_and_last_finds_its_commits(tmp_path):
    from multidc.plugins import ObjectStoreCheckpointIO

    strategy = HierarchicalDDPStrategy()
    strategy.checkpoint_io  # noqa: B018 - Lightning's getter (also run at teardown) installs a default CheckpointIO
    assert strategy.multidc_checkpoints is not None
    io = ObjectStoreCheckpointIO()
    for name, step in (("epoch=0-step=4.ckpt", 4), ("last.ckpt", 8)):
        io.save_checkpoint(_lightning_dict(step, float(step)), tmp_path / name)
    _plant_half_written(ObjectStore(tmp_path), "epoch=9-step=99.ckpt")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HierarchicalDDPStrategy(), plugins=[io],
                         logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    assert trainer.strategy.multidc_checkpoints is None
    for commit, stamp in (("epoch=0-step=4.ckpt", 2000), ("last.ckpt", 1000)):
        os.utime(tmp_path / commit / "COMMIT.json", (stamp, stamp))
    found = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, False)
    assert found == f"{tmp_path}/epoch=0-step=4.ckpt/COMMIT.json"
    assert io.load_checkpoint(found)["global_step"] == 4


def test_loading_a_single_file_or_an_uncommitted_path_says_what_is_wrong(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "model.ckpt")
    reader = LightningCheckpoints()
    with pytest.raises(ValueError, match="model.ckpt is a single-file Lightning checkpoint"):
        reader.load(tmp_path / "model.ckpt", module=torch.nn.Linear(2, 2), optimizers=[], fitting=False)
    _plant_half_written(ObjectStore(tmp_path), "half.ckpt/step_0000000004")
    with pytest.raises(FileNotFoundError, match="no committed checkpoint under .*half.ckpt"):
        reader.load(tmp_path / "half.ckpt", module=torch.nn.Linear(2, 2), optimizers=[], fitting=False)
    reader.close()


# ----------------------------------------------------------------------------- overwriting a path
def _upload_part_then_fail(staged, store, name, stop=None):
    """Stands in for ``upload``: part of the shard reaches storage, then the upload fails."""
    store.put(f"{name}/{staged.file}", b"partial shard")
    raise OSError("injected upload failure")


def _stored_value(path) -> float:
    target = {"state_dict": {"w": torch.zeros(64, 4)}}
    Checkpointer(path).load(target)
    return float(target["state_dict"]["w"][0, 0])


@pytest.mark.parametrize("new_step", [8, 4], ids=["same-step", "rewound"])
def test_a_failed_save_over_a_path_leaves_its_previous_checkpoint_loadable(tmp_path, monkeypatch, new_step):
    import multidc.plugins.checkpoint.checkpointer as checkpoint_module

    path = tmp_path / "last.ckpt"
    writer = LightningCheckpoints()
    writer.save(_lightning_dict(8, 1.0), path)
    real_upload = checkpoint_module.upload
    monkeypatch.setattr(checkpoint_module, "upload", _upload_part_then_fail)
    with pytest.raises(CheckpointSaveError, match="injected upload failure"):
        writer.save(_lightning_dict(new_step, 2.0), path)
    assert _stored_value(path) == 1.0
    assert writer.find_last(tmp_path) == {f"{tmp_path}/last.ckpt/step_0000000008/COMMIT.json"}
    monkeypatch.setattr(checkpoint_module, "upload", real_upload)
    writer.save(_lightning_dict(new_step, 3.0), path)  # replaces it: the path holds this one only
    assert _stored_value(path) == 3.0
    assert [c.step for c in list_checkpoints(path)] == [new_step]
    assert sorted(p.name for p in path.iterdir()) == [f"step_000000000{new_step}"]
    assert len(list((path / f"step_000000000{new_step}" / "data").iterdir())) == 1  # no stale shards
    writer.close()


def test_checkpoint_io_overwrite_that_fails_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    import multidc.plugins.checkpoint.checkpointer as checkpoint_module
    from multidc.plugins import ObjectStoreCheckpointIO

    io, path = ObjectStoreCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_lightning_dict(4, 1.0), path)
    real_upload = checkpoint_module.upload  # the IO saves through the Checkpointer
    monkeypatch.setattr(checkpoint_module, "upload", _upload_part_then_fail)
    with pytest.raises(CheckpointSaveError, match="OSError: injected upload failure"):
        io.save_checkpoint(_lightning_dict(8, 2.0), path)
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 4 and float(loaded["state_dict"]["w"][0, 0]) == 1.0
    monkeypatch.setattr(checkpoint_module, "upload", real_upload)
    io.save_checkpoint(_lightning_dict(8, 3.0), path)
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 8 and float(loaded["state_dict"]["w"][0, 0]) == 3.0
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert len(files) == 2 and files[0] == "COMMIT.json" and files[1].startswith("data/rank00000-"), files


def test_checkpoint_io_round_trip_needs_no_numpy(tmp_path, monkeypatch):
    from multidc.plugins import ObjectStoreCheckpointIO

    def unavailable(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")  # what torch raises when NumPy is not installed

    monkeypatch.setattr(torch.Tensor, "numpy", unavailable)
    io = ObjectStoreCheckpointIO()
    io.save_checkpoint(_lightning_dict(4, 1.5), tmp_path / "m.ckpt")
    loaded = io.load_checkpoint(tmp_path / "m.ckpt")
    assert loaded["global_step"] == 4 and float(loaded["state_dict"]["w"][0, 0]) == 1.5


# ----------------------------------------------------------------------------- a peer stops during a save
WAN_TIMEOUT_S = 2.0


def _lightning_save_with_a_stopped_peer(rank, world, root):
    """A 2-site ``hierarchical_ddp`` Trainer in ranks started by torchelastic's rules (the process group exists);
    rank 1 stops (SIGSTOP) while uploading its shard of the step-1 checkpoint. Returns what rank 0's ``fit`` raised
    and how long after the save began."""
    import time

    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from multidc.hierarchical import WanConfig, WanError

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    original = ObjectStore.put

    def stop_in_upload(self, key, *args, **kwargs):
        if rank == 1 and key.endswith(".distcp"):
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, heartbeat included: a hung host
        return original(self, key, *args, **kwargs)

    ObjectStore.put = stop_in_upload
    started = {}

    class SaveClock(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            started.setdefault("at", time.monotonic())

    strategy = HierarchicalDDPStrategy(num_sites=2, wan=WanConfig(timeout_s=WAN_TIMEOUT_S))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[SaveClock(), ModelCheckpoint(dirpath=root, every_n_train_steps=1)])
    try:
        trainer.fit(script.Regressor(), DataLoader(script.regressor_data(), batch_size=8))
        outcome = "no error"
    except WanError as exc:
        outcome = str(exc)
    except Exception as exc:  # reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == 0:
            os.kill(pids[1], signal.SIGCONT)  # rank 1 resumes, finds rank 0 gone and fails too
    return outcome, time.monotonic() - started.get("at", time.monotonic())


def test_a_peer_stopped_during_a_lightning_save_fails_the_others_with_a_wan_error_within_the_wan_timeout(tmp_path):
    from multidc.hierarchical.tools.ranks import run_ranks

    env = {rank: {"TORCHELASTIC_RUN_ID": "multidc-test", "RANK": str(rank), "LOCAL_RANK": str(rank),
                  "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "1"} for rank in range(2)}  # read by Lightning; the group already exists
    results = run_ranks(_lightning_save_with_a_stopped_peer, 2, str(tmp_path / "ckpts"), env=env, timeout=90)
    message, seconds = results[0]
    # the strategy's Checkpointer waits the topology's WanConfig.timeout_s and names the sites
    assert message.startswith("checkpoint heartbeat (upload) between site '0' and site '1' timed out after "
                              f"{WAN_TIMEOUT_S:g} s"), message
    assert seconds < WAN_TIMEOUT_S + 1 + 5, seconds  # timeout + one beat + margin for a loaded machine
    assert results[1][0] != "no error"
    assert list_checkpoints(tmp_path / "ckpts" / "epoch=0-step=1.ckpt") == []  # the abandoned save committed nothing


# ----------------------------------------------------------------------------- a rank stuck in user code
STUCK_CAP_S = 30.0  # a stuck rank gives up waiting after this: without the bounded wait, the others save or load


def _stuck_until_released(flag, held: dict) -> None:
    """Hang, as user code can (a callback waiting on a lock, a slow filesystem), until ``flag`` exists or
    ``STUCK_CAP_S`` passed."""
    import time

    held["from"] = time.monotonic()
    while not os.path.exists(flag) and time.monotonic() - held["from"] < STUCK_CAP_S:
        time.sleep(0.05)


def _fit_with_a_stuck_rank(rank, root, *, stuck_rank, phase, ckpt_path=None) -> tuple[str, float]:
    """One ``hierarchical_ddp`` fit (2 sites x 2 ranks, checkpoints every 2 steps) in which ``stuck_rank`` hangs
    in user code: ``"save"``: its ``on_save_checkpoint`` callback of the step-4 save; ``"load"``: its
    ``configure_optimizers`` while the others load ``ckpt_path``. Returns what ``fit`` raised here and how long
    after this rank went on to the checkpoint (the stuck one: once released)."""
    import time

    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from multidc.hierarchical import WanConfig, WanError

    release, clock = os.path.join(root, f"release-{phase}"), {}

    class StuckSave(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            if phase == "save" and checkpoint["global_step"] == 4:
                if rank == stuck_rank:
                    _stuck_until_released(release, clock)
                clock["at"] = time.monotonic()  # this rank goes on to the save

    class Model(script.Regressor):
        def configure_optimizers(self):
            if phase == "load":
                if rank == stuck_rank:
                    _stuck_until_released(release, clock)
                clock["at"] = time.monotonic()  # this rank goes on to the load
            return super().configure_optimizers()

    strategy = HierarchicalDDPStrategy(num_sites=2, wan=WanConfig(timeout_s=WAN_TIMEOUT_S))
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=4, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StuckSave(), ModelCheckpoint(dirpath=root, every_n_train_steps=2)])
    try:
        trainer.fit(Model(), DataLoader(script.regressor_data(), batch_size=4), ckpt_path=ckpt_path)
        outcome = "no error"
    except WanError as exc:
        outcome = str(exc)
    except Exception as exc:  # reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - clock.get("at", time.monotonic())
    if rank == 0:
        open(release, "w").close()  # the stuck rank goes on, finds the others gone and fails too
    return outcome, seconds


def _save_then_load_with_a_stuck_rank(rank, world, root):
    import torch.distributed as dist

    saved = _fit_with_a_stuck_rank(rank, root, stuck_rank=2, phase="save")
    dist.barrier()  # the default group: every rank is out of the first fit
    step2 = os.path.join(root, "epoch=0-step=2.ckpt")
    loaded = _fit_with_a_stuck_rank(rank, root, stuck_rank=1, phase="load", ckpt_path=step2)
    return saved, loaded


def test_a_rank_stuck_in_user_code_fails_the_others_save_and_load_within_the_wan_timeout(tmp_path):
    """Agreeing on the path runs in a checkpoint group under WanConfig.timeout_s, not Lightning's broadcast on the
    default group (30 min): the ranks that wait for a stuck one fail with a WanError naming the sites."""
    from multidc.hierarchical.tools.ranks import run_ranks

    env = {rank: {"TORCHELASTIC_RUN_ID": "multidc-test", "RANK": str(rank), "LOCAL_RANK": str(rank),
                  "GROUP_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": "1"} for rank in range(4)}  # read by Lightning; the group already exists
    results = run_ranks(_save_then_load_with_a_stuck_rank, 4, str(tmp_path), env=env, timeout=200)
    for phase, stuck in ((0, 2), (1, 1)):
        what = ("save", "load")[phase]
        for rank, (message, seconds) in enumerate(result[phase] for result in results):
            if rank == stuck:  # released after the others failed: it finds them gone
                assert message != "no error", (what, rank)
                continue
            # timed out, or lost the connection to a rank that timed out first and closed the group
            assert message.startswith(f"agreeing on the checkpoint path to {what} ") and \
                "between site '0' and site '1' " in message, (what, rank, message)
            # the WAN timeout, not the default group's 30 min; the clock also counts Lightning's own set-up from the
            # hook to the agreement, which took 11 s more once on a loaded 2-core machine (4 ranks)
            assert seconds < WAN_TIMEOUT_S + 20, (what, rank, seconds)
    assert [info.step for info in list_checkpoints(tmp_path / "epoch=0-step=2.ckpt")] == [2]
    assert list_checkpoints(tmp_path / "epoch=0-step=4.ckpt") == []  # the failed save committed nothing
