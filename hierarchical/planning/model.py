"""The analytic model behind ``multidc plan``: WAN bytes, step time and compute utilization per cross-site method.

Bytes come from the code that sends them: ``chunking.plan_chunks`` cuts the flat tensor into per-rail shards and
each codec's ``wire_bytes`` sizes a shard, counted as ``all_reduce`` counts them (a ring all-reduce of ``k`` sites
sends ``2(k-1)/k`` of a shard, a compressed all-gather ``k-1`` times its wire). Time is bytes over the site's link
rate, or ``streams`` chunks per ring of round trips when that is slower, plus one ring of round trips. Equations,
and what the model ignores: docs/guides/plan.md.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

from multidc.hierarchical.chunking import plan_chunks
from multidc.hierarchical.compression import get_codec

METHODS = ("hierarchical_ddp", "diloco", "streaming_diloco")


@dataclass(kw_only=True, frozen=True)
class Job:
    """The training job, as the model sees it."""

    params: int
    """Trainable parameters of the model (all sites hold the same model)."""
    step_s: float
    """Seconds of compute per inner step (forward, backward, optimizer), with no WAN traffic."""
    sites: int = 2
    """Sites (datacenters) that train together."""
    ranks_per_site: int = 1
    """Ranks in each site: the rails that carry a site's share of the WAN traffic."""
    backward_share: float = 2 / 3
    """Share of ``step_s`` spent in backward, behind which a per-step all-reduce can hide."""
    ddp_overlap: float = 1.0
    """Share of backward that hierarchical DDP's all-reduce actually hides (1: as on GPUs with DDP's buckets;
    0: none, as on CPU ranks whose compute and gloo threads share the same cores)."""
    outer_hides_backward: bool = False
    """Whether a DiLoCo sync also hides behind the backward of the step that starts it (the Streaming DiLoCo
    paper's simulation assumes so; multidc's DiLoCo starts a sync after the optimizer step: False)."""
    grad_bytes: int = 4
    """Bytes per element of the gradients DDP reduces (4: float32; 2: bf16 gradients)."""

    def __post_init__(self) -> None:
        _check_int("Job.params", self.params, 1, "the model's trainable parameter count, e.g. 1_000_000_000")
        _check_positive("Job.step_s", self.step_s, "seconds per inner step, e.g. 0.5")
        _check_int("Job.sites", self.sites, 2, "two sites or more (one site sends nothing over a WAN)")
        _check_int("Job.ranks_per_site", self.ranks_per_site, 1, "ranks in each site, e.g. 8")
        for name in ("backward_share", "ddp_overlap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"Job.{name}={value!r} must be a fraction in [0, 1], e.g. 2/3.")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"Job.grad_bytes={self.grad_bytes!r} must be 4 (float32) or 2 (bf16 gradients).")


@dataclass(kw_only=True, frozen=True)
class Link:
    """One site's WAN link, per direction."""

    bandwidth_bps: float
    """Link rate in bits per second, per direction (what ``tc``/the provider sells: ``10e9`` for 10 Gbit/s)."""
    rtt_s: float = 0.0
    """Round-trip time in seconds."""
    efficiency: float = 1.0
    """Share of the rate that carries payload (TCP/IP headers take ~3-5%: 0.95)."""

    def __post_init__(self) -> None:
        _check_positive("Link.bandwidth_bps", self.bandwidth_bps, "bits per second, e.g. 10e9 for 10 Gbit/s")
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ValueError(f"Link.rtt_s={self.rtt_s!r} must be >= 0 seconds, e.g. 0.05.")
        if isinstance(self.efficiency, bool) or not 0 < self.efficiency <= 1:
            raise ValueError(f"Link.efficiency={self.efficiency!r} must be in (0, 1], e.g. 0.95.")

    def seconds(self, payload_bytes: float, round_trips: int) -> float:
        """Seconds to move ``payload_bytes`` out of the site, plus ``round_trips`` round trips."""
        return 8 * payload_bytes / (self.bandwidth_bps * self.efficiency) + round_trips * self.rtt_s


@dataclass(kw_only=True, frozen=True)
class Setting:
    """One way to train across sites: a method and its knobs."""

    method: str
    """``hierarchical_ddp``, ``diloco`` (blocking syncs) or ``streaming_diloco`` (fragments, overlapped)."""
    compression: str = "none"
    """WAN codec (``WanConfig.compression`` / ``DiLoCoConfig.compression``): none, bf16, int8, int4, topk..."""
    sync_every: int = 1
    """DiLoCo H: inner steps between two syncs of the same parameters (1 for hierarchical DDP)."""
    fragments: int = 1
    """Streaming DiLoCo P: fragments synced one at a time, every ``sync_every / fragments`` steps."""
    overlap_steps: int = 0
    """Streaming DiLoCo tau: inner steps a fragment's sync runs behind before it is merged."""
    chunk_mb: float = 32.0
    """``WanConfig.chunk_mb``: pipelined chunk size in MiB."""
    streams: int = 2
    """``WanConfig.streams``: WAN transfers in flight at once."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"Setting.method={self.method!r} is not a method; use one of {', '.join(METHODS)}.")
        get_codec(self.compression)  # ValueError naming the accepted codecs
        _check_int("Setting.sync_every", self.sync_every, 1, "inner steps between syncs, e.g. 32")
        _check_int("Setting.fragments", self.fragments, 1, "fragments, e.g. 4")
        _check_int("Setting.overlap_steps", self.overlap_steps, 0, "steps a sync overlaps, e.g. 1")
        _check_int("Setting.streams", self.streams, 1, "WAN transfers in flight, e.g. 2")
        _check_positive("Setting.chunk_mb", self.chunk_mb, "MiB per chunk, e.g. 32")
        if self.method == "hierarchical_ddp" and (self.sync_every, self.fragments, self.overlap_steps) != (1, 1, 0):
            raise ValueError("Setting: hierarchical_ddp syncs every step; leave sync_every=1, fragments=1, "
                             "overlap_steps=0 (or choose method='diloco' / 'streaming_diloco').")
        if self.method == "diloco" and (self.fragments, self.overlap_steps) != (1, 0):
            raise ValueError("Setting: blocking diloco has fragments=1 and overlap_steps=0; choose "
                             "method='streaming_diloco' for fragments or overlap.")
        if self.overlap_steps * self.fragments >= self.sync_every and self.method == "streaming_diloco":
            raise ValueError(f"Setting.overlap_steps={self.overlap_steps} must be < sync_every / fragments = "
                             f"{self.sync_every / self.fragments:g}, as DiLoCoConfig requires.")

    @property
    def label(self) -> str:
        """A short name for tables: ``ddp/int8``, ``diloco H=100/none``, ``streaming H=100 P=4 tau=1/int4``."""
        if self.method == "hierarchical_ddp":
            return f"ddp/{self.compression}"
        if self.method == "diloco":
            return f"diloco H={self.sync_every}/{self.compression}"
        return f"streaming H={self.sync_every} P={self.fragments} tau={self.overlap_steps}/{self.compression}"


@dataclass(frozen=True)
class Prediction:
    """What ``predict`` expects of one setting on one link. Times in seconds, bytes per site per direction."""

    setting: Setting
    wan_bytes_per_step: float
    """WAN payload bytes per inner step, summed over the site's ranks."""
    step_s: float
    """Predicted seconds per inner step, averaged over a round of ``sync_every`` steps."""
    exposed_s: float
    """Seconds per inner step the compute waits for the WAN."""
    utilization: float
    """Compute utilization: ``Job.step_s / step_s``."""
    extra: dict = field(default_factory=dict, compare=False)


def wan_bytes_per_sync(numel: int, element_size: int, setting: Setting, job: Job) -> tuple[int, int]:
    """Payload bytes one site sends over the WAN to reduce ``numel`` elements once, and the chunk count.

    The same sum ``all_reduce`` adds to ``WanStats.bytes_sent``, over the site's rails: uncompressed shards in a
    ring all-reduce (``2(k-1)/k`` of each shard), compressed ones in an all-gather (``k-1`` wires).
    """
    codec = get_codec(setting.compression)
    k = job.sites
    shards = _shard_sizes(numel, element_size, setting.chunk_mb, job.ranks_per_site)
    total = 0
    for shard_numel, count in shards.items():
        if codec is None:
            per_rail = shard_numel * element_size * 2 * (k - 1) // k
        else:
            per_rail = codec.wire_bytes(shard_numel) * (k - 1)
        total += per_rail * job.ranks_per_site * count
    return total, sum(shards.values())


@functools.lru_cache(maxsize=256)
def _shard_sizes(numel: int, element_size: int, chunk_mb: float, rails: int) -> Counter:
    """Shard length -> chunks with it, of ``plan_chunks``' plan (2-3 distinct lengths; cached: ``bandwidth_for``
    asks for the same plan at every rate it tries)."""
    return Counter(chunk.shard_numel for chunk in plan_chunks(numel, element_size, chunk_mb, rails))


def _sync_seconds(numel: int, element_size: int, setting: Setting, job: Job, link: Link) -> tuple[float, int]:
    payload, chunks = wan_bytes_per_sync(numel, element_size, setting, job)
    # A ring step of a chunk costs at least a round trip, and at most `streams` chunks are in flight: the pipeline
    # moves at the link rate or at `streams` chunks per (k-1) round trips, whichever is slower; plus one ring's
    # latency to fill it.
    ring_rtts = job.sites - 1
    latency_bound = math.ceil(chunks / setting.streams) * ring_rtts * link.rtt_s
    return max(link.seconds(payload, 0), latency_bound) + ring_rtts * link.rtt_s, payload


def predict(setting: Setting, job: Job, link: Link) -> Prediction:
    """Predicted bytes, step time and utilization of ``setting`` for ``job`` on ``link`` (see docs/guides/plan.md)."""
    s, h = job.step_s, setting.sync_every
    if setting.method == "hierarchical_ddp":
        comm, payload = _sync_seconds(job.params, job.grad_bytes, setting, job, link)
        hidden = job.backward_share * job.ddp_overlap * s
        exposed = max(0.0, comm - hidden)
        per_step = payload
        extra = {"sync_s": comm}
    elif setting.method == "diloco":
        comm, payload = _sync_seconds(job.params, 4, setting, job, link)  # float32 pseudo-gradients
        exposed = max(0.0, comm - _outer_hidden(job)) / h  # the inner loop waits for every sync
        per_step = payload / h
        extra = {"sync_s": comm}
    else:
        p = setting.fragments
        fragment = math.ceil(job.params / p)
        comm, payload = _sync_seconds(fragment, 4, setting, job, link)
        # each fragment's sync hides behind tau inner steps; the link carries all P syncs once per round
        waited = p * max(0.0, comm - setting.overlap_steps * s - _outer_hidden(job))
        saturated = p * comm - h * s
        exposed = max(waited, saturated, 0.0) / h
        per_step = payload * p / h
        extra = {"sync_s": comm, "fragment_params": fragment}
    step = s + exposed
    return Prediction(setting, float(per_step), step, exposed, s / step, extra)


def _outer_hidden(job: Job) -> float:
    return job.backward_share * job.step_s if job.outer_hides_backward else 0.0


def bandwidth_for(target: float, setting: Setting, job: Job, *, rtt_s: float = 0.0, efficiency: float = 1.0,
                  low: float = 1e3, high: float = 1e15) -> float:
    """The smallest link rate (bits/s) at which ``setting`` reaches ``target`` utilization; ``inf`` if none does
    (a round-trip time alone can cost more than the target allows).

    Utilization rises with the rate, so a bisection on the rate's logarithm finds it to 1e-6 relative.
    """
    if isinstance(target, bool) or not 0 < target < 1:
        raise ValueError(f"target={target!r} must be a utilization in (0, 1), e.g. 0.95.")

    def reaches(rate: float) -> bool:
        return predict(setting, job, Link(bandwidth_bps=rate, rtt_s=rtt_s, efficiency=efficiency)).utilization \
            >= target

    if not reaches(high):
        return math.inf
    if reaches(low):
        return low
    lo, hi = math.log(low), math.log(high)
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(math.exp(mid)) else (mid, hi)
    return math.exp(hi)


# From least to most departure from plain synchronous training: what ``cheapest`` prefers, in order.
DDP_CODECS = ("none", "bf16", "int8")
DILOCO_CODECS = ("none", "bf16", "int8", "int4", "topk")
SYNC_EVERY = (8, 16, 32, 64, 100, 128, 256, 512)
FRAGMENTS = (2, 4, 8)
OVERLAP_STEPS = (1, 2, 5)
WAN_PIPELINES = ((128.0, 4), (512.0, 8))


def candidates(*, chunk_mb: float = 32.0, streams: int = 2) -> list[Setting]:
    """Settings ``cheapest`` tries, in the order it prefers them: hierarchical DDP (codecs from exact to coarse),
    then streaming DiLoCo and DiLoCo by growing H; within an H, exact codecs before coarse ones, fewer fragments and
    less overlap first (less staleness). Each is tried with the given WAN pipeline (``chunk_mb``, ``streams``)
    first, then with larger ones (``WAN_PIPELINES``: fewer round trips over a long link, more memory in flight)."""
    pipelines = [(chunk_mb, streams)] + [(c, n) for c, n in WAN_PIPELINES if c > chunk_mb or n > streams]
    methods = [{"method": "hierarchical_ddp", "compression": c} for c in DDP_CODECS]
    for h in SYNC_EVERY:
        for codec in DILOCO_CODECS:
            methods.append({"method": "diloco", "compression": codec, "sync_every": h})
            methods += [{"method": "streaming_diloco", "compression": codec, "sync_every": h, "fragments": p,
                         "overlap_steps": tau} for p in FRAGMENTS for tau in OVERLAP_STEPS if tau * p < h]
    return [Setting(**m, chunk_mb=c, streams=n) for m in methods for c, n in pipelines]


def cheapest(target: float, job: Job, link: Link, settings: list[Setting] | None = None) -> Prediction | None:
    """The first setting of ``settings`` (default ``candidates()``, in its order of preference) whose predicted
    utilization reaches ``target`` on ``link``; ``None`` when none does."""
    if isinstance(target, bool) or not 0 < target < 1:
        raise ValueError(f"target={target!r} must be a utilization in (0, 1), e.g. 0.95.")
    for setting in settings if settings is not None else candidates():
        prediction = predict(setting, job, link)
        if prediction.utilization >= target:
            return prediction
    return None


def _check_int(name: str, value, least: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}={value!r} must be an integer >= {least}: {hint}.")


def _check_positive(name: str, value, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a positive number: {hint}.")
