"""``DiLoCoConfig(sync_every="auto")``: the decision against the planning model's equations by hand, the settings,
and real gloo ranks (2 sites x 1 rank) whose measured step times differ (a fake clock per rank) and whose WAN rate
drops 3x mid-run (a fake throughput): every rank adopts the same H, logged once, decided on the second round (the first
measures cold communicators); the drop re-plans at the next round end; the merge equals the single-process reference
of the adopted plan; a resume ends bitwise where the unbroken run ends; a resume into a fixed H keeps that H."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import DiLoCo, DiLoCoConfig, Topology, WanConfig, register_site_ddp_hook
from multidc.hierarchical.diloco.auto import (
    MAX_GROWTH,
    MAX_SYNC_EVERY,
    AutoSchedule,
    Decision,
    Measured,
    auto_schedule,
    check_auto_saved,
    decide,
    measured,
    needs_replan,
)
from multidc.hierarchical.planning import Job, Link, Setting, predict, wan_bytes_per_sync
from tests._batched import run_cases
from tests._diloco_state import named_global
from tests.diloco_reference import LR, run_round_reference
from tests.diloco_reference import model as _model
from tests.diloco_reference import rows as _rows

pytestmark = pytest.mark.timeout(300)
TARGET = 0.95
CLOCK = [0.01, 0.03]  # seconds per inner step on site 0 and site 1 (fake): the job's step time is the slower one
RATE, DROP_AFTER = 1e6, 24  # the WAN's bits/s; from inner step 25 on it is 3x slower
PLAIN = {"sync_every": "auto"}
OVERLAP = {"sync_every": "auto", "fragments": 2, "overlap_steps": 1}


def _blocking_h(comm_s: float, step_s: float, target: float) -> int:
    """H for blocking DiLoCo by hand: utilization s / (s + T / H) >= target  <=>  H >= T target / (s (1 - target))."""
    return math.ceil(comm_s * target / (step_s * (1 - target)))


@pytest.mark.parametrize(("params", "step_s", "rate"), [(1_000_000, 0.3, 8e6), (3_000_000, 0.5, 1e9), (756, 0.03, 1e6)])
def test_blocking_diloco_gets_the_smallest_h_the_equation_allows(params, step_s, rate):
    payload, _ = wan_bytes_per_sync(params, 4, Setting(method="diloco", chunk_mb=4.0), Job(params=params, step_s=1))
    assert payload == params * 4  # 2 sites, one rail: a ring all-reduce sends 2 (k-1) / k of the float32 shard
    expected = _blocking_h(8 * payload / rate, step_s, TARGET)
    decision = decide(Measured(step_s, rate), params=params, sites=2, rails=1, fragments=1, overlap_steps=0,
                      compression="none", pipelines=[(4.0, 2)], target=TARGET)
    assert decision.sync_every == max(1, expected) and decision.reached
    assert decision.utilization >= TARGET


@pytest.mark.parametrize(("fragments", "overlap", "codec", "rate"), [(4, 1, "int8", 2e6), (2, 0, "none", 1e5),
                                                                     (4, 2, "int4", 1e4)])
def test_streaming_h_is_the_first_one_a_scan_of_the_model_accepts(fragments, overlap, codec, rate):
    params, step_s = 200_000, 0.2
    job, link = Job(params=params, step_s=step_s, sites=3, ranks_per_site=2), Link(bandwidth_bps=rate)

    def util(h: int) -> float:
        return predict(Setting(method="streaming_diloco", compression=codec, sync_every=h, fragments=fragments,
                               overlap_steps=overlap, chunk_mb=4.0), job, link).utilization

    scan = next(h for h in range(fragments * (overlap + 1), 100_000) if util(h) >= TARGET)
    decision = decide(Measured(step_s, rate), params=params, sites=3, rails=2, fragments=fragments,
                      overlap_steps=overlap, compression=codec, pipelines=[(4.0, 2)], target=TARGET)
    assert decision.sync_every == scan and decision.utilization == util(scan)


def test_a_link_too_slow_for_the_target_gets_the_largest_h_marked_not_reached():
    decision = decide(Measured(1e-6, 1.0), params=10**9, sites=2, rails=1, fragments=1, overlap_steps=0,
                      compression="none", pipelines=[(4.0, 2)], target=TARGET)
    assert decision.sync_every == MAX_SYNC_EVERY and not decision.reached and decision.utilization < TARGET


def test_measured_takes_the_slowest_site_step_and_the_least_waiting_site_rate():
    # rows: (step_s, bytes, seconds, syncs, rtt_s) per rank; ranks 0, 1 in site 0 (rails in parallel), rank 2 in site 1
    rows = [(0.01, 1000.0, 0.5, 1, 0.0), (0.02, 3000.0, 1.0, 1, 0.0), (0.015, 4000.0, 4.0, 1, 0.0)]
    got = measured(rows, [0, 0, 1], 2)
    assert got == Measured(step_s=0.02, bandwidth_bps=max(8 * 4000 / 1.0, 8 * 4000 / 4.0))
    assert measured([(0.01, 0.0, 0.0, 0, 0.0), (0.02, 0.0, 0.0, 0, 0.0)], [0, 1], 2) is None  # no sync arrived yet
    assert measured([(0.0, 10.0, 1.0, 1, 0.0), (0.0, 10.0, 1.0, 1, 0.0)], [0, 1], 2) is None  # no step measured


def test_measured_takes_one_ring_of_round_trips_per_sync_off_the_seconds():
    # 2 syncs of 0.5 s with a 0.1 s round trip: 0.4 s on the wire each; 3 sites: two round trips per ring
    rows = [(0.2, 1e6, 1.0, 2, 0.1), (0.2, 1e6, 1.0, 2, 0.15), (0.2, 1e6, 1.0, 2, 0.0)]
    got = measured(rows, [0, 1, 2], 3)
    assert got.rtt_s == 0.1 and got.bandwidth_bps == pytest.approx(8e6 / (1.0 - 2 * 2 * 0.1))


def test_on_a_long_link_the_pipeline_with_fewer_round_trips_wins_as_computed_by_hand():
    # 16 MiB of float32 over 2 sites x 1 rail at 1 Gbit/s: 0.134 s on the wire; a round trip of 0.1 s.
    # chunk 4 MiB (4 chunks), 2 streams: max(0.134, 2 x 0.1) + 0.1 = 0.3 s; 1 stream: 0.5 s; 4 streams:
    # max(0.134, 0.1) + 0.1 = 0.234 s; chunk 16 MiB (1 chunk), 1 stream: 0.234 s too (a tie keeps the earlier)
    params, step_s, h = 4 * 1048576, 0.5, 16
    pipelines = [(4.0, 2), (4.0, 1), (4.0, 4), (16.0, 1), (16.0, 2)]
    decision = decide(Measured(step_s, 1e9, 0.1), params=params, sites=2, rails=1, fragments=1, overlap_steps=0,
                      compression="none", pipelines=pipelines, target=TARGET, sync_every=h)
    wire = 8 * params * 4 / 1e9
    assert (decision.chunk_mb, decision.streams, decision.sync_every) == (4.0, 4, h)
    assert decision.utilization == pytest.approx(step_s / (step_s + (max(wire, 0.1) + 0.1) / h))
    # with H on auto too, the same pipeline needs the smallest H: ceil(0.234 x 0.95 / (0.5 x 0.05)) = 9
    both = decide(Measured(step_s, 1e9, 0.1), params=params, sites=2, rails=1, fragments=1, overlap_steps=0,
                  compression="none", pipelines=pipelines, target=TARGET)
    assert (both.chunk_mb, both.streams, both.sync_every) == (4.0, 4, _blocking_h(max(wire, 0.1) + 0.1, step_s,
                                                                                    TARGET))


@pytest.mark.parametrize(("rate", "replan"), [(1.51e6, True), (0.5e6, True), (0.66e6, True), (1.45e6, False),
                                             (0.7e6, False)])
def test_only_a_rate_more_than_1_5x_away_from_the_decisions_re_plans(rate, replan):
    decision = Decision(16, 0.96, True, Measured(0.03, 1e6))
    assert needs_replan(decision, Measured(0.5, rate)) is replan  # the step time alone never re-plans
    assert needs_replan(None, Measured(0.5, rate)) and not needs_replan(decision, None)


def _schedule(**kwargs) -> AutoSchedule:
    plan = {"params": 756, "sites": 2, "rails": 1, "fragments": 1, "overlap_steps": 0, "compression": "none",
            "sync_every": None, "pipelines": [(4.0, 2)], "target": TARGET, "log": False, "warmup": 8}
    return AutoSchedule(**(plan | kwargs))


def _round(step_s: float, rate: float, sync_bytes: float = 756 * 4) -> list[tuple[float, ...]]:
    """Two sites' rows of one round with one sync of ``sync_bytes`` at ``rate`` bits/s."""
    return [(step_s, sync_bytes, 8 * sync_bytes / rate, 1, 0.0)] * 2


