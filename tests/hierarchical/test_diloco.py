"""DiLoCo against a reference computed another way (tests/diloco_reference.py), on real gloo ranks."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import (
    DiLoCo,
    DiLoCoConfig,
    SiteLayout,
    Topology,
    WanConfig,
    all_reduce,
    get_codec,
    register_site_ddp_hook,
)
from multidc.hierarchical.diloco.fragments import split_fragments
from multidc.hierarchical.tools.ranks import run_ranks
from tests._batched import run_cases
from tests._diloco_state import named_global
from tests.diloco_reference import LR, run_reference, second_step_error
from tests.diloco_reference import model as _model
from tests.diloco_reference import rows as _rows

LAYOUTS = {"2x2": [0, 0, 1, 1], "3+1": [0, 0, 0, 1], "one site": [0, 0], "2+1": [0, 0, 1]}
REPORTED = [2.0, 4.0, 6.0, 8.0]  # samples per step each rank reports: the 3-rank site weighs 12, the other 8
# The cases of one world size run on the same spawned ranks (``four_ranks``, ``two_ranks``: starting ranks is the
# slow part); a resume loads in ranks of its own.
pytestmark = pytest.mark.timeout(600)
REFERENCE_CONFIG = {"sync_every": 4}
STREAMING_CONFIG = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "alpha": 0.5}
APART_CONFIG = {"sync_every": 6, "fragments": 3}
MANUAL_CONFIG = {"sync_every": 4}
RESUME_CONFIG = {"sync_every": 4, "fragments": 2, "overlap_steps": 1}
# ranks reporting more samples every step (so the sites weigh 3 : 7 and the resumed run needs the counts since each
# sync). 2 ranks per site: with 3, DDP's bucket rebuild after a (resumed) process's first step changes gloo's
# summation order inside the site, so a resume ends equal only to float32 rounding
RESUME_CASE = {"layout": [0, 0, 1, 1], "steps": 11, "config": RESUME_CONFIG, "samples_grow": True}
COMPRESSIONS = ["int4", "int8", "bf16"]
PROTOCOL_CASES = {"allreduce": None, "diloco": REFERENCE_CONFIG}


def _compressed_case(compression: str) -> dict:
    return {"layout": [0, 1], "steps": 4, "config": {"sync_every": 4, "compression": compression},
            "ddp": "site_group"}


def _fragments_case(layout: str) -> dict:
    # block 1 (fragment 1 of 2) moved on the sites > 0
    return {"layout": LAYOUTS[layout], "config": {"sync_every": 4, "fragments": 2}, "ddp": "site_group",
            "shift": [1]}


@pytest.fixture(scope="module")
def saved_dirs(tmp_path_factory):
    """Checkpoint folders the batched runs save into: ``mid_sync`` (2x2 at step 6), ``site_0_only`` (one site)."""
    tmp = tmp_path_factory.mktemp("diloco-ckpts")
    return {"mid_sync": str(tmp / "mid-sync"), "site_0_only": str(tmp / "site-0-only")}


@pytest.fixture(scope="module")
def four_ranks(saved_dirs):
    cases = {f"reference {layout}": (_train, ({"layout": LAYOUTS[layout], "steps": 12, "config": REFERENCE_CONFIG},))
             for layout in ("2x2", "3+1")}
    cases["streaming"] = (_train, ({"layout": LAYOUTS["2x2"], "steps": 10, "config": STREAMING_CONFIG},))
    cases["apart"] = (_train, ({"layout": LAYOUTS["3+1"], "steps": 12, "config": APART_CONFIG,
                                 "ddp": "site_group"},))
    cases["start equal"] = (_start, ({"layout": LAYOUTS["2x2"], "config": {"sync_every": 4, "fragments": 2}},))
    cases |= {f"fragments {layout}": (_start, (_fragments_case(layout),)) for layout in ("2x2", "3+1")}
    cases["unbroken"] = (_train, (RESUME_CASE | {"save_at": 6, "ckpt": saved_dirs["mid_sync"]},))  # a sync in flight
    cases |= {f"protocol {mode}": (_protocol, (config,)) for mode, config in PROTOCOL_CASES.items()}
    cases |= _weighting_cases("3+1")
    cases["reported 3+1"] = (_train, ({"layout": LAYOUTS["3+1"], "steps": 12, "config": REFERENCE_CONFIG,
                                       "samples": REPORTED},))
    return run_cases(cases, 4, timeout=540)


def _weighting_cases(layout: str) -> dict:
    """Unequal sites merged by what they trained (the default), plain and streaming, and with equal weights."""
    run = {"layout": LAYOUTS[layout], "steps": 12}
    return {f"weighted plain {layout}": (_train, ({**run, "config": REFERENCE_CONFIG},)),
            f"weighted streaming {layout}": (_train, ({**run, "steps": 10, "config": STREAMING_CONFIG},)),
            f"equal {layout}": (_train, ({**run, "config": {**REFERENCE_CONFIG, "weighting": "equal"}},))}


@pytest.fixture(scope="module")
def three_ranks():
    return run_cases(_weighting_cases("2+1"), 3, timeout=540)


@pytest.fixture(scope="module")
def two_ranks(saved_dirs):
    """The 2-rank cases; those whose ranks raise (and report it) come last."""
    cases = {"reference one site": (_train, ({"layout": LAYOUTS["one site"], "steps": 12,
                                              "config": REFERENCE_CONFIG},))}
    cases["manual"] = (_train, ({"layout": [0, 1], "steps": 8, "config": MANUAL_CONFIG, "manual": True},))
    cases |= {f"compressed {c}": (_train, (_compressed_case(c),)) for c in COMPRESSIONS}
    cases["site 0 saves"] = (_train, ({"layout": [0, 0], "steps": 2, "config": {"sync_every": 2}, "save_at": 2,
                                       "ckpt": saved_dirs["site_0_only"]},))
    cases["step twice"] = (_step_twice, ())
    cases |= {f"disagree {what}": (_disagree, (what,)) for what in ("config", "model")}
    return run_cases(cases, 2, timeout=540)


def _ranks_of(layout: str, four_ranks, two_ranks):
    return (four_ranks if len(LAYOUTS[layout]) == 4 else two_ranks)[f"reference {layout}"]


@pytest.mark.parametrize("mode", ["plain", "streaming", "equal"])
@pytest.mark.parametrize("layout", ["3+1", "2+1"])
def test_unequal_sites_weigh_what_they_trained_and_equal_weights_stay_selectable(request, layout, mode):
    results = request.getfixturevalue("four_ranks" if layout == "3+1" else "three_ranks")
    config, steps = {"plain": (REFERENCE_CONFIG, 12), "streaming": (STREAMING_CONFIG, 10),
                     "equal": ({**REFERENCE_CONFIG, "weighting": "equal"}, 12)}[mode]
    case = f"equal {layout}" if mode == "equal" else f"weighted {mode} {layout}"
    reference = _reference(LAYOUTS[layout], steps, config)
    _check(results[case], reference)
    other = _reference(LAYOUTS[layout], steps, {**config, "weighting": "samples" if mode == "equal" else "equal"})
    assert (_flat(other["global"]) - _flat(reference["global"])).abs().max() > 1e-4, "the weights must matter"


def test_samples_each_rank_reports_weigh_its_site(four_ranks):
    _check(four_ranks["reported 3+1"], _reference(LAYOUTS["3+1"], 12, REFERENCE_CONFIG, samples=REPORTED))
    by_ranks = _reference(LAYOUTS["3+1"], 12, REFERENCE_CONFIG)  # 12 : 8, not 3 : 1
    assert (_flat(by_ranks["global"]) - four_ranks["reported 3+1"][0]["global"]).abs().max() > 1e-4
def _site_batch(layout: list[int], site: int, step: int):
    rows = [_rows(site, local, step) for local in range(layout.count(site))]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def _inner(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _train(rank: int, world: int, case: dict) -> dict:
    topo = Topology.build(site=case["layout"][rank])
    model, ddp, opt, diloco = _setup(topo, case)
    if case.get("resume_from"):
        from multidc.plugins import Checkpointer

        with Checkpointer(case["resume_from"]) as ckpt:
            ckpt.load(_ckpt_state(topo, ddp, opt, diloco))
    sent, start = [], diloco.stats.inner_steps + 1
    for t in range(start, case["steps"] + 1):
        x, y = _rows(topo.site, topo.local_rank_in_site, t)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if case.get("samples"):  # what this rank reports it trained (else each step counts 1)
            diloco.count(case["samples"][rank] / 2)
            diloco.count(case["samples"][rank] / 2)  # reports add up (micro-batches)
        if case.get("samples_grow"):  # more every step: a resume must restore the counts since the last sync
            diloco.count((rank + 1) * t)
        before = topo.wan_stats.snapshot()["bytes_sent"]
        opt.step()  # the DiLoCo step runs in the optimizer's post-hook (built with opt)
        if case.get("manual"):  # built with inner_optimizer=None: the loop steps DiLoCo itself
            diloco.step()
        sent.append(topo.wan_stats.snapshot()["bytes_sent"] - before)
        if t == case.get("save_at"):
            from multidc.plugins import Checkpointer

            with Checkpointer(case["ckpt"]) as ckpt:
                ckpt.save(_ckpt_state(topo, ddp, opt, diloco), step=t)
                ckpt.wait()
    state = diloco.state_dict()
    with diloco.global_parameters():
        inside = _flat(dict(model.named_parameters())).clone()
    diloco.close()
    glob = _flat(named_global(model, diloco.config.fragments, state))
    return {
        "local": {n: p.detach().clone() for n, p in model.named_parameters()},
        "inside_global_parameters": inside,
        "global": glob,
        "digest": _digest(glob),
        "sent": sent,
        "stats": dataclasses.asdict(diloco.stats),
        "site": topo.site,
    }




def _setup(topo, case):
    """DDP over every rank with the site-only hook (as the strategies do), or DDP over the site's group alone,
    where sites start from different values (the blocks ``case["shift"]``, default all, moved on sites > 0) and
    DiLoCo must copy site 0's parameters everywhere. ``case["manual"]``: DiLoCo without the inner optimizer."""
    model = _model()
    if case.get("ddp") == "site_group":
        if topo.site:
            with torch.no_grad():
                for i in case.get("shift", range(len(model))):
                    for p in model[i].parameters():
                        p.add_(1.0)
        ddp = DistributedDataParallel(model, process_group=topo.intra_group)
    else:
        ddp = DistributedDataParallel(model)
        register_site_ddp_hook(ddp, topo)
    opt = _inner(ddp.parameters())
    diloco = DiLoCo(ddp, None if case.get("manual") else opt, topo, DiLoCoConfig(**case["config"]))
    return model, ddp, opt, diloco


