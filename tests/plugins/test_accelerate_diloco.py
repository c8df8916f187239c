"""``MultiDCPlugin(cross_site="diloco")`` under a real ``accelerate launch`` (4 gloo processes as 2 sites x 2):
the result equals tests/diloco_reference.py's single-process computation (fragments, overlap, gradient
accumulation), ``wan_metrics()`` reports bytes on merge steps only, and ``save_state`` with a sync in flight then
``load_state`` ends bitwise where the unbroken run ends; the same with a layout (sites2 x dp_shard2: FSDP2 inside
each site, each rank syncing its own shard); ``clip_grad_norm_`` takes each site's own norm. Plus the
plugin's validation, in process."""

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
from tests.diloco_reference import LR, run_reference  # noqa: E402
from tests.diloco_reference import model as _model  # noqa: E402
from tests.diloco_reference import rows as _rows  # noqa: E402

pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 120)
SCRIPT = f"{ROOT}/tests/plugins/_accelerate_diloco_script.py"
CONFIG = {"sync_every": 4, "fragments": 2, "overlap_steps": 1}
STEPS, ACCUMULATE, SAVE_AT = 9, 2, 6  # a sync starts at step 6 and merges at 7: in flight at the save


LAYOUTS = {"ddp": None, "sites2xdp_shard2": {"dp_shard": 2}}  # under DDP; under a layout (FSDP2 inside each site)


def _launch_at_once(tmps: dict, name: str, *extra: str) -> dict[str, list[dict]]:
    """Run ``name`` (``extra``: its arguments) in each of ``LAYOUTS`` at once, each in its ``tmps[layout]``
    (each launch is single-core while accelerate and torchrun start, which leaves a core idle); ``{layout: each
    rank's results}``."""
    outs, trees = {}, {}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every launch
        for key, layout in LAYOUTS.items():
            tmp = tmps[key]
            outs[key] = tmp / name
            outs[key].mkdir()
            args = [SCRIPT, "--config", json.dumps(CONFIG), "--steps", str(STEPS), "--accumulate", str(ACCUMULATE),
                    "--ckpt", f"file://{tmp}/ckpt", "--out", str(outs[key]), *extra]
            args += ["--layout", json.dumps(layout)] if layout else []
            trees[key] = stack.enter_context(launch(args, {"MULTIDC_NUM_SITES": "2"}, tmp))
        for key, tree in trees.items():
            code, log = finish(tree, LAUNCH_TIMEOUT_S)
            assert code == 0, f"{key}:\n{log[-6000:]}"
    return {key: [torch.load(out / f"rank{r}.pt") for r in range(4)] for key, out in outs.items()}


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """The unbroken runs of every layout at once, then the resumed ones at once: ``{layout: (unbroken, resumed)}``."""
    tmps = {key: tmp_path_factory.mktemp("accelerate_diloco") for key in LAYOUTS}
    unbroken = _launch_at_once(tmps, "unbroken", "--save-at", str(SAVE_AT))
    resumed = _launch_at_once(tmps, "resumed", "--resume")
    return {key: (unbroken[key], resumed[key]) for key in LAYOUTS}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, all_runs):
    """The unbroken and the resumed run, under DDP and under a layout (FSDP2 inside each site)."""
    return all_runs[request.param]


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
