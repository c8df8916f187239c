"""``DiLoCo``: sites train alone for ``sync_every`` inner steps, then average pseudo-gradients over the WAN.

The invariant it protects: every rank of the topology holds bitwise-identical global parameters and outer
optimizer state after every sync. Pseudo-gradients ``global - local`` are averaged with the hierarchical
all-reduce in ``replicated`` mode (replicas inside a site are identical, so each rank sends only its share over
its rail; compressed shards are decoded and summed in float32 in site order), and the outer optimizer then makes
the same update everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical.all_reduce import all_reduce
from multidc.hierarchical.compression import is_sparse
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.diloco import error_feedback
from multidc.hierarchical.diloco.auto import AutoSchedule, auto_schedule, check_auto_saved
from multidc.hierarchical.diloco.config import DiLoCoConfig, agree_model
from multidc.hierarchical.diloco.fragments import local_tensor
from multidc.hierarchical.diloco.outer import init_state, is_state_init_step, load_outer_state, outer_state
from multidc.hierarchical.diloco.rounds import (
    Rounds,
    StepTimer,
    check_rounds_saved,
    exchange,
    minimum_steps,
    next_round,
    ping,
)
from multidc.hierarchical.topology import FailFast, Topology

_log = logging.getLogger("multidc.hierarchical.diloco")


@dataclass
class DiLoCoStats:
    """This rank's DiLoCo figures since construction."""

    inner_steps: int = 0
    """``step()`` calls: inner optimizer steps."""
    outer_syncs: int = 0
    """Fragment syncs merged (one per fragment every ``sync_every`` steps)."""
    bytes_sent: int = 0
    """Payload bytes this rank sent to other sites (``WanStats`` accounting), pseudo-gradients only."""
    exposed_s: float = 0.0
    """Seconds ``step()`` spent on syncs: the whole sync when it blocks, the wait for the result with overlap."""
    wan_s: float = 0.0
    """Seconds the syncs' all-reduces took, start to finish (``WanStats.seconds``): their WAN throughput is
    ``bytes_sent / wan_s``."""


@dataclass
class _Fragment:
    params: list[torch.Tensor]
    """This rank's local tensors of the fragment's parameters (DTensor shards: the local shard)."""
    global_flat: torch.Tensor
    """The float32 global parameters, one flat buffer; ``global_views`` are its pieces, shaped like ``params``."""
    global_views: list[torch.Tensor]
    outer: torch.optim.Optimizer
    offset: int
    """Inner step (mod sync_every) at which this fragment's sync starts."""
    residual: torch.Tensor | None = None
    """Error feedback (top-k codecs): float32, what the codec dropped from this rank's share of the last sync."""
    common: Any = None
    """The fragment in ``DiLoCo``'s ``common_layout`` (``gather`` / ``take``), or None: syncs use ``params`` as held."""


@dataclass
class _InFlight:
    fragment: int
    merge_at: int
    delta: torch.Tensor
    future: torch.futures.Future | None
    bytes_before: int
    started_from: list[torch.Tensor] | None = None
    """Top-k with overlap: the fragment's local tensors as the sync started (float32 views of ``DiLoCo._kept``);
    the merge keeps what the site trained since then. None: the merge takes the global parameters."""
    seconds_before: float = 0.0
    """``WanStats.seconds`` as the sync started (``DiLoCoStats.wan_s``)."""
    sent: torch.Tensor | None = None
    """With a ``common_layout``: the buffer being averaged (the fragment in that layout) until it arrives and this
    rank's part of it is taken into ``delta``."""