def _ckpt_state(topo, ddp, opt, diloco) -> dict:
    from multidc.plugins import ModelState

    # DiLoCo first: loading the model state afterwards steps the (stateless) SGD once to initialize its state
    # (torch.distributed.checkpoint does so, lr 0, zero gradients), which DiLoCo must not count as an inner step.
    return {"diloco": diloco, f"site_{topo.site}": ModelState(ddp, opt)}


def _reference(layout: list[int], steps: int, config: dict, samples: list[float] | None = None) -> dict:
    """``samples``: what each rank reports per step (default 1); sites weigh what their ranks trained, unless the
    config says ``weighting="equal"``."""
    sites = max(layout) + 1
    per_rank = samples or [1.0] * len(layout)
    weights = [sum(per_rank[r] for r in range(len(layout)) if layout[r] == s) for s in range(sites)]
    config = dict(config)
    if config.pop("weighting", "samples") == "equal":
        weights = None
    return run_reference(
        _model(), sites=sites, steps=steps, batch=lambda s, t: _site_batch(layout, s, t),
        loss_fn=nn.functional.mse_loss, inner_optimizer=_inner, site_weights=weights, **config,
    )


def _check(results: list[dict], reference: dict, atol: float = 1e-6) -> None:
    ref_global = _flat(reference["global"])
    for r in results:
        torch.testing.assert_close(r["global"], ref_global, rtol=0, atol=atol)
        for name, value in r["local"].items():
            torch.testing.assert_close(value, reference["local"][r["site"]][name], rtol=0, atol=atol)
    assert len({r["digest"] for r in results}) == 1, "ranks hold different global parameters"


