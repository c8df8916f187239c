"""``MultiDCPlugin(cross_site="diloco")`` under a real ``accelerate launch`` (4 gloo processes as 2 sites x 2):
the result equals tests/diloco_reference.py's single-process computation (fragments, overlap, gradient
accumulation), ``wan_metrics()`` reports bytes on merge steps only, and ``save_state`` with a sync in flight then
``load_state`` ends bitwise where the unbroken run ends; the same with a layout (sites2 x dp_shard2: FSDP2 inside
each site, each rank syncing its own shard); ``clip_grad_norm_`` takes each site's own norm. In the same
processes, both again with the top-k codec (against the codec applied by hand per rank / per shard, residuals
included, and resumed), and ``load_state`` across codecs (none -> topk: residuals from zero; topk -> int8). Plus
the plugin's validation, in process."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from tests._resources import require_module

require_module("accelerate", "accelerate")

from multidc.hierarchical import DiLoCoConfig  # noqa: E402
from multidc.plugins import MultiDCPlugin  # noqa: E402
from tests._launch import (  # noqa: E402
    LAUNCH_TIMEOUT_S,
    ROOT,
    finish,  # noqa: E402
    launch,
)
from tests._topk_by_hand import TopKByHand  # noqa: E402
from tests.diloco_reference import LR, run_reference  # noqa: E402
from tests.diloco_reference import model as _model  # noqa: E402
from tests.diloco_reference import rows as _rows  # noqa: E402

pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 120)
SCRIPT = f"{ROOT}/tests/plugins/_accelerate_diloco_script.py"
CONFIG = {"sync_every": 4, "fragments": 2, "overlap_steps": 1}
STEPS, ACCUMULATE, SAVE_AT = 9, 2, 6  # a sync starts at step 6 and merges at 7: in flight at the save


LAYOUTS = {"ddp": None, "sites2xdp_shard2": {"dp_shard": 2}}  # under DDP; under a layout (FSDP2 inside each site)


TOPK = {**CONFIG, "compression": "topk", "alpha": 0.0}


def _launch_at_once(tmps: dict, name: str, *extra: str, more=lambda tmp: []) -> dict[str, dict[str, list[dict]]]:
    """Run ``name`` (``extra``: its arguments; ``more(tmp)``: the runs after it in the same processes) in each of
    ``LAYOUTS`` at once, each in its ``tmps[layout]`` (each launch is single-core while accelerate and torchrun
    start, which leaves a core idle); ``{layout: {run: each rank's results}}``, the first run as ``"main"``."""
    outs, trees, runs = {}, {}, {}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every launch
        for key, layout in LAYOUTS.items():
            tmp = tmps[key]
            outs[key] = tmp / name
            outs[key].mkdir()
            runs[key] = more(tmp)
            args = [SCRIPT, "--config", json.dumps(CONFIG), "--steps", str(STEPS), "--accumulate", str(ACCUMULATE),
                    "--ckpt", f"file://{tmp}/ckpt", "--out", str(outs[key]), "--more", json.dumps(runs[key]),
                    *extra]
            args += ["--layout", json.dumps(layout)] if layout else []
            trees[key] = stack.enter_context(launch(args, {"MULTIDC_NUM_SITES": "2"}, tmp))
        logs = {}
        for key, tree in trees.items():
            code, logs[key] = finish(tree, LAUNCH_TIMEOUT_S)
            assert code == 0, f"{key}:\n{logs[key][-6000:]}"
    return {key: {"main": [torch.load(out / f"rank{r}.pt") for r in range(4)], "log": logs[key],
                  **{m["name"]: [torch.load(out / f"{m['name']}_rank{r}.pt") for r in range(4)] for m in runs[key]}}
            for key, out in outs.items()}


def _run(name: str, config: dict, *, ckpt=None, save_at=None, resume_from=None) -> dict:
    return {"name": name, "config": config, "ckpt": ckpt, "save_at": save_at, "resume_from": resume_from}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The unbroken runs of every layout at once (after each, in the same processes, the same with top-k), then
    the resumed ones at once (then top-k resumed, and the cross-codec resumes: none -> topk, topk -> int8):
    ``{layout: (unbroken, resumed)}``, each ``{run: each rank's results}``."""
    tmps = {key: tmp_path_factory.mktemp("accelerate_diloco") for key in LAYOUTS}
    unbroken = _launch_at_once(tmps, "unbroken", "--save-at", str(SAVE_AT), more=lambda tmp: [
        _run("topk", TOPK, ckpt=f"file://{tmp}/ckpt_topk", save_at=SAVE_AT)])
    resumed = _launch_at_once(tmps, "resumed", "--resume", more=lambda tmp: [
        _run("topk", TOPK, resume_from=f"file://{tmp}/ckpt_topk"),
        _run("none_to_topk", TOPK, resume_from=f"file://{tmp}/ckpt"),
        _run("topk_to_int8", {**CONFIG, "compression": "int8"}, resume_from=f"file://{tmp}/ckpt_topk")])
    return {key: (unbroken[key], resumed[key]) for key in LAYOUTS}


@pytest.fixture(scope="module")
def all_runs(launches):
    """``{layout: (unbroken, resumed)}`` of the first runs (no compression)."""
    return {key: (unbroken["main"], resumed["main"]) for key, (unbroken, resumed) in launches.items()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, all_runs):
    """The unbroken and the resumed run, under DDP and under a layout (FSDP2 inside each site)."""
    return all_runs[request.param]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def topk_runs(request, launches):
    """``(layout, unbroken, resumed)`` of the top-k runs, under DDP and under a layout."""
    return (request.param, *launches[request.param])


def _site_batch(site: int, step: int):
    rows = [_rows(site, local, (step - 1) * ACCUMULATE + j) for local in (0, 1) for j in range(1, ACCUMULATE + 1)]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def test_accelerate_launch_equals_the_single_process_reference(runs):
    unbroken, _ = runs
    ref = run_reference(_model(), sites=2, steps=STEPS, batch=_site_batch, loss_fn=torch.nn.functional.mse_loss,
                        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), **CONFIG)
    for rank in unbroken:
        assert rank["stats"]["inner_steps"] == STEPS  # one inner step per optimizer step, not per micro-batch
        for name, value in rank["local"].items():
            torch.testing.assert_close(value, ref["local"][rank["site"]][name], rtol=0, atol=1e-6)
        for name, value in rank["global"].items():
            torch.testing.assert_close(value, ref["global"][name], rtol=0, atol=1e-6)


def test_wan_metrics_show_bytes_on_merge_steps_only(runs):
    unbroken, _ = runs
    for rank in unbroken:
        merged = [t for t, m in enumerate(rank["metrics"], 1) if m["wan/outer_syncs"] > 0]
        sent = [t for t, m in enumerate(rank["metrics"], 1) if m["wan/bytes_sent"] > 0]
        assert merged == sent == [3, 5, 7, 9]  # syncs start at 2, 4, 6, 8 and merge one step later


def test_diloco_start_in_prepare_sends_no_parameters_over_the_wan_when_sites_start_equal(runs):
    for run in runs:  # every rank built the same seeded model: DiLoCo's start compares digests, copies nothing
        assert [rank["start_bytes"] for rank in run] == [0, 0, 0, 0]


def test_load_state_with_a_sync_in_flight_ends_like_the_unbroken_run(runs):
    unbroken, resumed = runs
    for a, b in zip(unbroken, resumed):
        assert b["first"] == SAVE_AT + 1 and a["site"] == b["site"]
        for kind in ("local", "global"):
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)


def test_clipping_takes_each_sites_own_norm(runs):
    unbroken, _ = runs
    by_site = {site: [r["norms"] for r in unbroken if r["site"] == site] for site in (0, 1)}
    for site, norms in by_site.items():
        assert len(norms) == 2 and norms[0] == norms[1] and len(norms[0]) == STEPS, site  # equal in the site
    assert all(a != b for a, b in zip(by_site[0][0], by_site[1][0]))  # each site's own: the sites' data differ


def test_topk_equals_the_codec_applied_by_hand_per_rank_residuals_included(topk_runs):
    """DDP: each rank of a site encodes its share of every chunk; the layout (FSDP2): each rank its own shard."""
    layout, unbroken, _ = topk_runs
    config = {k: v for k, v in TOPK.items() if k != "compression"}
    shards = 2 if LAYOUTS[layout] else 1
    by_hand = TopKByHand(TOPK["compression"], site_size=2 // shards, shards=shards)
    ref = run_reference(_model(), sites=2, steps=STEPS, batch=_site_batch, loss_fn=torch.nn.functional.mse_loss,
                        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), compress=by_hand,
                        keep_in_flight=True, **config)
    for rank in unbroken["topk"]:
        assert rank["stats"]["inner_steps"] == STEPS and rank["stats"]["outer_syncs"] == 4
        for kind, expected in (("local", ref["local"][rank["site"]]), ("global", ref["global"])):
            for name, value in rank[kind].items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"{kind} {name}")
        owner = (0, rank["rank_in_site"]) if shards > 1 else (rank["rank_in_site"], 0)
        for fragment, residual in rank["residual"].items():
            expected = by_hand.residual(int(fragment.removeprefix("fragment_")), rank["site"], owner[0],
                                        shard=owner[1])
            torch.testing.assert_close(residual, expected, rtol=0, atol=1e-6, msg=fragment)
            assert residual.any()