class DiLoCo:
    """DiLoCo / streaming DiLoCo across the sites of ``topology``. Every rank of the topology builds one.

    Inside a site, training stays ordinary synchronous data parallelism (DDP averaging inside the site only:
    ``register_site_ddp_hook``; or FSDP2 / TP shards, whose local shards DiLoCo handles). Every ``sync_every``
    inner steps each fragment's pseudo-gradient ``global - local`` is averaged over sites, the outer optimizer
    steps the float32 global copy, and the local parameters become the global ones (``overlap_steps == 0``) or
    ``alpha * local + (1 - alpha) * global`` when the result arrives ``overlap_steps`` later. The inner
    optimizer keeps its state. Only trainable parameters are synchronized; buffers stay per site.

    With a top-k codec (``DiLoCoConfig.compression="topk..."``) each rank keeps per fragment a float32 residual: what
    the codec dropped from its share of the fragment's pseudo-gradient, added to that share at the fragment's next sync
    (error feedback), so nothing is lost, only delayed. With overlap, its merge keeps what the site trained while the
    sync was in flight: ``local = global + (local - local as the sync started)`` (``alpha`` must be 0); the local
    fragment as the sync started is kept for that (one largest fragment, float32). The integer and float codecs send no
    residual: each sync rounds once, unbiased and within ``max_abs_error``, as before.

    With ``"auto"`` settings (``DiLoCoConfig(sync_every="auto")``, ``WanConfig(chunk_mb="auto", streams="auto")``)
    a round is one sync of every fragment; at each round's end the ranks exchange their measured step times and WAN
    throughput in one small all-reduce, and every rank adopts the same H and WAN pipeline for the next round, chosen
    by the planning model; a link rate that moves by more than ``REPLAN_FACTOR`` (1.5x) re-plans
    (``multidc.hierarchical.diloco.auto``, docs/guides/plan.md#auto-in-the-job).

    Construction is collective over the topology's ranks: the settings, the fragments' sizes and a SHA-256 of
    each fragment's parameter bytes are compared in one small gather (the same ValueError on every rank when the
    settings or sizes differ). Every rank then starts from site 0's parameters, bitwise: a fragment whose digest
    is the same on every rank is already there and nothing crosses the WAN for it (under DDP, whose start-up
    broadcast made the sites equal, nothing at all); each fragment that differs is copied from site 0 (float32,
    uncompressed).

    Args:
        model: the model as trained (a DDP wrapper, an FSDP2 / TP module: DTensor parameters sync their local
            shards). Replicas inside a site must hold equal values, as DDP and FSDP2 keep them.
        inner_optimizer: when given, ``step()`` runs after each of its steps (a step post-hook; a step a
            ``GradScaler`` skips is not counted), and calling ``step()`` yourself raises a RuntimeError (it would
            count the inner step twice). ``None``: call ``step()`` yourself after each inner step.
        topology: the sites (``Topology.build``, or a parallel layout's replica topology).
        config: ``DiLoCoConfig``; ``None`` builds ``DiLoCoConfig()`` (env ``MULTIDC_DILOCO_*``) on every rank.
        wan: WAN settings of the syncs; default ``topology.wan`` with ``config.compression`` as its codec.
        outer_optimizer: ``params -> torch.optim.Optimizer``, called once per fragment with its float32 global
            tensors; default ``SGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)``. Its state is
            created at construction by one zero-gradient step at lr 0, as torch's distributed checkpoint does
            (exact for SGD; Adam-like step counters start at 1), so checkpoints always hold it.
        blocks: the ordered blocks dealt into fragments; default ``model.pipeline_blocks()``, else the
            top-level children (see ``split_fragments``).
        common_layout: when ranks of different sites hold a fragment in different pieces (unequal sites under a
            parallel layout: ``multidc.hierarchical.parallel.unequal_sites.ShardGather``), what maps this rank's
            pieces to a layout every site shares and back: ``fragment(params, local)`` returns a plan with
            ``numel``, ``gather(flat)`` (collective over the ranks that share the plan, on the calling thread) and
            ``take(full, flat)``. Every sync then averages the fragment in that layout. ``None``: every rank of the
            topology holds its fragments as the ranks of its own site and of the others do.

    Raises:
        ValueError: on every rank alike: bad or differing settings, more fragments than blocks, an empty
            fragment, or ranks holding differently sized models.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        topology: Topology,
        config: DiLoCoConfig | None = None,
        *,
        wan: WanConfig | None = None,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        blocks: Sequence[nn.Module] | None = None,
        common_layout=None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a multidc.hierarchical.Topology, not {type(topology).__name__}.")
        if not isinstance(topology.policy, FailFast):
            raise ValueError(
                f"DiLoCo runs over a topology whose failed WAN transfers raise; this one's policy "
                f"({type(topology.policy).__name__}) tolerates them, which would leave the sites' global parameters "
                f"apart. Use a Topology from Topology.build, or ElasticDiLoCo for elastic sites."
            )
        self.topology = topology
        split, self.config, apart, plans = agree_model(model, topology, config, blocks, common_layout)
        base = wan if wan is not None else topology.wan
        self.wan = dataclasses.replace(base, compression=self.config.compression)
        self.stats = DiLoCoStats()
        self._last = dataclasses.replace(self.stats)
        self._in_flight: _InFlight | None = None
        make_outer = outer_optimizer or self._default_outer
        with torch.no_grad():
            self._fragments = [
                self._fragment(params, make_outer, self.config.offset(i), copy=apart[i],
                               common=plans[i] if plans else None)
                for i, params in enumerate(split)
            ]
        self._largest = max(f.global_flat.numel() for f in self._fragments)
        # top-k with overlap: the local fragment as its sync started, for the merge (see _merge); one sync in flight
        keeps = is_sparse(self.config.compression) and self.config.overlap_steps > 0
        self._kept = self._fragments[0].global_flat.new_zeros(self._largest) if keeps else None
        self._trained = [0.0] * len(self._fragments)  # this rank's samples since each fragment's last sync started
        self._samples: float | None = None  # reported for the current inner step (count())
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step) if inner_optimizer else None
        self._hook_stepping = False
        self._init_rounds()

    @property
    def _auto_wan(self) -> bool:
        return self.wan.chunk_mb_auto or self.wan.streams_auto

    def _default_outer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.SGD(params, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov)

    def _fragment(self, params: list[nn.Parameter], make_outer, offset: int, *, copy: bool, common) -> _Fragment:
        local = [local_tensor(p) for p in params]
        flat = torch.cat([t.detach().reshape(-1).float() for t in local])
        views = _views(flat, local)
        if copy:  # the ranks differ: site 0's values reach every rank exactly (x + 0 + ... in float32, uncompressed)
            shared = common.gather(flat) if common is not None else flat
            if self.topology.site != 0:
                shared.zero_()
            all_reduce(shared, self.topology, wan=dataclasses.replace(self.wan, compression="none"), replicated=True)
            if common is not None:
                common.take(shared, flat)
            for t, view in zip(local, views):
                t.copy_(view)
        outer = make_outer(views)
        init_state(outer, views)
        return _Fragment(local, flat, views, outer, offset, common=common)

    def _after_inner_step(self, optimizer, _args, _kwargs) -> None:
        if not is_state_init_step(optimizer):
            self._hook_stepping = True
            try:
                self.step()
            finally:
                self._hook_stepping = False

    def count(self, samples: float) -> None:
        """Report what this rank trains in the current inner step (samples or tokens: one unit on every rank), before
        the optimizer step that ends it; calls add up (micro-batches). A step with no report counts 1. Under
        ``DiLoCoConfig.weighting="samples"`` each site's pseudo-gradient weighs what its ranks trained since the
        fragment's last sync. Not collective.

        Raises:
            ValueError: ``samples`` is not a finite number >= 0.
        """
        if isinstance(samples, bool) or not isinstance(samples, (int, float)) or not 0 <= samples < math.inf:
            raise ValueError(f"DiLoCo.count(samples={samples!r}): samples must be a finite number >= 0.")
        self._samples = (self._samples or 0.0) + float(samples)

    @torch.no_grad()
    def step(self) -> None:
        """Count one inner step; merge the sync due now and start the one whose turn it is. Call it on every rank
        after each inner step when DiLoCo was built with ``inner_optimizer=None`` (else the optimizer's hook does).

        Raises:
            RuntimeError: DiLoCo was built with an inner optimizer, whose step post-hook calls ``step()`` already;
                raised before anything is counted or synced, on the rank that calls it. Every rank running the same
                loop raises at the same inner step, with the sites' parameters still equal; a rank that called it
                alone would leave the others waiting in the next sync until ``WanConfig.timeout_s``.
        """
        t = self._count_inner_step()
        self._timer.enter()
        started = time.perf_counter()
        synced = False
        if self._in_flight is not None and self._in_flight.merge_at <= t:
            self._finish()
            synced = True
        due = self._due(t)
        if due is not None:
            last = self._end_time_round(t)
            ends_auto = self._auto is not None and self._rounds.ends_round(self.topology.site, t)
            self._start(due, t)
            if self.config.overlap_steps == 0 or last:  # the run's last sync merges at once
                self._finish()
            if ends_auto:  # after the blocking sync merged: its bytes and seconds are part of the round's figures
                self._end_auto_round(t)
            synced = True
        if synced:
            self.stats.exposed_s += time.perf_counter() - started
        self._timer.leave()

    def _count_inner_step(self) -> int:
        """Count the inner step ``step()`` was called for and return its number; refuse a call that does not come
        from the inner optimizer's hook when there is one (see ``step``), before anything is counted."""
        if self._hook is not None and not self._hook_stepping:
            raise RuntimeError(
                f"{type(self).__name__}.step() was called, but it was built with an inner optimizer, whose step "
                "post-hook already runs step() after every optimizer.step(): a second call would count each inner "
                "step twice (syncs every sync_every/2 steps). Remove the diloco.step() call (a DiLoCo to step by "
                "hand is built without the optimizer: DiLoCo(model, None, topology, ...))."
            )
        self.stats.inner_steps += 1
        samples, self._samples = (1.0 if self._samples is None else self._samples), None
        self._trained = [trained + samples for trained in self._trained]
        return self.stats.inner_steps

    def _due(self, t: int) -> int | None:
        """The fragment whose sync starts at inner step ``t``, or None (at most one: ``fragments <= sync_every``
        spreads their offsets apart)."""
        if self._rounds is not None:
            return self._rounds.due(self.topology.site, t, self.config.fragments)
        return next((i for i, f in enumerate(self._fragments) if t % self.config.sync_every == f.offset), None)

    def _start(self, index: int, t: int) -> None:
        """Start averaging fragment ``index``'s pseudo-gradients (in the background); it merges at ``t`` plus
        ``overlap_steps``."""
        assert self._in_flight is None, "a fragment's sync starts before the previous one merged"
        fragment = self._fragments[index]
        delta = fragment.global_flat.clone()
        for local, view in zip(fragment.params, _views(delta, fragment.params)):
            view.sub_(local)  # global - local, in float32
        before, seconds_before = self._wan_bytes(), self._wan_seconds()  # before the sync is submitted
        topology, wan = self._sync_target()
        residual = error_feedback.residual(fragment, topology, wan)
        sent = fragment.common.gather(delta) if fragment.common is not None else delta  # inside the site
        future = all_reduce(sent, topology, wan=wan, op="avg", async_op=True, replicated=True, residual=residual,
                            weight=self._take_weight(index))
        started_from = None
        if self._kept is not None:
            started_from = _views(self._kept[: delta.numel()], fragment.params)
            for local, view in zip(fragment.params, started_from):
                view.copy_(local)
        self._in_flight = _InFlight(index, t + self.config.overlap_steps, delta, future, before, started_from,
                                    seconds_before, sent if sent is not delta else None)

    def _take_weight(self, index: int) -> float | None:
        """This rank's part of its site's weight for fragment ``index``'s sync starting now (what it trained since
        the fragment's last sync; None: equal weights); the count restarts."""
        trained, self._trained[index] = self._trained[index], 0.0
        return trained if self.config.weighting == "samples" else None

    def _sync_target(self) -> tuple[Topology, WanConfig]:
        """The topology and WAN settings the syncs run over."""
        return self.topology, self.wan

    def _finish(self) -> None:
        flight, self._in_flight = self._in_flight, None
        self._wait(flight)
        self._merge(flight, outer_step=True)

    def _merge(self, flight: _InFlight, *, outer_step: bool) -> None:
        """Merge an arrived sync: with ``outer_step`` its average steps the fragment's outer optimizer; then the
        fragment's local parameters take the global ones (``alpha * local + (1 - alpha) * global`` under overlap;
        with a top-k codec ``global + (local - local as the sync started)``: what the site trained while the sync
        was in flight is kept, and is part of the fragment's next pseudo-gradient, while what the sync did not send
        of the earlier steps is in the residual)."""
        fragment = self._fragments[flight.fragment]
        if outer_step:
            for view, grad in zip(fragment.global_views, _views(flight.delta, fragment.params)):
                view.grad = grad
            fragment.outer.step()
            fragment.outer.zero_grad(set_to_none=True)
            self.stats.outer_syncs += 1
        if flight.started_from is not None:
            for local, view, start in zip(fragment.params, fragment.global_views, flight.started_from):
                local.copy_(view + (local.float() - start))
            return
        alpha = self.config.alpha if self.config.overlap_steps else 0.0
        for local, view in zip(fragment.params, fragment.global_views):
            local.copy_(view if alpha == 0.0 else alpha * local.float() + (1.0 - alpha) * view)

    def _wait(self, flight: _InFlight | None) -> None:
        """Wait for ``flight``'s all-reduce to arrive (once) and count its WAN bytes."""
        if flight is not None and flight.future is not None:
            flight.future.wait()
            self.stats.bytes_sent += self._wan_bytes() - flight.bytes_before
            self.stats.wan_s += self._wan_seconds() - flight.seconds_before
            self._arrived += 1
            flight.future = None
            if flight.sent is not None:  # this rank's part of the average, in its own layout
                self._fragments[flight.fragment].common.take(flight.sent, flight.delta)
                flight.sent = None

    def _wan_bytes(self) -> int:
        """Bytes the syncs' topology has sent over the WAN so far."""
        return self.topology.wan_stats.snapshot()["bytes_sent"]

    def _wan_seconds(self) -> float:
        """Seconds the syncs' topology has spent in hierarchical all-reduces so far."""
        return self.topology.wan_stats.snapshot()["seconds"]

    def metrics(self) -> dict[str, float]:
        """Figures since the previous call, for a training log once per optimizer step: ``wan/bytes_sent``
        (bytes), ``wan/outer_syncs`` (count) and ``wan/exposed_s`` (seconds the inner loop waited for syncs)."""
        now, last = self.stats, self._last
        self._last = dataclasses.replace(now)
        return {
            "wan/bytes_sent": float(now.bytes_sent - last.bytes_sent),
            "wan/outer_syncs": float(now.outer_syncs - last.outer_syncs),
            "wan/exposed_s": now.exposed_s - last.exposed_s,
        }

    @contextlib.contextmanager
    @torch.no_grad()
    def global_parameters(self) -> Iterator[None]:
        """Within the block the model holds the global parameters (the sites' consensus as of the last merged
        sync of each fragment, float32 cast to the parameters' dtype); its own come back after. For evaluating
        or exporting what DiLoCo trains: between syncs each site's parameters drift towards its own data. Not
        collective; do not step the optimizer inside."""
        saved = [[p.detach().clone() for p in f.params] for f in self._fragments]
        try:
            for fragment in self._fragments:
                for local, view in zip(fragment.params, fragment.global_views):
                    local.copy_(view)
            yield
        finally:
            for fragment, copies in zip(self._fragments, saved):
                for local, copy in zip(fragment.params, copies):
                    local.copy_(copy)

    # Rounds by time (DiLoCoConfig.sync_every_s) and the end of training: see multidc.hierarchical.diloco.rounds

    def _init_rounds(self) -> None:
        self._total: int | None = None  # finish_at
        self._timer = StepTimer()
        self._rounds: Rounds | None = None
        self._auto: AutoSchedule | None = None  # "auto" settings: see multidc.hierarchical.diloco.auto
        self._seen = (0, 0.0, 0)  # self._traffic() at the last round end
        self._arrived = 0  # syncs waited for (their bytes and seconds counted)
        self._rtt = 0.0  # measured after the last exchange (WAN settings on auto)
        if self.config.sync_every_s is not None or self.config.sync_every_auto or self._auto_wan:
            steps = (self.config.sync_every,) * self.topology.num_sites
            self._rounds = Rounds(steps=steps, history=[steps])
        if self.config.sync_every_auto or self._auto_wan:
            self._auto = auto_schedule(self.config, self.wan, self.topology, self._fragments)
            if self._auto_wan:
                self._rtt = self._ping()

    def finish_at(self, steps: int | None) -> None:
        """End training after this rank's inner step ``steps`` (e.g. Lightning's ``max_steps``; None: no end).
        With rounds by time the sites run different step counts, so they agree on a last round: when a site would
        reach its end within the next round, that round is every site's last, the first site to end stops exactly
        at its ``steps`` and the others earlier; then ``should_stop`` is True on every rank. Each site counts its
        own inner steps. Call it on every rank before the round that could be the last starts. Not collective.

        Raises:
            ValueError: ``steps`` is not an integer >= 0 or None.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"DiLoCo.finish_at(steps={steps!r}): steps must be an integer >= 0, or None.")
        self._total = steps

    @property
    def should_stop(self) -> bool:
        """Whether this rank should stop training: it reached ``finish_at``'s steps, or, with rounds by time, the
        sites' last round ended (on every rank after the same sync)."""
        if self._rounds is not None and self._rounds.stopped:
            return True
        return self._total is not None and self.stats.inner_steps >= self._total

    @property
    def round_plans(self) -> list[tuple[int, ...]]:
        """With rounds by time or ``sync_every="auto"``: every round's inner steps per site so far (site order), the
        current round last (after a load: from the loaded round on); the same on every rank. ``[]`` without."""
        return list(self._rounds.history) if self._rounds is not None else []

    def _end_time_round(self, t: int) -> bool:
        """At inner step ``t``, a sync is due: if it ends this site's round (rounds by time), the ranks exchange
        their step times and steps left (collective over the topology) and plan the next round. Returns whether
        this sync is the run's last."""
        rounds = self._rounds
        if self.config.sync_every_s is None or not rounds.ends_round(self.topology.site, t):
            return False
        if rounds.last:
            rounds.stopped = True
            return True
        times, left = self._per_site(self._exchange_round())
        steps, verdict = next_round(times, left, rounds.steps, every_s=self.config.sync_every_s,
                                    minimum=minimum_steps(self.config.fragments, self.config.overlap_steps))
        if verdict == "stop":
            rounds.stopped = True
            return True
        rounds.steps, rounds.start, rounds.last = steps, t, verdict == "last"
        rounds.history.append(steps)
        return False

    def _end_auto_round(self, t: int) -> None:
        """At inner step ``t`` a round of ``sync_every="auto"`` ended: the ranks exchange their figures (collective
        over the topology) and every rank adopts the same H for the next round (``AutoSchedule``)."""
        rows = [(row[0],) + tuple(row[2:]) for row in self._exchange_round()]
        decision = self._auto.round_end(rows, [self.topology.layout.site_of(r) for r in range(self.topology.size)])
        if decision is not None:
            self._adopt(decision)
        rounds = self._rounds
        rounds.start = t
        rounds.history.append(rounds.steps)
        if self._auto_wan:  # every rank is here, just after the exchange: a round trip, not a wait for a site
            self._rtt = self._ping()

    def _adopt(self, decision) -> None:
        """Take an ``AutoSchedule`` decision: H (``sync_every="auto"``), the WAN pipeline (``chunk_mb`` / ``streams``
        on auto) of the syncs that start from now on."""
        if self.config.sync_every_auto:
            self._rounds.steps = (decision.sync_every,) * self.topology.num_sites
        if self.wan.chunk_mb_auto:  # only the settings on auto: a resume may have fixed the other
            self.wan = dataclasses.replace(self.wan, chunk_mb=decision.chunk_mb)
        if self.wan.streams_auto:
            self.wan = dataclasses.replace(self.wan, streams=decision.streams)

    def _ping(self) -> float:
        """A round-trip time (``rounds.ping``). Collective; a test may fake it."""
        return ping(self.topology, self._fragments[0].global_flat.device, self.wan.timeout_s)

    def _exchange_round(self) -> list[list[float]]:
        """Every rank's ``[mean step time over the round, steps left (-1: no end), WAN bytes, WAN seconds and count of
        the syncs that arrived since the last round end, round-trip time (0: not measured)]``, from one all-reduce of a
        slot per rank over the topology's group: every rank gathers the same numbers (float64)."""
        left = -1.0 if self._total is None else float(max(0, self._total - self.stats.inner_steps))
        traffic, seen = self._traffic(), self._seen
        self._seen = traffic
        row = [self._timer.take_mean(), left] + [a - b for a, b in zip(traffic, seen)] + [self._rtt]
        return exchange(self.topology, row, self._fragments[0].global_flat.device, self.wan.timeout_s)

    def _traffic(self) -> tuple[int, float, int]:
        """This rank's syncs so far: WAN bytes sent, their seconds (``DiLoCoStats``) and count; a test may fake it."""
        return self.stats.bytes_sent, self.stats.wan_s, self._arrived

    def _per_site(self, rows: list[list[float]]) -> tuple[list[float], list[int | None]]:
        """Every site's step time (its slowest rank's) and steps left (None: no end) from ``_exchange_round``."""
        topo = self.topology
        times, steps_left = [0.0] * topo.num_sites, [None] * topo.num_sites
        for rank, (seconds, n, *_) in enumerate(rows):
            site = topo.layout.site_of(rank)
            times[site] = max(times[site], seconds)
            if n >= 0:
                steps_left[site] = int(n) if steps_left[site] is None else min(steps_left[site], int(n))
        return times, steps_left

    def _rounds_state(self) -> dict:
        """The round plan (the same on every rank) and this rank's own step count, sync in flight and timing of the
        round so far (under ``"rank_<global rank>"``: the sites' step counts differ); ``{}`` without time rounds."""
        rounds = self._rounds
        if self._auto is not None:
            return {"auto": {"steps": torch.tensor(rounds.steps[0]), "start": torch.tensor(rounds.start),
                             "decision": torch.tensor(self._auto.state(), dtype=torch.float64)}}
        if rounds is None:
            return {}
        flight = self._in_flight
        own = [self.stats.inner_steps, -1 if flight is None else flight.merge_at, rounds.start,
               self._timer.busy_s, self._timer.steps]
        return {"rounds": {"steps": torch.tensor(rounds.steps), "last": torch.tensor(int(rounds.last)),
                           "stopped": torch.tensor(int(rounds.stopped)),
                           "per_rank": {f"rank_{dist.get_rank()}": torch.tensor(own, dtype=torch.float64)}}}

    def _load_rounds(self, state: dict) -> None:
        """Restore ``_rounds_state`` (``load_state_dict`` checked that both or neither have rounds by time)."""
        rounds, saved = self._rounds, state.get("rounds")
        if self._auto is not None:
            auto = state["auto"]
            self._auto.load(auto["decision"].tolist())
            if self._auto.decision is not None:
                self._adopt(self._auto.decision)
            saved_h, start = int(auto["steps"]), int(auto["start"])
            h = saved_h if self.config.sync_every_auto else self.config.sync_every
            if h != saved_h:  # saved under sync_every="auto", resumed with a fixed H: a new round of it starts here
                start = self.stats.inner_steps
            rounds.steps, rounds.start = (h,) * self.topology.num_sites, start
            rounds.history = [rounds.steps]
            return
        if rounds is None or saved is None:
            return
        own = saved.get("per_rank", {}).get(f"rank_{dist.get_rank()}")
        if own is None:
            raise ValueError(
                f"the DiLoCo state holds no round state for rank {dist.get_rank()} (rounds by time keep each rank's "
                f"own step count: DiLoCoConfig.sync_every_s); resume with the ranks and sites it was saved with."
            )
        steps, merge_at, start, busy_s, measured = own.tolist()
        self.stats.inner_steps, rounds.start = int(steps), int(start)
        if self._in_flight is not None:
            self._in_flight.merge_at = int(merge_at)
        rounds.steps = tuple(int(h) for h in saved["steps"].tolist())
        rounds.last, rounds.stopped = bool(int(saved["last"])), bool(int(saved["stopped"]))
        rounds.history = [rounds.steps]
        self._timer.busy_s, self._timer.steps = busy_s, int(measured)

    def _settle(self) -> None:
        """Wait for a sync in flight to arrive (not merge it): its result is then part of the state."""
        self._wait(self._in_flight)

    def state_dict(self) -> dict:
        """The outer state: the inner step count, the float32 global parameters, the outer optimizers' state, and a
        sync in flight (its averaged result and the step it merges at), identical on every rank of the topology; under
        ``weighting="samples"`` also what this rank trained since each fragment's last sync (``"trained"`` ->
        ``"rank_<global rank>"``); with a top-k codec this rank's own error-feedback residuals and the chunk plan they
        follow, under ``"residual"`` -> ``"rank_<global rank>"``, and with overlap its local fragment as the sync in
        flight started (``"in_flight_local"`` -> ``"rank_<global rank>"``): keys no other rank holds, so a distributed
        checkpoint stores every rank's (resume with the same ranks and ``WanConfig.chunk_mb`` to keep them). Collective:
        every rank calls it (a sync in flight is waited for, not merged). The tensors are the live ones, so a checkpoint
        loader may fill them in place."""
        self._settle()
        flight = self._in_flight
        pending = torch.zeros(self._largest)
        if flight is not None:
            pending[: flight.delta.numel()].copy_(flight.delta)
        return {
            "inner_steps": torch.tensor(self.stats.inner_steps),
            "sync_every": torch.tensor(self.config.sync_every),
            "fragments": torch.tensor(self.config.fragments),
            "in_flight_fragment": torch.tensor(-1 if flight is None else flight.fragment),
            "in_flight_merge_at": torch.tensor(-1 if flight is None else flight.merge_at),
            "in_flight_delta": pending,
            "global": {f"fragment_{i}": f.global_flat for i, f in enumerate(self._fragments)},
            "outer": {f"fragment_{i}": outer_state(f.outer) for i, f in enumerate(self._fragments)},
            **self._per_rank_state(),
            **self._rounds_state(),
        }

    def _per_rank_state(self) -> dict:
        """This rank's own state, keyed by its global rank (see ``state_dict``): its residuals under a top-k codec
        (``error_feedback.state``), its counts under ``weighting="samples"``; ``{}`` with neither."""
        state = error_feedback.state(self._fragments, *self._sync_target())
        rank = f"rank_{dist.get_rank()}"
        trained = {"trained": {rank: torch.tensor(self._trained, dtype=torch.float64)}}
        kept = {"in_flight_local": {rank: self._kept}} if self._kept is not None else {}
        return ({"residual": state} if state else {}) | (trained if self.config.weighting == "samples" else {}) | kept

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output (also one filled in place by a checkpoint loader). Every rank.
        The model's own (per-site) parameters are restored by whoever saved them; this restores the outer side.
        Residuals missing from ``state`` (none saved for this rank) or taken under another chunk plan (another
        ``chunk_mb``, site size or rank layout) restart at zero; the latter with a warning on the rank (a checkpoint
        loader warns of the former, naming them)."""
        saved = (int(state["sync_every"]), int(state["fragments"]))
        if saved != (self.config.sync_every, self.config.fragments):
            raise ValueError(
                f"the DiLoCo state was saved with sync_every={saved[0]}, fragments={saved[1]}, but this run has "
                f"sync_every={self.config.sync_every}, fragments={self.config.fragments}; resume with the same "
                f"DiLoCoConfig (or MULTIDC_DILOCO_*)."
            )
        check_rounds_saved("rounds" in state, self.config.sync_every_s is not None)
        check_auto_saved("auto" in state, self._auto is not None)
        self._settle()
        self.stats.inner_steps = int(state["inner_steps"])
        for i, fragment in enumerate(self._fragments):
            fragment.global_flat.copy_(state["global"][f"fragment_{i}"])
            load_outer_state(fragment.outer, state["outer"][f"fragment_{i}"])
        self._load_residuals(state.get("residual", {}))
        self._load_trained(state.get("trained", {}).get(f"rank_{dist.get_rank()}"))
        self._in_flight = None
        index = int(state["in_flight_fragment"])
        if index >= 0:
            numel = self._fragments[index].global_flat.numel()
            # the loaded buffer is on the CPU; the merge assigns it as the grad of the (maybe CUDA) global copy
            delta = state["in_flight_delta"][:numel].to(self._fragments[index].global_flat.device, copy=True)
            started_from = self._load_kept(index, state.get("in_flight_local", {}).get(f"rank_{dist.get_rank()}"))
            self._in_flight = _InFlight(index, int(state["in_flight_merge_at"]), delta, None, 0, started_from)
        self._load_rounds(state)

    def _load_trained(self, saved: torch.Tensor | None) -> None:
        """This rank's counts since each fragment's last sync; not saved (another weighting, an older checkpoint):
        one per inner step since then, as if none had been reported."""
        if saved is not None and saved.numel() == len(self._fragments):
            self._trained = [float(x) for x in saved.tolist()]
            return
        t, h = self.stats.inner_steps, self.config.sync_every
        last = [t - (t - f.offset) % h for f in self._fragments]  # the latest sync start at or before t
        self._trained = [float(t - start if start >= 1 else t) for start in last]

    def _load_kept(self, index: int, saved: torch.Tensor | None) -> list[torch.Tensor] | None:
        """Top-k with overlap: the sync in flight's local fragment as it started (``_merge``). Not saved (another
        codec or overlap, or a checkpoint without it): the merge takes the global parameters, and the steps trained
        while the sync was in flight are lost, logged on the rank."""
        if self._kept is None:
            return None
        if saved is None or saved.numel() != self._kept.numel():
            _log.warning("DiLoCo: the state holds no in-flight local fragment for this rank; the sync in flight merges "
                         "by taking the global parameters (the steps since it started are not kept).")
            return None
        if saved.data_ptr() != self._kept.data_ptr():
            self._kept.copy_(saved)
        return _views(self._kept[: self._fragments[index].global_flat.numel()], self._fragments[index].params)

    def _load_residuals(self, saved: dict) -> None:
        """This rank's saved residuals when taken under this run's layout, else zero (``error_feedback.load``)."""
        error_feedback.load(self._fragments, saved, *self._sync_target())

    def close(self) -> None:
        """Wait for a sync in flight and stop stepping with the inner optimizer. Every rank."""
        try:
            self._settle()
        finally:  # unhooked also when the sync in flight failed: the optimizer must not start another
            if self._hook is not None:
                self._hook.remove()
                self._hook = None


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in like]), like)]