@pytest.mark.parametrize("layout", ["2x2", "3+1", "one site"])
def test_diloco_equals_single_process_reference(four_ranks, two_ranks, layout):
    results = _ranks_of(layout, four_ranks, two_ranks)
    _check(results, _reference(LAYOUTS[layout], 12, REFERENCE_CONFIG))  # one site: local training plus the outer step
    for r in results:
        syncs = [t for t, b in enumerate(r["sent"], start=1) if b]
        assert r["stats"]["outer_syncs"] == 3 and r["stats"]["inner_steps"] == 12
        if r["stats"]["bytes_sent"]:  # a rank on a rail: bytes on sync steps only
            assert syncs == [4, 8, 12], r["sent"]


def _protocol(rank: int, world: int, config: dict | None) -> dict:
    """A raw ``torch.distributed`` loop that knows only the ``CrossSite`` protocol (no topology, hook or DiLoCo built
    by hand), 2 sites x 2 ranks: ``cross_site_sync`` picks per-step all-reduce or DiLoCo from the settings."""
    from multidc.hierarchical import cross_site_sync

    sync = cross_site_sync(diloco=DiLoCoConfig(**config) if config else None)
    topo = sync.build_topology(site=LAYOUTS["2x2"][rank])
    model = _model()
    ddp = DistributedDataParallel(model)
    sync.attach_ddp(ddp)
    opt = _inner(ddp.parameters())
    sync.attach([ddp], [opt])
    sent = []
    for t in range(1, 13):
        x, y = _rows(topo.site, topo.local_rank_in_site, t)
        sync.before_step()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        sync.backward_done()
        sync.after_backward(ddp)
        if sync.commit():
            opt.step()
        sync.after_step()
        sent.append(sync.metrics().get("wan/bytes_sent", 0))
    sites, diloco = sync.checkpoint_sites(), sync.diloco
    state = diloco.state_dict() if diloco is not None else None
    sync.close()
    named = named_global(model, diloco.config.fragments, state) if diloco is not None else None
    glob = _flat(named if named is not None else dict(model.named_parameters()))
    return {"local": {n: p.detach().clone() for n, p in model.named_parameters()}, "global": glob.detach().clone(),
            "digest": _digest(glob.detach()), "site": topo.site, "sent": sent, "drives_steps": sync.drives_steps,
            "sites": {key: type(value).__name__ for key, value in sites.items()}, "placement": sync.placement}