def test_topk_load_state_restores_every_ranks_residual_and_ends_like_the_unbroken_run(topk_runs):
    _, unbroken, resumed = topk_runs
    for a, b in zip(unbroken["topk"], resumed["topk"]):
        assert b["first"] == SAVE_AT + 1 and sorted(b["start_residual"]) == ["fragment_0", "fragment_1"]
        assert all(r.any() for r in b["start_residual"].values())  # saved mid-run: not zero
        for kind in ("local", "global", "residual"):
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)
    assert len({r["start_residual"]["fragment_0"].sum().item() for r in resumed["topk"]}) == 4


def test_load_state_across_codecs_restarts_residuals_at_zero(topk_runs):
    """Saved without top-k, loaded with it: the residuals start at zero (logged on every rank); saved with top-k,
    loaded with int8: they are not read. The rest is the checkpoint's either way."""
    _, _, resumed = topk_runs
    for cross, same in (("none_to_topk", "main"), ("topk_to_int8", "topk")):
        for run, loaded in zip(resumed[cross], resumed[same]):  # the same checkpoint, loaded with its own codec
            assert run["first"] == SAVE_AT + 1 and run["stats"]["inner_steps"] == STEPS, cross
            for name, value in run["start"].items():
                assert torch.equal(value, loaded["start"][name]), (cross, name)
    for run in resumed["none_to_topk"]:
        assert sorted(run["start_residual"]) == ["fragment_0", "fragment_1"]
        assert not any(r.any() for r in run["start_residual"].values())
        assert run["residual"]["fragment_1"].any()  # top-k ran on: fragment 1 synced at 8 (fragment 0 would at 10)
    assert all(run["residual"] == {} for run in resumed["topk_to_int8"])
    assert resumed["log"].count("DiLoCo error-feedback residual(s) are not in this checkpoint") == 4