def test_a_slow_first_sync_is_left_out_and_the_second_round_decides():
    schedule = _schedule()
    assert schedule.round_end(_round(0.03, RATE / 100), [0, 1]) is None  # cold: 100x slower, not decided on
    decision = schedule.round_end(_round(0.03, RATE), [0, 1])
    assert decision.sync_every == _blocking_h(8 * 756 * 4 / RATE, 0.03, TARGET) == 16 and decision.reached
    assert decision.measured.bandwidth_bps == pytest.approx(RATE)
    assert schedule.round_end(_round(0.03, RATE), [0, 1]) is None  # same link: no re-plan
    resumed = _schedule()
    resumed.load(schedule.state())  # a loaded decision is in force: the next round decides as the unbroken run's
    assert resumed.round_end(_round(0.03, RATE / 100), [0, 1]).sync_every == 16 * MAX_GROWTH
    unsettled = _schedule()
    unsettled.load(_schedule().state())  # saved in the warm-up: the first measured round is still left out
    assert unsettled.round_end(_round(0.03, RATE / 100), [0, 1]) is None
    # saved after the cold round, before the decision: the resumed run decides at the same round end as the unbroken
    # one (it restarted the warm-up's count and decided a round later)
    unbroken, resumed = _schedule(), _schedule()
    assert unbroken.round_end(_round(0.03, RATE / 100), [0, 1]) is None
    resumed.load(unbroken.state())
    assert resumed.round_end(_round(0.03, RATE), [0, 1]) == unbroken.round_end(_round(0.03, RATE), [0, 1]) is not None


