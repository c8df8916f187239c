"""``"auto"`` settings of DiLoCo's syncs: ``DiLoCoConfig(sync_every="auto")`` and ``WanConfig(chunk_mb="auto",
streams="auto")``. The job measures its own step time and WAN throughput and applies the planning model.

The first round runs the warm-up settings (``DiLoCoConfig.sync_every``, ``WanConfig.chunk_mb`` / ``streams``). At each
round's end (the last fragment's sync, the point where every site meets anyway) every rank puts its figures into the
round's one small all-reduce (``DiLoCo._exchange_round``, shared with rounds by time): its mean inner step time
(``StepTimer``), the bytes, seconds and count of the syncs that arrived since the previous round end
(``DiLoCoStats``), and, with a WAN setting on auto, a round-trip time measured right after the previous exchange.
``measured`` turns the gathered rows into one step time, one link rate and one round-trip time; ``decide`` applies
``multidc.hierarchical.planning`` (the equations ``multidc plan`` prints): the smallest H whose predicted compute
utilization reaches ``DiLoCoConfig.target_utilization``, and the WAN pipeline that needs the smallest H (or, with a
fixed H, predicts the highest utilization).

The first measured round (the warm-up's) is not decided on: its syncs create the communicators (NCCL and gloo build
them lazily; the first syncs are slow) and its steps are cold, so its figures would ask for too large an H; the second
warm-up round decides. A resumed run keeps the loaded decision and decides as the unbroken run would (a resume ends
where the unbroken run ends). One decision grows H at most ``MAX_GROWTH`` times the H in force (the warm-up's for the
first), which also bounds what a cold round after a resume can do; a decision the cap held back re-plans at the next
round end, until the target is reached or the cap no longer binds. Shrinking is not capped: a too small H shows itself
at the next round end.

The invariant this module protects: every rank decides alike. ``measured`` and ``decide`` read only the gathered
numbers (float64, the same on every rank) and settings every rank agreed on, so no rank can adopt another plan. A
decision is re-made only when a later round's measured link rate differs from the one it used by more than
``REPLAN_FACTOR`` (a link that degrades or recovers mid-run); step time drifts alone do not re-plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from multidc.hierarchical.compression import is_sparse
from multidc.hierarchical.config import AUTO_CHUNK_MB, AUTO_STREAMS
from multidc.hierarchical.planning.model import Job, Link, Setting, predict

REPLAN_FACTOR = 1.5
"""A measured link rate this many times above or below the decision's re-plans at the next round end: below 2, so
that a link halved (or doubled) re-plans although syncs measure a link below its line rate; above the round-to-round
scatter of measured rates (+-20% on loaded hosts), so that noise alone does not."""
WARMUP_SYNC_EVERY = 8
"""The warm-up H of ``sync_every="auto"`` (raised to ``fragments * (overlap_steps + 1)`` when that is larger)."""
DEFAULT_TARGET = 0.95
"""The target utilization when ``DiLoCoConfig.target_utilization`` is unset (only WAN settings on auto)."""
MAX_SYNC_EVERY = 1 << 20
"""The largest H ``decide`` picks: a link too slow for the target at this H gets it, marked not reached."""
MAX_GROWTH = 4
"""One decision sets H to at most this many times the H in force (the warm-up's for the first decision)."""
COLD_ROUNDS = 1
"""Measured warm-up rounds not decided on (cold communicators and steps): the first; the second decides."""

_log = logging.getLogger("multidc.hierarchical.diloco")


@dataclass(frozen=True)
class Measured:
    """One round's figures, as every rank gathered them."""

    step_s: float
    """Seconds per inner step of the slowest site (its slowest rank's mean over the round)."""
    bandwidth_bps: float
    """WAN payload rate of one site in bits/s: the site's bytes over the seconds of its syncs (less one ring of round
    trips per sync), the highest over sites (the site that waited least for the others measures closest to the link)."""
    rtt_s: float = 0.0
    """Round-trip time in seconds (0: not measured, as without a WAN setting on auto)."""


@dataclass(frozen=True)
class Decision:
    """What ``decide`` chose, with the figures it came from (logged, and saved in the DiLoCo state)."""

    sync_every: int
    """H for the rounds from now on."""
    utilization: float
    """Predicted compute utilization."""
    reached: bool
    """Whether the prediction reaches the target."""
    measured: Measured
    """The figures decided on; a later round re-plans against ``measured.bandwidth_bps``."""
    chunk_mb: float = 4.0
    """``WanConfig.chunk_mb`` of the syncs from now on."""
    streams: int = 2
    """``WanConfig.streams`` of the syncs from now on."""
    capped: bool = False
    """``MAX_GROWTH`` held H below what the target needs: the next round end re-plans."""


def warmup_sync_every(fragments: int, overlap_steps: int) -> int:
    """The warm-up H: ``WARMUP_SYNC_EVERY``, at least a round's minimum (``rounds.minimum_steps``)."""
    return max(WARMUP_SYNC_EVERY, fragments * (overlap_steps + 1))


def measured(rows: list[tuple[float, ...]], site_of: list[int], sites: int) -> Measured | None:
    """The round's figures from every rank's ``(step_s, wan_bytes, wan_s, syncs, rtt_s)`` (rank order;
    ``site_of[rank]``), or None when no rank measured a step or no site measured a sync (a round in which no sync
    arrived: the warm-up goes on).

    A site's step time is its slowest rank's. A site's rate is ``8 * (its ranks' bytes) / (their longest sync
    seconds less (sites - 1) round trips per sync)``, its rails sending in parallel; the round-trip time is the
    smallest any rank measured (0 when none did).
    """
    step, sent, seconds, syncs = [0.0] * sites, [0.0] * sites, [0.0] * sites, [0.0] * sites
    rtts = [row[4] for row in rows if row[4] > 0]
    rtt = min(rtts) if rtts else 0.0
    for rank, (step_s, wan_bytes, wan_s, count, _) in enumerate(rows):
        site = site_of[rank]
        step[site] = max(step[site], step_s)
        sent[site] += wan_bytes
        seconds[site] = max(seconds[site], wan_s)
        syncs[site] = max(syncs[site], count)
    wire = [s - n * (sites - 1) * rtt for s, n in zip(seconds, syncs)]
    rates = [8.0 * b / w for b, w in zip(sent, wire) if b > 0 and w > 0]
    if max(step) <= 0 or not rates:
        return None
    return Measured(step_s=max(step), bandwidth_bps=max(rates), rtt_s=rtt)


def decide(figures: Measured, *, params: int, sites: int, rails: int, fragments: int, overlap_steps: int,
           compression: str, pipelines: list[tuple[float, int]], target: float,
           sync_every: int | None = None, largest: int = MAX_SYNC_EVERY) -> Decision:
    """The plan for ``params`` float32 parameters synced over ``sites`` x ``rails`` at the measured step time, link
    rate and round-trip time: per WAN pipeline of ``pipelines`` (``(chunk_mb, streams)``, the one in use first) the
    smallest H (from a round's minimum to ``largest``, at most ``MAX_SYNC_EVERY``) whose predicted utilization
    reaches ``target``, or the fixed ``sync_every``; the pipeline with the smallest H, then the highest utilization,
    wins (a tie keeps the earlier one). ``Decision.capped``: the target needs more than ``largest`` (below
    ``MAX_SYNC_EVERY``), so H is ``largest``.

    Predicted utilization never falls as H grows (a round's syncs are spread over more compute), so a bisection over
    the integers finds H; pure float64 arithmetic, the same on every rank for the same arguments.
    """
    job = Job(params=params, step_s=figures.step_s, sites=sites, ranks_per_site=rails)
    link = Link(bandwidth_bps=figures.bandwidth_bps, rtt_s=figures.rtt_s)
    method = "diloco" if (fragments, overlap_steps) == (1, 0) else "streaming_diloco"
    best, lowest = None, fragments * (overlap_steps + 1)
    largest = max(lowest, min(largest, MAX_SYNC_EVERY))
    for chunk_mb, streams in pipelines:
        def utilization(h: int, chunk_mb: float = chunk_mb, streams: int = streams) -> float:
            setting = Setting(method=method, compression=compression, sync_every=h, fragments=fragments,
                              overlap_steps=overlap_steps, chunk_mb=chunk_mb, streams=streams)
            return predict(setting, job, link).utilization

        h = sync_every if sync_every is not None else _smallest_h(utilization, lowest, largest, target)
        u = utilization(h)
        if best is None or (h, -u) < (best.sync_every, -best.utilization):
            capped = sync_every is None and u < target and largest < MAX_SYNC_EVERY
            best = Decision(h, u, u >= target, figures, chunk_mb, streams, capped)
    return best


def _smallest_h(utilization, lowest: int, largest: int, target: float) -> int:
    lo, hi = lowest, largest
    if utilization(hi) < target:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if utilization(mid) >= target else (mid + 1, hi)
    return lo


def needs_replan(decision: Decision | None, figures: Measured | None) -> bool:
    """Whether a round's ``figures`` call for a (new) decision: none made yet, ``MAX_GROWTH`` held the last one back
    (``Decision.capped``), or the link rate moved by more than ``REPLAN_FACTOR`` either way from the one ``decision``
    used."""
    if figures is None:
        return False
    if decision is None or decision.capped:
        return True
    ratio = figures.bandwidth_bps / decision.measured.bandwidth_bps
    return ratio > REPLAN_FACTOR or ratio < 1 / REPLAN_FACTOR


def log_decision(decision: Decision, previous: Decision | None, *, target: float, round_index: int) -> None:
    """One INFO line with the decision and the figures it came from (call it on one rank: the job's rank 0)."""
    m = decision.measured
    why = "first decision" if previous is None else "H capped at the last decision" if previous.capped else (
        f"re-plan: link {m.bandwidth_bps / 1e6:.4g} Mbit/s vs {previous.measured.bandwidth_bps / 1e6:.4g} Mbit/s "
        f"when H={previous.sync_every} was chosen")
    capped = f", H grows at most {MAX_GROWTH}x per decision" if decision.capped else ""
    reached = "" if decision.reached else f" (target not reached{capped})"
    _log.info("DiLoCo 'auto' settings after round %d (%s): H=%d, chunk_mb=%g, streams=%d, predicted utilization "
              "%.1f%% for target %.1f%%%s; measured step %.4g s, WAN %.4g Mbit/s per site, rtt %.3g s", round_index,
              why, decision.sync_every, decision.chunk_mb, decision.streams, 100 * decision.utilization, 100 * target,
              reached, m.step_s, m.bandwidth_bps / 1e6, m.rtt_s)


class AutoSchedule:
    """The ``"auto"`` decisions of one ``DiLoCo`` (the same on every rank): fed each round end's gathered rows, it
    returns the plan of the next rounds; its state travels in the DiLoCo checkpoint (``state`` / ``load``).

    Args:
        params: elements this rank syncs per round (its fragments' sizes summed: the whole model under DDP, its
            shard under FSDP2 / TP).
        sites, rails: the topology's sites and rails (ranks of a site that carry its WAN traffic).
        fragments, overlap_steps, compression: the agreed ``DiLoCoConfig``'s.
        sync_every: None when H is on auto, else the fixed H.
        warmup: the warm-up H (``DiLoCoConfig.sync_every``): the first decision's H is at most ``MAX_GROWTH`` x it.
        pipelines: the ``(chunk_mb, streams)`` to choose from, the warm-up's first.
        target: ``DiLoCoConfig.target_utilization`` (0.95 when only WAN settings are on auto).
        log: whether this rank logs the decisions (the job's rank 0 only, so each is logged once).
    """

    def __init__(self, *, params: int, sites: int, rails: int, fragments: int, overlap_steps: int,
                 compression: str, sync_every: int | None, pipelines: list[tuple[float, int]], target: float,
                 log: bool, warmup: int = 1) -> None:
        self._plan = {"params": params, "sites": sites, "rails": rails, "fragments": fragments,
                      "overlap_steps": overlap_steps, "compression": compression, "sync_every": sync_every}
        self.pipelines, self.target, self._log, self.warmup = pipelines, target, log, warmup
        self.decision: Decision | None = None
        """The decision in force (None during the warm-up)."""
        self.rounds_ended = 0
        """Round ends seen, the warm-up's included."""
        self.cold = COLD_ROUNDS
        """Measured warm-up rounds still to leave out (0 once a decision is in force, made or loaded)."""
        self.stale = False
        """The loaded decision was made with H fixed and this run has H on auto: the next round end decides H."""

    def round_end(self, rows: list[tuple[float, ...]], site_of: list[int]) -> Decision | None:
        """A round ended with every rank's ``(step_s, wan_bytes, wan_s, syncs, rtt_s)`` gathered: the new decision when
        this round decides (the first measured round after the cold one, a capped decision's next round, the first
        after loading a decision made with H fixed, or a link rate moved by more than ``REPLAN_FACTOR``), else None.
        With one site nothing crosses a WAN and the warm-up settings stay."""
        self.rounds_ended += 1
        figures = measured(rows, site_of, self._plan["sites"])
        if figures is not None and self.cold > 0:  # the same on every rank: the figures are gathered
            self.cold -= 1
            return None
        if self._plan["sites"] < 2 or not (needs_replan(self.decision, figures) or (self.stale and figures)):
            return None
        in_use = (self.decision.chunk_mb, self.decision.streams) if self.decision is not None else None
        pipelines = sorted(self.pipelines, key=lambda p: p != in_use)  # the one in use first: a tie keeps it
        current = self.decision.sync_every if self.decision is not None else self.warmup
        decision = decide(figures, **self._plan, pipelines=pipelines, target=self.target,
                          largest=MAX_GROWTH * current)
        if self._log:
            log_decision(decision, self.decision, target=self.target, round_index=self.rounds_ended)
        self.decision, self.stale = decision, False
        return decision

    def state(self) -> list[float]:
        """``[rounds ended, H, utilization, reached, step_s, bandwidth_bps, rtt_s, chunk_mb, streams, capped, H on
        auto, cold rounds left]`` of the decision in force (H 0: none yet)."""
        d, h_auto, cold = self.decision, float(self._plan["sync_every"] is None), float(self.cold)
        if d is None:
            return [float(self.rounds_ended)] + [0.0] * 9 + [h_auto, cold]
        m = d.measured
        return [float(self.rounds_ended), float(d.sync_every), d.utilization, float(d.reached), m.step_s,
                m.bandwidth_bps, m.rtt_s, d.chunk_mb, float(d.streams), float(d.capped), h_auto, cold]

    def load(self, saved: list[float]) -> None:
        """Restore ``state()`` output (also one saved before ``capped`` and ``H on auto`` were kept: 9 numbers; or
        before the cold rounds left were: 11, which restarts the warm-up's count when no decision was in force)."""
        ended, h, utilization, reached, step_s, bandwidth, rtt, chunk_mb, streams, capped, h_auto = (
            list(saved) + [0.0, -1.0][len(saved) - 9:])[:11]
        cold = int(saved[11]) if len(saved) > 11 else (COLD_ROUNDS if h < 1 else 0)
        self.rounds_ended, self.cold = int(ended), cold
        self.stale = h >= 1 and h_auto == 0 and self._plan["sync_every"] is None
        figures = Measured(step_s, bandwidth, rtt)
        self.decision = None if h < 1 else Decision(int(h), utilization, bool(reached), figures, chunk_mb, int(streams),
                                                    bool(capped))


def auto_schedule(config, wan, topology, fragments: list) -> AutoSchedule:
    """The ``AutoSchedule`` of a DiLoCo with ``"auto"`` settings: its agreed ``DiLoCoConfig``, the syncs' ``WanConfig``
    and ``Topology``, its fragments (``DiLoCo._fragments``). Streams on auto choose up to what the topology prepared
    (``Topology.build`` prepares ``AUTO_STREAMS[-1]`` for ``streams="auto"``).

    Raises:
        ValueError: ``chunk_mb="auto"`` with a top-k codec, or WAN settings on auto with rounds by time
            (``sync_every_s``): on every rank alike, the settings are agreed.
    """
    if config.sync_every_s is not None:
        raise ValueError(
            f"WanConfig chunk_mb/streams='auto' with DiLoCoConfig.sync_every_s={config.sync_every_s}: the WAN "
            f"pipeline is decided at the ends of fixed or 'auto' rounds, not yet with rounds by time. Give chunk_mb "
            f"and streams numbers (MULTIDC_WAN_CHUNK_MB, MULTIDC_WAN_STREAMS), or unset sync_every_s."
        )
    if wan.chunk_mb_auto and is_sparse(config.compression):
        raise ValueError(
            f"WanConfig.chunk_mb='auto' with compression={config.compression!r}: each rank's top-k error-feedback "
            f"residuals follow the chunk plan, so a new chunk_mb mid-run would restart them at zero. Give chunk_mb a "
            f"number (MULTIDC_WAN_CHUNK_MB); streams='auto' is fine."
        )
    chunks = AUTO_CHUNK_MB if wan.chunk_mb_auto else (wan.chunk_mb,)
    streams = [n for n in AUTO_STREAMS if n <= topology.streams] if wan.streams_auto else [wan.streams]
    current = (wan.chunk_mb, wan.streams)
    pipelines = [current] + [(c, n) for c in chunks for n in streams if (c, n) != current]
    return AutoSchedule(
        # what the WAN carries per sync: under unequal parallel_3d sites (common_layout) the full fragment, the
        # same on every site, not this rank's shard (the sites would otherwise decide differently)
        params=sum(f.common.numel if getattr(f, "common", None) is not None else f.global_flat.numel()
                   for f in fragments), sites=topology.num_sites, rails=topology.num_rails,
        fragments=config.fragments, overlap_steps=config.overlap_steps, compression=config.compression,
        sync_every=None if config.sync_every_auto else config.sync_every, pipelines=pipelines,
        target=config.target_utilization or DEFAULT_TARGET, log=dist.get_rank() == 0, warmup=config.sync_every)


def check_auto_saved(saved: bool, wanted: bool) -> None:
    """Refuse a DiLoCo state saved with ``"auto"`` settings into a run without them, or the reverse: the saved plan
    (the H and WAN pipeline in force, where its round began) would be dropped, or missing.

    Raises:
        ValueError: ``saved != wanted``, naming the settings.
    """
    if saved != wanted:
        how = ("with 'auto' settings", "without 'auto' settings")
        raise ValueError(f"the DiLoCo state was saved {how[not saved]} (DiLoCoConfig.sync_every, WanConfig.chunk_mb / "
                         f"streams), but this run is {how[not wanted]}; resume with the settings it was saved with.")