@pytest.mark.parametrize("kwargs,message", [
    ({"cross_site": "gossip"}, "choose 'allreduce'"),
    ({"diloco": DiLoCoConfig(sync_every=4)}, "cross_site is 'allreduce'"),
    ({"cross_site": "diloco", "diloco": {"sync_every": 4}}, "must be a multidc.hierarchical.DiLoCoConfig"),
], ids=["unknown-mode", "diloco-without-mode", "dict-config"])
def test_plugin_rejects_bad_diloco_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiDCPlugin(**kwargs)


def test_plugin_reads_cross_site_and_diloco_from_the_environment(monkeypatch):
    monkeypatch.setenv("MULTIDC_CROSS_SITE", "diloco")
    with pytest.raises(ValueError, match="MULTIDC_DILOCO_SYNC_EVERY"):
        MultiDCPlugin()
    monkeypatch.setenv("MULTIDC_DILOCO_SYNC_EVERY", "16")
    plugin = MultiDCPlugin()
    assert plugin.cross_site == "diloco" and plugin.diloco == DiLoCoConfig(sync_every=16)


def test_diloco_checkpoints_never_fall_back_to_accelerates_format():
    from types import SimpleNamespace

    from multidc.hierarchical import cross_site_sync
    from multidc.plugins.accelerate.state import StateMixin

    stub = SimpleNamespace(gradient_sync=cross_site_sync(diloco=DiLoCoConfig(sync_every=4)), device_mesh=None,
                           multidc_plugin=SimpleNamespace(shard_local_checkpoints=False, elastic=False))
    assert StateMixin._through_multidc(stub, "plain/local/dir", loading=False)  # every site's model + DiLoCo state
    with pytest.raises(ValueError, match="need a URL or directory"):
        StateMixin._through_multidc(stub, None, loading=False)
