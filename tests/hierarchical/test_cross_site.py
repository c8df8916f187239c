"""``cross_site_sync``: the settings pick the sync, and what a sync cannot follow is refused at ``attach``, before
any collective (one process, no process group: a refusal that reached a collective would fail differently)."""

from __future__ import annotations

import pytest
import torch

from multidc.hierarchical import CrossSite, DiLoCoConfig, WanConfig, cross_site_sync

CONFIG = DiLoCoConfig(sync_every=4)


@pytest.mark.parametrize(("settings", "kind", "placement", "drives_steps", "sites_differ"), [
    ({}, "GradientSync", "allreduce", False, False),
    ({"diloco": CONFIG}, "DiLoCoSync", "diloco", False, True),
    ({"elastic": True}, "ElasticSync", "allreduce", True, False),
    ({"elastic": True, "diloco": CONFIG}, "ElasticSync", "allreduce", True, True),
])
def test_the_settings_pick_the_sync_and_what_a_front_end_reads_off_it(settings, kind, placement, drives_steps,
                                                                       sites_differ):
    sync = cross_site_sync(wan=WanConfig(compression="bf16"), **settings)
    assert isinstance(sync, CrossSite) and type(sync).__name__ == kind
    assert (sync.placement, sync.drives_steps, sync.sites_differ) == (placement, drives_steps, sites_differ)
    assert sync.diloco_config == settings.get("diloco") and sync.wan.compression == "bf16"
    assert sync.quorum_per_step == (settings == {"elastic": True})
    # before attach: nothing runs, nothing is stored per site, the points a loop calls first are safe
    assert sync.diloco is None and sync.metrics() == {} and sync.job_step is None
    assert sync.checkpoint_sites() == ({"site": 0, "diloco": None} if settings.get("elastic") and sites_differ
                                       else {})
    sync.close()


@pytest.mark.parametrize("settings", [{"diloco": CONFIG}, {"elastic": True}, {"elastic": True, "diloco": CONFIG}])
@pytest.mark.parametrize(("models", "optimizers"), [(1, 2), (2, 1), (0, 1)])
def test_one_model_and_one_optimizer_or_attach_says_so(settings, models, optimizers):
    model = torch.nn.Linear(2, 2)
    sync = cross_site_sync(**settings)
    with pytest.raises(ValueError, match=rf"exactly one model and one optimizer, got {models} model\(s\) and "
                                         rf"{optimizers} optimizer\(s\)"):
        sync.attach([model] * models, [torch.optim.SGD(model.parameters(), lr=0.1)] * optimizers)


@pytest.mark.parametrize(("settings", "mode"), [({"diloco": CONFIG}, "DiLoCo"), ({"elastic": True}, "elastic")])
def test_fp16_loss_scaling_is_refused_where_the_sync_cannot_follow_it(settings, mode):
    model = torch.nn.Linear(2, 2)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=f"{mode} with fp16 loss scaling"):
        cross_site_sync(**settings).attach([model], [torch.optim.SGD(model.parameters(), lr=0.1)], scaler=scaler)


def test_elastic_diloco_settings_it_cannot_run_fail_when_the_sync_is_built():
    with pytest.raises(ValueError, match="overlap_steps=3 must be below"):
        cross_site_sync(elastic=True, diloco=DiLoCoConfig(sync_every=7, fragments=2, overlap_steps=3))


def test_an_elastic_point_before_attach_says_to_attach_first():
    with pytest.raises(RuntimeError, match="attach it first"):
        cross_site_sync(elastic=True).before_step()


def test_an_elastic_per_step_sync_refuses_the_top_k_codec_when_built():
    # per step it would drop ~98% of every gradient with no error feedback; top-k is for DiLoCo's outer syncs
    with pytest.raises(ValueError, match="elastic per-step sync.*not per-step gradients"):
        cross_site_sync(wan=WanConfig(compression="topk"), elastic=True)
    cross_site_sync(wan=WanConfig(compression="topk"), elastic=True, diloco=CONFIG)  # DiLoCo's syncs: allowed