def test_one_decision_grows_h_at_most_4x_and_a_capped_one_re_plans_at_the_next_round_end():
    step_s, rate = 0.03, RATE / 20
    uncapped = decide(Measured(step_s, rate), params=756, sites=2, rails=1, fragments=1, overlap_steps=0,
                      compression="none", pipelines=[(4.0, 2)], target=TARGET).sync_every
    assert uncapped == _blocking_h(8 * 756 * 4 / rate, step_s, TARGET) == 307
    schedule = _schedule()
    schedule.round_end(_round(step_s, rate), [0, 1])  # cold
    chosen = [schedule.round_end(_round(step_s, rate), [0, 1]) for _ in range(4)]
    assert [d.sync_every for d in chosen[:3]] == [8 * MAX_GROWTH, 8 * MAX_GROWTH ** 2, uncapped]
    assert [(d.capped, d.reached) for d in chosen[:3]] == [(True, False), (True, False), (False, True)]
    assert chosen[3] is None  # the target reached: no re-plan on the same link
    faster = schedule.round_end(_round(step_s, rate * 20), [0, 1])  # shrinking is not capped
    assert faster.sync_every == 16 and not faster.capped
    fixed = _schedule(sync_every=8)  # a fixed H is never capped
    fixed.round_end(_round(step_s, rate), [0, 1])
    held = fixed.round_end(_round(step_s, rate), [0, 1])
    assert (held.sync_every, held.capped, held.reached) == (8, False, False)


