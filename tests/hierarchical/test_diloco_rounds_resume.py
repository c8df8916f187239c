"""Resume under rounds by time (``DiLoCoConfig.sync_every_s``) on real gloo ranks: the DiLoCo state, the model and
the inner optimizer are saved mid-run, everything is rebuilt in the same processes and loaded, and the run ends
bitwise where the unbroken run ends, with the same round plans. The fake clock of test_diloco_rounds makes the
plans deterministic.

Every site saves right after the same sync (the k-th one each site started, counted the same on every site), as a
checkpoint of the whole job must: between two syncs the sites' step counts differ, and the next cross-site
collective is the next sync on every site, so the rebuild's collectives pair up."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import DiLoCo, DiLoCoConfig, Topology, register_site_ddp_hook
from tests._batched import run_cases
from tests.diloco_reference import LR
from tests.diloco_reference import model as _model
from tests.diloco_reference import rows as _rows

pytestmark = pytest.mark.timeout(300)
TOTAL = 30
CLOCK = {2: [0.01, 0.03], 3: [0.01, 0.008, 0.03]}  # seconds per step of each rank (fake): plans of 12 and 4
PLAIN = {"sync_every": 4, "sync_every_s": 0.12, "fragments": 2}
OVERLAP = PLAIN | {"overlap_steps": 1}
FIXED = {"sync_every": 4, "fragments": 2}
# name: (config, save after the k-th sync started, then this many more steps)
SAVES = {
    "mid-round": (PLAIN, 3, 1),  # between round 2's first and second sync
    "in flight": (OVERLAP, 3, 0),  # round 2's first sync still in flight (it merges a step later)
    "round end": (PLAIN, 4, 0),  # round 2's end: the plan of round 3 just agreed, the timer restarted
    "last round": (OVERLAP, 6, 0),  # round 3's end: the last round planned
}


def _build(rank: int, case: dict, *, perturb: bool = False):
    topo = Topology.build(site=case["layout"][rank])
    model = _model()
    if perturb:  # a resume must restore every parameter, not find them equal by chance
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    ddp = DistributedDataParallel(model)
    register_site_ddp_hook(ddp, topo)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)  # state of its own to restore
    diloco = DiLoCo(ddp, opt, topo, DiLoCoConfig(**case["config"]))
    diloco.finish_at(TOTAL)
    dt = CLOCK[len(case["layout"])][rank]
    diloco._timer.clock = lambda: diloco.stats.inner_steps * dt
    return topo, model, ddp, opt, diloco


def _first_backward(ddp, opt, x, y) -> None:
    """A forward and backward without an optimizer step: DDP's bucket rebuild (a broadcast over its process group,
    every site, at its second forward) then comes at the first real step on every site, before any site's next
    sync can block it (see docs/guides/diloco.md#rounds-by-time)."""
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.zero_grad()


def _started(diloco: DiLoCo) -> int:
    """Syncs this rank started so far (merged, plus one in flight)."""
    return diloco.stats.outer_syncs + (diloco._in_flight is not None)


def _train(rank: int, world: int, case: dict) -> dict:
    """Train to ``DiLoCo.should_stop``; with ``save``: ``(k, more)``, save after the k-th sync and ``more`` steps,
    rebuild model, DDP, inner optimizer and DiLoCo in this process, load, and go on."""
    topo, model, ddp, opt, diloco = _build(rank, case)
    plans, save_at, saved = [], None, None
    while not diloco.should_stop:
        t = diloco.stats.inner_steps + 1
        if t > 10 * TOTAL:
            raise RuntimeError(f"no stop after {t} steps")
        x, y = _rows(topo.site, topo.local_rank_in_site, t)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if case.get("save") and save_at is None and _started(diloco) == case["save"][0]:
            save_at = t + case["save"][1]
        if t == save_at:
            state = copy.deepcopy({"diloco": diloco.state_dict(), "model": model.state_dict(),
                                   "opt": opt.state_dict()})
            plans, saved = diloco.round_plans, (t, state["diloco"]["in_flight_fragment"].item())
            diloco.close()
            del diloco, opt, ddp, model
            if case.get("into"):  # into a run of the other kind of rounds: refused, before anything changes
                other = _build(rank, case | {"config": case["into"]})
                try:
                    other[-1].load_state_dict(state["diloco"])
                except ValueError as exc:
                    return {"refused": str(exc)}
                finally:
                    other[-1].close()
                return {"refused": None}
            topo, model, ddp, opt, diloco = _build(rank, case, perturb=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            diloco.load_state_dict(state["diloco"])
            _first_backward(ddp, opt, x, y)
            plans = plans[:-1]  # the loaded round is the resumed run's first plan
    state = diloco.state_dict()
    diloco.close()
    return {"site": topo.site, "plans": plans + diloco.round_plans, "steps": diloco.stats.inner_steps,
            "global": torch.cat([g.reshape(-1) for g in state["global"].values()]),
            "local": {n: p.detach().clone() for n, p in model.named_parameters()}, "saved": saved}


def _cases(layout: list[int]) -> dict:
    unbroken = {f"unbroken {name}": (_train, ({"layout": layout, "config": config},))
                for name, config in (("plain", PLAIN), ("overlap", OVERLAP))}
    refused = {f"{a} into {b}": (_train, ({"layout": layout, "config": ca, "save": (3, 0), "into": cb},))
               for (a, ca), (b, cb) in ((("time", PLAIN), ("fixed", FIXED)), (("fixed", FIXED), ("time", PLAIN)))}
    return unbroken | {name: (_train, ({"layout": layout, "config": config, "save": (k, more)},))
                       for name, (config, k, more) in SAVES.items()} | refused


@pytest.fixture(scope="module")
def two_ranks():
    return run_cases(_cases([0, 1]), 2, timeout=240)


@pytest.fixture(scope="module")
def three_ranks():
    return run_cases(_cases([0, 0, 1]), 3, timeout=240)


@pytest.mark.parametrize("layout", ["1+1", "2+1"])
@pytest.mark.parametrize("name", list(SAVES))
def test_a_resume_under_time_rounds_ends_bitwise_where_the_unbroken_run_ends(two_ranks, three_ranks, layout, name):
    results = two_ranks if layout == "1+1" else three_ranks
    config = SAVES[name][0]
    unbroken = results[f"unbroken {'overlap' if config is OVERLAP else 'plain'}"]
    resumed = results[name]
    assert len({str(r["plans"]) for r in unbroken}) == 1 and len(unbroken[0]["plans"]) >= 3, unbroken[0]["plans"]
    assert unbroken[0]["plans"][1][0] > unbroken[0]["plans"][1][1]  # the sites' step counts do differ
    if name == "in flight":
        assert all(r["saved"][1] >= 0 for r in resumed), "no sync was in flight at the save"
    saved_steps = {r["site"]: r["saved"][0] for r in resumed}
    assert saved_steps[0] != saved_steps[1], saved_steps  # each site saved at its own step count
    for a, b in zip(unbroken, resumed):
        assert b["plans"] == a["plans"] and b["steps"] == a["steps"]
        assert torch.equal(a["global"], b["global"])
        for n, value in a["local"].items():
            assert torch.equal(value, b["local"][n]), n


@pytest.mark.parametrize("direction", ["time into fixed", "fixed into time"])
def test_a_state_of_the_other_kind_of_rounds_is_refused_naming_sync_every_s(two_ranks, direction):
    for r in two_ranks[direction]:
        assert r["refused"] is not None and "sync_every_s" in r["refused"], r


@pytest.mark.parametrize(("saved", "wanted"), [(True, False), (False, True)])
def test_the_checkpoint_loader_refuses_the_other_kind_of_rounds_naming_sync_every_s(saved, wanted):
    from multidc.plugins.checkpoint.planner import _check_rounds

    common = {"diloco.inner_steps": 0, "diloco.global.fragment_0": 0}
    rounds = {"diloco.rounds.steps": 0, "diloco.rounds.per_rank.rank_0": 0}
    with pytest.raises(ValueError, match="sync_every_s"):
        _check_rounds(common | (rounds if wanted else {}), common | (rounds if saved else {}))
    _check_rounds(common | rounds, common | rounds)
    _check_rounds(common, common)
    _check_rounds({"site_0.model.w": 0}, common | rounds)  # not loading the DiLoCo state (evaluating): no check