def _allreduce_reference(steps: int) -> dict:
    """One process, every rank's rows in one batch: what per-step averaging over all 4 ranks computes."""
    model = _model()
    opt = _inner(model.parameters())
    for t in range(1, steps + 1):
        rows = [_rows(site, local, t) for site, local in ((0, 0), (0, 1), (1, 0), (1, 1))]
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat([r[0] for r in rows])), torch.cat([r[1] for r in rows])).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", sorted(PROTOCOL_CASES))
def test_a_raw_loop_driven_by_the_cross_site_protocol_alone_equals_the_reference(four_ranks, mode):
    results = four_ranks[f"protocol {mode}"]
    assert {r["placement"] for r in results} == {mode} and not any(r["drives_steps"] for r in results)
    if mode == "diloco":
        _check(results, _reference(LAYOUTS["2x2"], 12, REFERENCE_CONFIG))
        assert [r["sites"] for r in results] == [{"site": "int", "diloco": "DiLoCo"}] * 4
        assert [r["site"] for r in results] == LAYOUTS["2x2"]
        # the WAN is crossed at the syncs only (every sync_every=4 steps)
        assert all([t for t, sent in enumerate(r["sent"], 1) if sent] == [4, 8, 12] for r in results), results[0]
        return
    reference = _allreduce_reference(12)
    for r in results:
        for name, value in r["local"].items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6)
        assert r["sites"] == {} and all(sent > 0 for sent in r["sent"])
    assert len({r["digest"] for r in results}) == 1, "ranks hold different parameters"