def test_a_decision_made_with_h_fixed_loaded_into_h_on_auto_decides_h_at_the_next_round_end():
    fixed = _schedule(sync_every=8, pipelines=[(4.0, 2), (4.0, 1)])  # WAN settings on auto, H fixed
    fixed.round_end(_round(0.03, RATE), [0, 1])
    assert fixed.round_end(_round(0.03, RATE), [0, 1]).sync_every == 8
    on_auto = _schedule(pipelines=[(4.0, 2), (4.0, 1)])
    on_auto.load(fixed.state())
    decision = on_auto.round_end(_round(0.03, RATE), [0, 1])  # the same link: only the loaded H's origin re-plans
    assert decision.sync_every == 16 and on_auto.round_end(_round(0.03, RATE), [0, 1]) is None
    again = _schedule(sync_every=8)
    again.load(fixed.state())  # fixed into fixed: nothing to re-decide on the same link
    assert again.round_end(_round(0.03, RATE), [0, 1]) is None
    legacy = _schedule()
    legacy.load(fixed.state()[:9])  # a state of 9 numbers (before capped and H-on-auto were kept) loads as it was
    assert legacy.decision.sync_every == 8 and legacy.round_end(_round(0.03, RATE), [0, 1]) is None


def test_auto_holds_the_warm_up_h_and_the_default_target(monkeypatch):
    config = DiLoCoConfig(sync_every="auto")
    assert (config.sync_every, config.sync_every_auto, config.target_utilization) == (8, True, 0.95)
    assert DiLoCoConfig(sync_every="AUTO", fragments=4, overlap_steps=2).sync_every == 12  # a round's minimum
    assert DiLoCoConfig(sync_every=20, sync_every_auto=True).sync_every == 20  # a warm-up H of one's own
    monkeypatch.setenv("MULTIDC_DILOCO_SYNC_EVERY", "auto")
    monkeypatch.setenv("MULTIDC_DILOCO_TARGET_UTILIZATION", "0.9")
    assert (DiLoCoConfig().sync_every_auto, DiLoCoConfig().target_utilization) == (True, 0.9)
    copied = dataclasses.replace(DiLoCoConfig(), compression="int8")  # as front-ends copy configs
    assert (copied.sync_every, copied.sync_every_auto, copied.target_utilization) == (8, True, 0.9)


