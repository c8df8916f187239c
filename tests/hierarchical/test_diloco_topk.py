"""DiLoCo with the sparse top-k codec and error feedback, against a one-process reference that applies the codec by
hand to every rank's share (tests/diloco_reference.py), on real gloo ranks; and its settings."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import (
    DiLoCo,
    DiLoCoConfig,
    Topology,
    WanConfig,
    register_ddp_hook,
    register_site_ddp_hook,
)
from multidc.hierarchical.tools.ranks import run_ranks
from multidc.plugins import Checkpointer, ModelState
from tests._batched import run_cases
from tests._diloco_state import named_global
from tests._topk_by_hand import TopKByHand
from tests.diloco_reference import LR, run_reference
from tests.diloco_reference import model as _model
from tests.diloco_reference import rows as _rows

pytestmark = pytest.mark.timeout(600)
CODEC = "topk"  # density 1/64, 2 bits, chunks of 256: 4 values of each 256 cross the WAN per sync
LAYOUTS = {"2x1": [0, 1], "3x1": [0, 1, 2], "2x2": [0, 0, 1, 1]}
CONFIGS = {"plain": ({"sync_every": 4}, 12),
           "streaming": ({"sync_every": 4, "fragments": 2, "overlap_steps": 1, "alpha": 0.0}, 10)}  # alpha 0: top-k
RESUME = {"layout": LAYOUTS["2x2"], "config": CONFIGS["streaming"][0], "steps": 11, "save_at": 6}  # a sync in flight


def _train_cases(layout: str) -> dict:
    return {f"{mode} {layout}": (_train, ({"layout": LAYOUTS[layout], "config": config, "steps": steps},))
            for mode, (config, steps) in CONFIGS.items()}


@pytest.fixture(scope="module")
def two_ranks():
    cases = _train_cases("2x1")
    cases["per-step hook"] = (_per_step_hook, ())
    cases["disagree density"] = (_disagree_density, ())
    return run_cases(cases, 2, timeout=540)


@pytest.fixture(scope="module")
def three_ranks():
    return run_cases(_train_cases("3x1"), 3, timeout=540)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("topk-diloco-ckpt") / "mid-sync")


@pytest.fixture(scope="module")
def four_ranks(saved_dir):
    cases = _train_cases("2x2")
    cases["unbroken"] = (_train, ({**RESUME, "ckpt": saved_dir},))
    return run_cases(cases, 4, timeout=540)


def _train(rank: int, world: int, case: dict) -> dict:
    """DDP over every rank, averaging inside the site only (as the strategies do), DiLoCo with the top-k codec."""
    topo = Topology.build(site=case["layout"][rank])
    model = _model()
    ddp = DistributedDataParallel(model)
    register_site_ddp_hook(ddp, topo)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    diloco = DiLoCo(ddp, opt, topo, DiLoCoConfig(compression=CODEC, **case["config"]))
    if case.get("resume_from"):
        with Checkpointer(case["resume_from"]) as ckpt:
            ckpt.load(_ckpt_state(topo, ddp, opt, diloco))
        if case.get("stop_after_load"):
            residuals = [fragment.residual.clone() for fragment in diloco._fragments]
            diloco.close()
            return {"residuals": residuals, "inner_steps": diloco.stats.inner_steps}
    for t in range(diloco.stats.inner_steps + 1, case["steps"] + 1):
        x, y = _rows(topo.site, topo.local_rank_in_site, t)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if t == case.get("save_at"):
            with Checkpointer(case["ckpt"]) as ckpt:
                ckpt.save(_ckpt_state(topo, ddp, opt, diloco), step=t)
                ckpt.wait()
    state = diloco.state_dict()
    residuals = [fragment.residual.clone() for fragment in diloco._fragments]
    diloco.close()
    glob = _flat(named_global(model, diloco.config.fragments, state))
    return {"local": {n: p.detach().clone() for n, p in model.named_parameters()}, "global": glob,
            "digest": hashlib.sha256(glob.numpy().tobytes()).hexdigest(), "residuals": residuals,
            "site": topo.site, "rank_in_site": topo.local_rank_in_site}


def _ckpt_state(topo, ddp, opt, diloco) -> dict:
    # DiLoCo first: loading the model state steps the stateless SGD once, which DiLoCo must not count
    return {"diloco": diloco, f"site_{topo.site}": ModelState(ddp, opt)}




def _flat(named: dict) -> torch.Tensor:
    return torch.cat([v.detach().float().reshape(-1) for v in named.values()])


def _reference(layout: list[int], config: dict, steps: int, feedback: bool = True) -> tuple[dict, TopKByHand]:
    site_size = layout.count(0)

    def batch(site, t):
        rows = [_rows(site, local, t) for local in range(site_size)]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    by_hand = TopKByHand(CODEC, site_size, feedback)
    result = run_reference(_model(), sites=max(layout) + 1, steps=steps, batch=batch, loss_fn=nn.functional.mse_loss,
                           inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), compress=by_hand,
                           keep_in_flight=True, **config)
    return result, by_hand


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_topk_diloco_with_error_feedback_equals_the_codec_applied_by_hand_per_rank(request, layout, mode):
    ranks = {2: "two_ranks", 3: "three_ranks", 4: "four_ranks"}[len(LAYOUTS[layout])]
    results = request.getfixturevalue(ranks)[f"{mode} {layout}"]
    config, steps = CONFIGS[mode]
    reference, by_hand = _reference(LAYOUTS[layout], config, steps)
    ref_global = _flat(reference["global"])
    for r in results:
        torch.testing.assert_close(r["global"], ref_global, rtol=0, atol=1e-6)
        for name, value in r["local"].items():
            torch.testing.assert_close(value, reference["local"][r["site"]][name], rtol=0, atol=1e-6)
        for fragment, residual in enumerate(r["residuals"]):  # what each rank's share dropped, kept for its next sync
            expected = by_hand.residual(fragment, r["site"], r["rank_in_site"])
            torch.testing.assert_close(residual, expected, rtol=0, atol=1e-6)
            assert residual.abs().sum() > 0
    assert len({r["digest"] for r in results}) == 1, "ranks hold different global parameters"
    # the same codec without error feedback ends elsewhere: the comparison above sees the residuals
    without, _ = _reference(LAYOUTS[layout], config, steps, feedback=False)
    assert (_flat(without["global"]) - ref_global).abs().max() > 1e-4


def test_resume_mid_sync_restores_every_ranks_residuals_and_equals_the_unbroken_run(four_ranks, saved_dir):
    unbroken = four_ranks["unbroken"]
    resumed = run_ranks(_train, 4, {**RESUME, "resume_from": saved_dir})  # ranks of its own
    for a, b in zip(unbroken, resumed):
        assert a["digest"] == b["digest"]
        for name in a["local"]:
            assert torch.equal(a["local"][name], b["local"][name]), name
        for x, y in zip(a["residuals"], b["residuals"]):
            assert torch.equal(x, y)
    assert len({r["residuals"][0].sum().item() for r in unbroken}) == 4, "each rank keeps its own residual"


def test_residuals_taken_under_another_chunk_plan_restart_at_zero(four_ranks, saved_dir):
    # saved under the default chunk_mb: with another, slot j of a residual may belong to another parameter
    # ~100-byte chunks: as many slots (ceil(numel / rails)), but slot j may hold another element: only the saved
    # layout tells, which is what this checks
    env = {rank: {"MULTIDC_WAN_CHUNK_MB": "0.0001"} for rank in range(4)}
    resumed = run_ranks(_train, 4, {**RESUME, "resume_from": saved_dir, "stop_after_load": True}, env=env)
    assert [r["inner_steps"] for r in resumed] == [RESUME["save_at"]] * 4
    for r in resumed:
        assert r["residuals"] and all(not residual.any() for residual in r["residuals"])


def _per_step_hook(rank: int, world: int) -> str:
    topo = Topology.build(site=rank, wan=WanConfig(compression="topk"))
    try:
        register_ddp_hook(DistributedDataParallel(_model()), topo)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_per_step_gradients_refuse_topk_and_point_to_diloco(two_ranks):
    for error in two_ranks["per-step hook"]:
        assert "register_ddp_hook: WanConfig.compression='topk'" in error, error
        assert "DiLoCoConfig.compression='topk'" in error, error


def _disagree_density(rank: int, world: int) -> str:
    topo = Topology.build(num_sites=2)
    try:
        DiLoCo(_model(), None, topo, DiLoCoConfig(sync_every=4, compression=f"topk:{0.02 * (rank + 1)}"))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_densities_raise_the_same_error_on_every_rank(two_ranks):
    first, second = two_ranks["disagree density"]
    assert first == second and "disagree on the DiLoCo settings" in first, first
    assert "topk:0.02:2:256" in first and "topk:0.04:2:256" in first, first


@pytest.mark.parametrize(
    ("value", "stored"),
    [("topk", "topk"), ("TopK", "topk"), ("topk:0.015625:2:256", "topk"), ("topk:0.02", "topk:0.02:2:256"),
     ("topk:0.05:4:512", "topk:0.05:4:512")],
)
def test_topk_spellings_are_stored_in_one_canonical_form(value, stored, monkeypatch):
    monkeypatch.delenv("MULTIDC_DILOCO_COMPRESSION", raising=False)
    assert DiLoCoConfig(sync_every=4, compression=value).compression == stored
    monkeypatch.setenv("MULTIDC_DILOCO_COMPRESSION", value)
    assert DiLoCoConfig(sync_every=4).compression == stored


@pytest.mark.parametrize(
    ("value", "message"),
    [("topk:2", r"DiLoCoConfig.compression='topk:2'.*density=2.0 must be a fraction in \(0, 1\]"),
     ("topk:0.1:3", r"bits=3 must be 1, 2, 4 or 8"),
     ("topk:x", r"DiLoCoConfig.compression='topk:x'.*'topk:DENSITY\[:BITS\[:CHUNK\]\]'"),
     ("topk5", r"'topk5'.* is not supported; .*'topk:DENSITY\[:BITS\[:CHUNK\]\]'")],
)
def test_bad_topk_spellings_name_the_field_and_the_accepted_forms(value, message, monkeypatch):
    monkeypatch.delenv("MULTIDC_DILOCO_COMPRESSION", raising=False)
    with pytest.raises(ValueError, match=message):
        DiLoCoConfig(sync_every=4, compression=value)
    monkeypatch.setenv("MULTIDC_DILOCO_COMPRESSION", value)
    with pytest.raises(ValueError, match="MULTIDC_DILOCO_COMPRESSION"):
        DiLoCoConfig(sync_every=4)