def test_streaming_fragments_with_overlap_follow_the_merge_rule(four_ranks):
    results = four_ranks["streaming"]
    _check(results, _reference(LAYOUTS["2x2"], 10, STREAMING_CONFIG))
    assert {r["stats"]["outer_syncs"] for r in results} == {4}  # started at 2, 4, 6, 8 and merged; 10 in flight
    for r in results:  # global_parameters() shows the global copy and gives the (different) local ones back
        assert torch.equal(r["inside_global_parameters"], r["global"])
        assert not torch.equal(_flat(r["local"]), r["global"])


def test_sites_starting_apart_get_site_0s_parameters_and_fragments_match_on_unequal_sites(four_ranks):
    _check(four_ranks["apart"], _reference(LAYOUTS["3+1"], 12, APART_CONFIG))


def test_step_by_hand_without_an_inner_optimizer_equals_the_reference(two_ranks):
    results = two_ranks["manual"]
    _check(results, _reference([0, 1], 8, MANUAL_CONFIG))
    assert {r["stats"]["outer_syncs"] for r in results} == {2}


def test_a_second_step_for_the_same_inner_step_raises_on_every_rank_before_the_sites_diverge(two_ranks):
    results = two_ranks["step twice"]
    for r in results:  # the manual step() after the hook's, at inner step 1: nothing counted twice, nothing synced
        assert "Remove the diloco.step() call" in r["error"] and "DiLoCo(model, None" in r["error"], r["error"]
        assert r["inner_steps"] == 1 and r["outer_syncs"] == 0
    assert results[0]["global"] == results[1]["global"]


def _step_twice(rank: int, world: int) -> dict:
    """The loop of torchft's DiLoCo: ``optimizer.step()`` then ``diloco.step()``, on a DiLoCo built with the
    optimizer (whose post-hook steps it already). ``sync_every=2``: counted twice, step 1 would sync."""
    topo = Topology.build(site=rank)
    _, ddp, opt, diloco = _setup(topo, {"config": {"sync_every": 2}})
    x, y = _rows(topo.site, 0, 1)
    nn.functional.mse_loss(ddp(x), y).backward()
    error = second_step_error(opt, diloco)
    state = diloco.state_dict()
    diloco.close()
    return {"error": error, "inner_steps": diloco.stats.inner_steps, "outer_syncs": diloco.stats.outer_syncs,
            "global": [_digest(flat) for flat in state["global"].values()]}


def test_sites_starting_equal_send_no_parameter_bytes_at_start(four_ranks):
    results = four_ranks["start equal"]
    for r in results:  # DDP's start-up broadcast made every rank equal: DiLoCo compares digests, copies nothing
        assert r["start_sent"] == 0, r
        assert r["local"] == r["site_0"] == r["global"]


@pytest.mark.parametrize("layout", ["2x2", "3+1"])
def test_only_fragments_that_differ_between_sites_are_copied_at_start(four_ranks, layout):
    # block 1 (fragment 1 of 2) moved on the sites > 0: fragment 1 alone crosses the WAN, then every rank is equal
    results = four_ranks[f"fragments {layout}"]
    for r in results:
        assert r["start_sent"] == r["copy_sent"][1], r  # what a float32 all-reduce of fragment 1 sends
        assert r["local"] == r["site_0"] == r["global"]
    assert any(r["start_sent"] > 0 for r in results)


