"""Rounds by time (``DiLoCoConfig.sync_every_s``): each site runs as many inner steps per round as fit in the time.

A round is one sync of every fragment, in fragment order; site ``s`` runs ``H_s`` inner steps in it, fragment ``f``'s
sync starting at its round's step ``(f + 1) * H_s // P`` (the last fragment's at ``H_s``: the round's end). The k-th
sync of one site therefore pairs with the k-th of every other site, whatever their step counts.

The invariant this module protects: every rank decides every round alike. At a round's end (the last fragment's
sync, the one point per round where they meet) the ranks exchange, in one small all-reduce, the mean time of their
inner steps in the round that ended and the steps each has left (``finish_at``). ``next_round`` then computes every
site's ``H`` for the next round from those gathered numbers alone (float64 and integer arithmetic, the same on every
rank), so no rank can decide otherwise and no per-step collective is needed.

``"auto"`` settings (``multidc.hierarchical.diloco.auto``) use the same rounds with one H for every site, the same
``exchange`` at each round's end (with their WAN figures in the row) and the same ``StepTimer``.

A step's time is what the loop spends outside ``DiLoCo.step()``: the forward, backward and optimizer step, the data
loading, anything else; not the time a sync blocks (``DiLoCoStats.exposed_s``). A site's step time is the slowest of
its ranks' (they run in lockstep inside the site).
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

from multidc.hierarchical.errors import wan_failure

MAX_STEPS_PER_ROUND = 1 << 30  # a bound on H: a step time near 0 must not ask for an unbounded round


@dataclass
class Rounds:
    """The round plan of this rank: every site's steps in the current round, and where this site's round began."""

    steps: tuple[int, ...]
    """H per site of the current round (every rank holds the same)."""
    start: int = 0
    """This site's inner step count when the current round began."""
    last: bool = False
    """The current round is the job's last: after its end, ``DiLoCo.should_stop`` is True on every rank."""
    stopped: bool = False
    """The last round has ended (or the sites agreed to stop at a round's end)."""
    history: list[tuple[int, ...]] = field(default_factory=list)
    """Every round's ``steps`` so far, the current one last (for logs and tests; not in the checkpoint)."""

    def due(self, site: int, t: int, fragments: int) -> int | None:
        """The fragment whose sync starts at this site's inner step ``t``, or None."""
        h, local = self.steps[site], t - self.start
        return next((f for f in range(fragments) if local == (f + 1) * h // fragments), None)

    def ends_round(self, site: int, t: int) -> bool:
        """Whether inner step ``t`` is this site's last step of the current round (the last fragment's sync)."""
        return t - self.start == self.steps[site]


def check_rounds_saved(saved: bool, wanted: bool) -> None:
    """Refuse a DiLoCo state saved with rounds by time into a run of fixed rounds, or the reverse: under time rounds
    each site counts its own steps and the k-th syncs pair; fixed rounds pair syncs by one shared step count.

    Raises:
        ValueError: ``saved != wanted``, naming ``sync_every_s``.
    """
    if saved == wanted:
        return
    with_, without = "with rounds by time (DiLoCoConfig.sync_every_s set)", "with fixed rounds (sync_every_s=None)"
    raise ValueError(
        f"the DiLoCo state was saved {with_ if saved else without}, but this run has "
        f"{with_ if wanted else without}: each site's step count and the pairing of the sites' syncs differ between "
        f"the two. Resume with the sync_every_s (MULTIDC_DILOCO_SYNC_EVERY_S) it was saved with."
    )


def minimum_steps(fragments: int, overlap_steps: int) -> int:
    """The fewest inner steps a round may have: every fragment's sync in it, each merged (``overlap_steps``
    later) before the next one starts: ``fragments * (overlap_steps + 1)``. A faster measurement is clamped up."""
    return fragments * (overlap_steps + 1)


def next_round(
    times: list[float], left: list[int | None], current: tuple[int, ...], *, every_s: float, minimum: int
) -> tuple[tuple[int, ...], str]:
    """Every site's H for the next round, and whether it is the last: ``(steps, "go" | "last" | "stop")``.

    Args:
        times: each site's mean inner step time (seconds) in the round that ended; <= 0: not measured, the site
            keeps its current H.
        left: each site's inner steps left (``finish_at``), None for no end.
        current: the H of the round that ended.
        every_s: ``DiLoCoConfig.sync_every_s``.
        minimum: ``minimum_steps``.

    Returns:
        ``"go"``: an ordinary round: the slowest measured site ``a`` runs ``H_a = max(minimum, round(every_s /
        t_a))`` steps, and every site fills the time they take: ``H_s = max(minimum, round(H_a * t_a / t_s))``.
        ``"last"``: some site would reach its end within that round, or leave less than a round's minimum after
        it: the next round is the last; the site whose end comes first (in rounds, the lowest site on a tie) runs
        exactly to it, the others as far into their own round (rounded down, at least ``minimum``, at most their
        end). ``"stop"``: a site has fewer than ``minimum`` steps left: the round that ended was the last.
    """
    def fill(seconds: float, t: float) -> int:
        return max(minimum, min(MAX_STEPS_PER_ROUND, int(round(seconds / t))))

    measured = [s for s, t in enumerate(times) if t > 0]
    # The slowest site rounds first (its steps are the coarsest); the round lasts what its steps take, and the
    # others fill that time: each site's rounding then costs at most half of its own step, not the slowest's.
    anchor = max(measured, key=lambda s: (times[s], -s), default=None)
    seconds = fill(every_s, times[anchor]) * times[anchor] if anchor is not None else every_s
    steps = tuple(fill(seconds, t) if t > 0 else h for t, h in zip(times, current))
    ends = [(s, n) for s, n in enumerate(left) if n is not None]
    if not ends:
        return steps, "go"
    if min(n for _, n in ends) < minimum:
        return steps, "stop"
    if all(n >= steps[s] + minimum for s, n in ends):
        return steps, "go"
    first, rest = min(ends, key=lambda e: (Fraction(e[1], steps[e[0]]), e[0]))
    last = tuple(
        rest if s == first else min(left[s] if left[s] is not None else MAX_STEPS_PER_ROUND,
                                    max(minimum, rest * h // steps[first]))
        for s, h in enumerate(steps)
    )
    return last, "last"


WARMUP_STEPS = 1
"""Inner steps a process runs before its step time counts: the first measured step (the one after the first
``DiLoCo.step()``) carries one-time costs (allocations, the inner optimizer's first update); measured on the
heterogeneous benchmark at 2-4x a later step, which made the first planned round leave the fast site idle for
most of it."""


class StepTimer:
    """This rank's time outside ``DiLoCo.step()`` since the last round's end: ``enter()`` at each call's start,
    ``leave()`` at its end; each gap between a ``leave`` and the next ``enter`` is one inner step's work. The first
    ``warmup`` gaps of the process (also after a resume) are not counted."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, warmup: int = WARMUP_STEPS) -> None:
        self.clock = clock
        """What the timer reads (seconds); a test may put a deterministic one in."""
        self.busy_s = 0.0
        self.steps = 0
        self._warmup = warmup
        self._left_at: float | None = None

    def enter(self) -> None:
        now = self.clock()
        if self._left_at is not None:
            if self._warmup > 0:
                self._warmup -= 1
            else:
                self.busy_s += now - self._left_at
                self.steps += 1

    def leave(self) -> None:
        self._left_at = self.clock()

    def take_mean(self) -> float:
        """The mean step time since the last call (0.0 when no step was measured), and restart."""
        mean = self.busy_s / self.steps if self.steps else 0.0
        self.busy_s, self.steps = 0.0, 0
        return mean


def exchange(topology, row: list[float], device, timeout_s: float) -> list[list[float]]:
    """Every rank's ``row`` (floats, the same length on every rank), from one all-reduce of a slot per rank over
    ``topology.group``: every rank gathers the same numbers, float64, in rank order. Collective.

    Raises:
        WanError: the all-reduce did not finish within ``timeout_s`` (``wan_failure``).
    """
    claims = torch.zeros(topology.size, len(row), dtype=torch.float64, device=device)
    claims[topology.rank] = torch.tensor(row, dtype=torch.float64)
    try:
        dist.all_reduce(claims, group=topology.group, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise wan_failure(topology, "exchanging the sites' step times", timeout_s, exc) from exc
    return claims.cpu().tolist()


def ping(topology, device, timeout_s: float) -> float:
    """A round-trip time in seconds: the fastest of 3 one-element all-reduces over ``topology.group``, over its size
    less one (gloo's ring passes a small tensor that many times each way). Collective; call it where every rank just
    met (after ``exchange``), so it times the link rather than a wait for a slower site."""
    probe, best = torch.zeros(1, device=device), math.inf
    for _ in range(3):
        started = time.perf_counter()
        try:
            dist.all_reduce(probe, group=topology.group, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise wan_failure(topology, "timing a round trip", timeout_s, exc) from exc
        best = min(best, time.perf_counter() - started)
    return best / max(1, topology.size - 1)