@pytest.mark.parametrize(("kwargs", "env", "message"), [
    ({"sync_every": "often"}, {}, r"DiLoCoConfig.sync_every='often'.*or 'auto'"),
    ({"sync_every": 8, "target_utilization": 0.9}, {}, "target_utilization=0.9.*sync_every is not 'auto'"),
    ({"sync_every": "auto", "target_utilization": 1.0}, {}, r"target_utilization=1.0.*\(0, 1\)"),
    ({"sync_every": "auto", "sync_every_s": 5.0}, {}, "sync_every_s=5.0.*both decide"),
    ({}, {"MULTIDC_DILOCO_SYNC_EVERY": "soon"}, r"MULTIDC_DILOCO_SYNC_EVERY='soon' is not an integer \(nor 'auto'\)"),
    ({"sync_every": "auto"}, {"MULTIDC_DILOCO_TARGET_UTILIZATION": "2"}, "MULTIDC_DILOCO_TARGET_UTILIZATION=2.0"),
])
def test_bad_auto_settings_name_the_field_or_variable(monkeypatch, kwargs, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        DiLoCoConfig(**kwargs)


def test_wan_auto_starts_at_the_defaults_and_prepares_the_most_streams(monkeypatch):
    wan = WanConfig(chunk_mb="auto", streams="Auto")
    assert (wan.chunk_mb, wan.streams, wan.chunk_mb_auto, wan.streams_auto, wan.prepared_streams) == (4.0, 2, True,
                                                                                                       True, 8)
    assert WanConfig(streams=3).prepared_streams == 3
    monkeypatch.setenv("MULTIDC_WAN_CHUNK_MB", "auto")
    assert WanConfig().chunk_mb_auto and not WanConfig().streams_auto
    monkeypatch.setenv("MULTIDC_WAN_STREAMS", "many")
    with pytest.raises(ValueError, match=r"MULTIDC_WAN_STREAMS='many' is not an integer \(nor 'auto'\)"):
        WanConfig()
    with pytest.raises(ValueError, match=r"WanConfig.chunk_mb='big' \(also settable via MULTIDC_WAN_CHUNK_MB\)"):
        WanConfig(chunk_mb="big", streams=2)


def test_per_step_all_reduces_and_top_k_refuse_what_they_cannot_follow():
    with pytest.raises(ValueError, match="register_ddp_hook does not decide WanConfig.streams='auto'"):
        WanConfig(streams="auto").refuse_auto("register_ddp_hook")
    WanConfig(chunk_mb=8).refuse_auto("register_ddp_hook")
    topology = SimpleNamespace(streams=8, num_sites=2, num_rails=1)
    with pytest.raises(ValueError, match="chunk_mb='auto' with compression='topk.*residuals follow the chunk plan"):
        auto_schedule(DiLoCoConfig(sync_every=8, compression="topk"), WanConfig(chunk_mb="auto"), topology, [])


def test_front_ends_refuse_wan_auto_for_per_step_all_reduce_and_pass_it_to_diloco():
    from multidc.hierarchical.cross_site import cross_site_sync

    with pytest.raises(ValueError, match="per-step all-reduce .*chunk_mb='auto'"):
        cross_site_sync(wan=WanConfig(chunk_mb="auto"))
    sync = cross_site_sync(wan=WanConfig(chunk_mb="auto", streams="auto"), diloco=DiLoCoConfig(sync_every="auto"))
    assert sync.wan.streams_auto and sync.diloco_config.sync_every_auto
    with pytest.raises(ValueError, match="elastic sites does not decide WanConfig.streams='auto'"):
        cross_site_sync(wan=WanConfig(streams="auto"), elastic=True)


def test_elastic_diloco_refuses_auto_with_the_reason():
    from multidc.hierarchical.elastic.diloco import check_elastic_config

    with pytest.raises(ValueError, match="elastic DiLoCo does not support sync_every='auto'"):
        check_elastic_config(DiLoCoConfig(sync_every="auto"))


def test_a_state_of_the_other_kind_is_refused_naming_sync_every():
    check_auto_saved(True, True)
    check_auto_saved(False, False)
    with pytest.raises(ValueError, match="saved with 'auto' settings .* but this run is without 'auto' settings"):
        check_auto_saved(True, False)


@pytest.mark.parametrize(("saved", "wanted"), [(True, False), (False, True)])
def test_the_checkpoint_loader_refuses_a_state_of_the_other_kind_naming_the_auto_settings(saved, wanted):
    from multidc.plugins.checkpoint.planner import _check_rounds

    common = {"diloco.inner_steps": 0, "diloco.global.fragment_0": 0}
    auto = {"diloco.auto.steps": 0, "diloco.auto.decision": 0}
    with pytest.raises(ValueError, match="'auto' settings"):
        _check_rounds(common | (auto if wanted else {}), common | (auto if saved else {}))
    _check_rounds(common | auto, common | auto)


class _FakeLink:
    """A WAN of ``RATE`` bits/s, 3x slower from inner step ``DROP_AFTER + 1`` on: the seconds of the syncs that
    arrived since the previous call are their bytes at the rate of the step the call is made at."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco, self.bytes, self.seconds = diloco, 0, 0.0

    def __call__(self) -> tuple[int, float]:
        sent = self.diloco.stats.bytes_sent
        rate = RATE if self.diloco.stats.inner_steps <= DROP_AFTER else RATE / 3
        self.seconds += 8 * (sent - self.bytes) / rate
        self.bytes = sent
        return sent, self.seconds, self.diloco._arrived


def _build(rank: int, config: dict, wan: dict | None = None):
    topo = Topology.build(site=rank, wan=WanConfig(**wan) if wan else None)
    model = _model()
    ddp = DistributedDataParallel(model)
    register_site_ddp_hook(ddp, topo)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    diloco = DiLoCo(ddp, opt, topo, DiLoCoConfig(**config))
    diloco._timer.clock = lambda: diloco.stats.inner_steps * CLOCK[rank]
    diloco._traffic = _FakeLink(diloco)
    return topo, model, ddp, opt, diloco


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank: int, world: int, case: dict) -> dict:
    """Train ``total`` steps; with ``save``: save after that step, rebuild everything in this process, load, go on
    (``into``: load into a run of these settings instead, and report the refusal)."""
    records = _Records()
    log = logging.getLogger("multidc.hierarchical.diloco")
    log.addHandler(records)
    log.setLevel(logging.INFO)
    topo, model, ddp, opt, diloco = _build(rank, case["config"])
    plans = []
    try:
        for t in range(1, case["total"] + 1):
            x, y = _rows(topo.site, 0, t)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if t != case.get("save"):
                continue
            state = copy.deepcopy({"diloco": diloco.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()})
            plans = diloco.round_plans[:-1]  # the loaded round is the resumed run's first plan
            diloco.close()
            topo, model, ddp, opt, diloco = _build(rank, case.get("into", case["config"]), case.get("into_wan"))
            if "into" in case and "into_wan" not in case:
                try:
                    diloco.load_state_dict(state["diloco"])
                except ValueError as exc:
                    return {"refused": str(exc)}
                return {"refused": None}
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            diloco.load_state_dict(state["diloco"])
            nn.functional.mse_loss(ddp(x), y).backward()  # DDP's bucket rebuild before the next sync (see the
            opt.zero_grad()  # rounds-by-time resume test)
        state = diloco.state_dict()
    finally:
        diloco.close()
        log.removeHandler(records)
    return {"plans": plans + diloco.round_plans, "logs": [m for m in records.lines if "'auto' settings" in m],
            "global": torch.cat([g.reshape(-1) for g in state["global"].values()]),
            "named_global": named_global(model, diloco.config.fragments, state),
            "local": {n: p.detach().clone() for n, p in model.named_parameters()},
            "bytes_per_sync": diloco.stats.bytes_sent / max(1, diloco.stats.outer_syncs), "auto": state["auto"]}


WAN_RTT, WAN_RATE, WAN_H = 0.1, 1e9, 2


def _wan_batch(site: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * site + step)
    return torch.randn(4, 512, generator=g), torch.randn(4, 512, generator=g)


def _wan_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512, bias=False))  # 1 MiB of float32: 4 chunks of the warm-up's 0.25 MiB


def _train_wan(rank: int, world: int) -> dict:
    """WAN settings on auto, H fixed: a faked link of ``WAN_RATE`` with round trips of ``WAN_RTT`` (each sync takes
    its bytes at the rate plus one round trip), 3 rounds."""
    # a warm-up chunk of 0.25 MiB (instead of 4) keeps the model small
    topo = Topology.build(site=rank, wan=WanConfig(chunk_mb=0.25, chunk_mb_auto=True, streams="auto"))
    model = _wan_model()
    ddp = DistributedDataParallel(model)
    register_site_ddp_hook(ddp, topo)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    records = _Records()
    logging.getLogger("multidc.hierarchical.diloco").addHandler(records)
    logging.getLogger("multidc.hierarchical.diloco").setLevel(logging.INFO)
    diloco = DiLoCo(ddp, opt, topo, DiLoCoConfig(sync_every=WAN_H))
    diloco._timer.clock = lambda: diloco.stats.inner_steps * 0.5
    diloco._timer._warmup = 0  # the fake clock has no warm-up step: measure the first round's one gap
    diloco._rtt, diloco._ping = WAN_RTT, lambda: WAN_RTT
    diloco._traffic = lambda: (diloco.stats.bytes_sent, diloco.stats.bytes_sent * 8 / WAN_RATE
                               + diloco._arrived * WAN_RTT, diloco._arrived)
    pipelines = []
    try:
        for t in range(1, 3 * WAN_H + 1):
            x, y = _wan_batch(topo.site, t)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            pipelines.append((diloco.wan.chunk_mb, diloco.wan.streams))
        state = diloco.state_dict()
    finally:
        diloco.close()
        logging.getLogger("multidc.hierarchical.diloco").removeHandler(records)
    return {"pipelines": pipelines, "global": state["global"]["fragment_0"].clone(), "logs": records.lines,
            "bytes_per_sync": diloco.stats.bytes_sent / diloco.stats.outer_syncs}


@pytest.fixture(scope="module")
def two_sites():
    cases = {"plain": (_train, ({"config": PLAIN, "total": 78},)),
             "resumed": (_train, ({"config": PLAIN, "total": 78, "save": 20},)),
             "overlap": (_train, ({"config": OVERLAP, "total": 60},)),
             "into fixed": (_train, ({"config": PLAIN, "total": 30, "save": 30, "into": {"sync_every": 8}},)),
             "into fixed, wan auto": (_train, ({"config": PLAIN, "total": 46, "save": 30, "into": {"sync_every": 8},
                                                "into_wan": {"chunk_mb": "auto"}},)),
             "wan": (_train_wan, ())}
    return run_cases(cases, 2, timeout=240)


def test_every_rank_adopts_the_h_of_the_slower_site_and_the_drop_re_plans_at_the_next_round_end(two_sites):
    results = two_sites["plain"]
    bytes_per_sync = results[0]["bytes_per_sync"]
    assert bytes_per_sync == 756 * 4  # the model's float32 parameters, a 2-site ring: as the planner counts them
    first = _blocking_h(8 * bytes_per_sync / RATE, max(CLOCK), TARGET)
    dropped = _blocking_h(8 * bytes_per_sync / (RATE / 3), max(CLOCK), TARGET)
    assert (first, dropped) == (16, 46)
    # warm-up 8, twice (the first round's figures are cold); decided at step 16; the round ending at 32 measured the
    # new rate (from step 25 on)
    expected = [(8, 8), (8, 8), (16, 16), (46, 46), (46, 46)]
    assert all(r["plans"] == expected for r in results), [r["plans"] for r in results]
    assert len(results[0]["logs"]) == 2 and results[1]["logs"] == []  # once per decision, on rank 0
    assert "chunk_mb=4, streams=2" in results[0]["logs"][0]  # WAN settings not on auto stay
    assert "H=16" in results[0]["logs"][0] and "re-plan" in results[0]["logs"][1] and "H=46" in results[0]["logs"][1]
    saved = results[0]["auto"]  # the plan in force and the rate it was decided on
    assert int(saved["steps"]) == 46 and saved["decision"][5].item() == pytest.approx(RATE / 3)


def test_the_merge_equals_the_single_process_reference_of_the_adopted_plan(two_sites):
    results = two_sites["plain"]
    plans = results[0]["plans"][:-1]  # the round starting at step 78 never ran
    reference = run_round_reference(
        _model(), plans=plans, batch=lambda s, t: _rows(s, 0, t), loss_fn=nn.functional.mse_loss,
        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9))
    assert reference["steps"] == [78, 78]
    for r in results:
        for name, value in r["named_global"].items():
            torch.testing.assert_close(value, reference["global"][name], rtol=0, atol=1e-6)
    assert torch.equal(results[0]["global"], results[1]["global"])


def test_with_overlap_every_rank_adopts_the_same_plans_and_global_parameters(two_sites):
    results = two_sites["overlap"]
    plans = results[0]["plans"]
    assert all(r["plans"] == plans for r in results)
    assert plans[0] == (8, 8) and len({p for p in plans[1:]}) >= 2, plans  # decided, then re-planned after the drop
    assert torch.equal(results[0]["global"], results[1]["global"])


def test_a_resume_mid_round_ends_bitwise_where_the_unbroken_run_ends(two_sites):
    for unbroken, resumed in zip(two_sites["plain"], two_sites["resumed"]):
        assert resumed["plans"] == unbroken["plans"]
        assert torch.equal(resumed["global"], unbroken["global"])
        for name, value in unbroken["local"].items():
            assert torch.equal(value, resumed["local"][name]), name


def test_an_auto_state_into_a_fixed_run_is_refused_on_every_rank(two_sites):
    assert all(r["refused"] and "saved with 'auto' settings" in r["refused"] for r in two_sites["into fixed"])


def test_an_auto_h_state_resumed_with_a_fixed_h_and_wan_on_auto_runs_the_fixed_h_from_the_resume(two_sites):
    results = two_sites["into fixed, wan auto"]
    # saved at step 30 inside the round 16-32 of the auto H 16; resumed with H 8: new rounds from 30 (not 32, 48)
    assert all(r["plans"] == [(8, 8), (8, 8), (8, 8), (8, 8), (8, 8)] for r in results), [r["plans"] for r in results]
    # one sync per site pairs the 14 steps before the save with the first 8 after it: a round of 22
    reference = run_round_reference(
        _model(), plans=[(8, 8), (8, 8), (22, 22), (8, 8)], batch=lambda s, t: _rows(s, 0, t),
        loss_fn=nn.functional.mse_loss, inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9))
    for r in results:
        for name, value in r["named_global"].items():
            torch.testing.assert_close(value, reference["global"][name], rtol=0, atol=1e-6)


def test_wan_settings_on_auto_switch_every_rank_to_the_pipeline_with_fewer_round_trips_at_a_round_end(two_sites):
    results = two_sites["wan"]
    assert results[0]["bytes_per_sync"] == 512 * 512 * 4  # the float32 weight, a 2-site ring
    # 4 chunks in 2 streams: 2 rings of round trips + 1 to fill = 0.3 s a sync; decided at the second round's end:
    # the first candidate with one ring, 4 MiB (one chunk) in 1 stream: max(8 MiB / 1 Gbit/s, 0.1) + 0.1 = 0.2 s
    expected = [(0.25, 2)] * (2 * WAN_H - 1) + [(4.0, 1)] * (WAN_H + 1)  # the first round is cold
    assert all(r["pipelines"] == expected for r in results), [r["pipelines"] for r in results]
    assert len([m for m in results[0]["logs"] if "chunk_mb=4, streams=1" in m]) == 1 and results[1]["logs"] == []
    reference = run_round_reference(
        _wan_model(), plans=[(WAN_H, WAN_H)] * 3, batch=_wan_batch, loss_fn=nn.functional.mse_loss,
        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    for r in results:  # the syncs under either pipeline sum the same values
        torch.testing.assert_close(r["global"], reference["global"]["0.weight"].reshape(-1), rtol=0, atol=1e-6)


def test_wan_settings_on_auto_with_rounds_by_time_are_refused_naming_both():
    from multidc.hierarchical.diloco.auto import auto_schedule

    with pytest.raises(ValueError, match=r"chunk_mb/streams='auto' with DiLoCoConfig.sync_every_s=1.5"):
        auto_schedule(DiLoCoConfig(sync_every=4, sync_every_s=1.5), WanConfig(streams="auto"), None, [])


def test_auto_plans_with_the_fragment_the_wan_carries_under_unequal_sites(monkeypatch):
    from multidc.hierarchical.diloco import auto

    monkeypatch.setattr(auto.dist, "get_rank", lambda: 0)  # no process group: one process

    topo = SimpleNamespace(num_sites=2, num_rails=1, streams=2)
    shard = SimpleNamespace(global_flat=torch.zeros(10), common=SimpleNamespace(numel=40))  # a quarter of the whole
    plain = SimpleNamespace(global_flat=torch.zeros(7))
    schedule = auto.auto_schedule(DiLoCoConfig(sync_every="auto"), WanConfig(), topo, [shard, plain])
    assert schedule._plan["params"] == 47  # the full fragment (the same on every site), not this rank's 10