def _start(rank: int, world: int, case: dict) -> dict:
    """DiLoCo's start alone: the WAN bytes it sent, and per fragment the bytes a replicated, uncompressed float32
    all-reduce of the fragment's size sends (the copy measured another way); digests of this rank's parameters
    after the start, of site 0's starting values (``_model()``) and of the global copy."""
    topo = Topology.build(site=case["layout"][rank])
    before = topo.wan_stats.snapshot()["bytes_sent"]
    model, _, _, diloco = _setup(topo, case)
    start_sent = topo.wan_stats.snapshot()["bytes_sent"] - before
    state = diloco.state_dict()
    diloco.close()
    copy_sent = []
    for flat in state["global"].values():
        before = topo.wan_stats.snapshot()["bytes_sent"]
        all_reduce(torch.zeros_like(flat), topo, wan=dataclasses.replace(topo.wan, compression="none"),
                   replicated=True)
        copy_sent.append(topo.wan_stats.snapshot()["bytes_sent"] - before)
    return {"start_sent": start_sent, "copy_sent": copy_sent, "local": _digest(_flat(dict(model.named_parameters()))),
            "site_0": _digest(_flat(dict(_model().named_parameters()))),
            "global": _digest(_flat(named_global(model, diloco.config.fragments, state)))}


def test_resume_from_checkpoint_mid_sync_equals_unbroken_run(four_ranks, saved_dirs):
    unbroken = four_ranks["unbroken"]  # saved at step 6, a sync in flight
    resumed = run_ranks(_train, 4, RESUME_CASE | {"resume_from": saved_dirs["mid_sync"]})  # ranks of its own
    for a, b in zip(unbroken, resumed):
        assert a["digest"] == b["digest"]
        for name in a["local"]:
            assert torch.equal(a["local"][name], b["local"][name]), name


def test_resume_with_a_site_the_checkpoint_lacks_names_the_sites_it_holds(two_ranks, saved_dirs):
    assert len(two_ranks["site 0 saves"]) == 2  # saved by one site of 2 ranks
    errors = run_ranks(_error_of, 2, {"layout": [0, 1], "steps": 4, "config": {"sync_every": 2},
                                      "resume_from": saved_dirs["site_0_only"]})
    for error in errors:
        assert "no state for site_1" in error and "1 site(s): site_0" in error, error


def _error_of(rank: int, world: int, case: dict) -> str:
    try:
        _train(rank, world, case)
    except Exception as exc:  # every rank must raise; the message is the test's result
        return str(exc)
    return "no error"


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_compressed_pseudo_gradients_stay_within_the_codec_bound(two_ranks, compression):
    results = two_ranks[f"compressed {compression}"]
    exact = _flat(_reference([0, 1], 4, {"sync_every": 4})["global"])
    # One sync: global = start - lr * (1 + mu) * mean(delta_s), each site's delta_s = start - local_s rounded once.
    before = _reference([0, 1], 4, {"sync_every": 100})["local"]
    start = _flat(dict(_model().named_parameters()))
    codec = get_codec(compression)
    rounding = sum(codec.max_abs_error(start - _flat(local)) for local in before) / 2
    bound = 0.7 * 1.9 * rounding + 1e-6
    for r in results:
        assert torch.all((r["global"] - exact).abs() <= bound), ((r["global"] - exact).abs() - bound).max()
    assert len({r["digest"] for r in results}) == 1


def _flat(named: dict) -> torch.Tensor:
    return torch.cat([v.detach().float().reshape(-1) for v in named.values()])


def test_differing_settings_raise_the_same_error_on_every_rank(two_ranks):
    results = two_ranks["disagree config"]
    assert results[0] == results[1] and "disagree on the DiLoCo settings" in results[0]


def test_sites_with_different_models_raise_the_same_error_on_every_rank(two_ranks):
    results = two_ranks["disagree model"]
    assert results[0] == results[1] and "ranks hold different models" in results[0]


def _disagree(rank: int, world: int, what: str = "config") -> str:
    topo = Topology.build(num_sites=2)
    model = _model()
    if what == "model" and rank:
        model[3] = nn.Linear(16, 5)
    try:
        DiLoCo(model, None, topo, DiLoCoConfig(sync_every=4 + (rank if what == "config" else 0)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_fragment_without_trainable_parameters_names_the_field():
    model = _model()
    for block in (model[1], model[3]):
        block.requires_grad_(False)
    with pytest.raises(ValueError, match=r"fragments=2: fragment\(s\) \[1\] hold no trainable parameter"):
        split_fragments(model, 2)


def test_more_fragments_than_blocks_names_the_field():
    with pytest.raises(ValueError, match=r"DiLoCoConfig.fragments=5 but the model has 4 blocks"):
        split_fragments(_model(), 5)


def test_fragments_are_strided_over_blocks():
    model = _model()
    split = split_fragments(model, 2)
    blocks = list(model.children())
    assert split[0] == [*blocks[0].parameters(), *blocks[2].parameters()]
    assert split[1] == [*blocks[1].parameters(), *blocks[3].parameters()]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "sync_every is not set"),
        ({"sync_every": 0}, "sync_every=0"),
        ({"sync_every": 4, "fragments": 5}, "fragments=5"),
        ({"sync_every": 4, "fragments": 2, "overlap_steps": 2}, "overlap_steps=2"),
        ({"sync_every": 4, "alpha": 1.5}, "alpha=1.5"),
        ({"sync_every": 4, "outer_lr": 0}, "outer_lr=0"),
        ({"sync_every": 4, "outer_momentum": 1.0}, "outer_momentum=1.0"),
        ({"sync_every": 4, "outer_momentum": 0.0}, "nesterov"),
        ({"sync_every": 4, "compression": "zip"}, "compression='zip'"),
        ({"sync_every": 4, "weighting": "tokens"}, "weighting='tokens'.*choose 'samples'.* or 'equal'"),
        ({"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compression": "topk"},
         r"alpha=0.5 .*compression='topk' and overlap_steps=1: set alpha=0.*counted 1 \+ alpha times"),
    ],
)
def test_bad_config_names_the_field(kwargs, message, monkeypatch):
    monkeypatch.delenv("MULTIDC_DILOCO_SYNC_EVERY", raising=False)
    with pytest.raises(ValueError, match=message):
        DiLoCoConfig(**kwargs)


def test_environment_fills_unset_fields_and_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("MULTIDC_DILOCO_SYNC_EVERY", "30")
    monkeypatch.setenv("MULTIDC_DILOCO_NESTEROV", "0")
    monkeypatch.setenv("MULTIDC_DILOCO_WEIGHTING", " Equal")
    config = DiLoCoConfig(fragments=3)
    assert (config.sync_every, config.fragments, config.nesterov, config.weighting) == (30, 3, False, "equal")
    assert DiLoCoConfig(sync_every=4, weighting="samples").weighting == "samples"
    monkeypatch.setenv("MULTIDC_DILOCO_OVERLAP_STEPS", "10")
    with pytest.raises(ValueError, match=r"MULTIDC_DILOCO_OVERLAP_STEPS=10 \(DiLoCoConfig.overlap_steps\)"):
        DiLoCoConfig(fragments=3)


def test_fp16_loss_scaling_is_refused_with_the_reason():
    from multidc.hierarchical.diloco.config import refuse_loss_scaling

    refuse_loss_scaling(None)
    with pytest.raises(ValueError, match="GradScaler skips optimizer steps on overflow"):
        refuse_loss_scaling(torch.amp.GradScaler("cpu"))


def test_a_topology_that_tolerates_wan_failures_is_refused_before_any_collective():
    pytest.importorskip("torchft")
    from multidc.hierarchical.elastic.site import DiscardStep

    model, layout = _model(), SiteLayout(site_ranks=((0,), (1,)), site_names=("0", "1"))
    topology = Topology(layout=layout, site=0, local_rank_in_site=0, intra_group=None, rail_groups=[], rail_row=None,
                        wan=WanConfig(), policy=DiscardStep(manager=None, site_name="0"))
    with pytest.raises(ValueError, match=r"this one's policy \(DiscardStep\) tolerates them"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=LR), topology, DiLoCoConfig(sync_every=4))
