"""The hierarchical all-reduce: reduce inside each site, cross the WAN once per shard, spread inside the site.

Per chunk: intra-site reduce-scatter -> inter-site all-reduce of each shard over its rail -> intra-site
all-gather. Chunks are pipelined: while chunk ``i`` crosses the WAN, chunk ``i+1`` is reduced inside the site
and chunk ``i-1`` is gathered; up to ``WanConfig.streams`` WAN transfers are in flight, each on its own group.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from multidc.hierarchical import _compat
from multidc.hierarchical._site_weights import row_sites, site_weights
from multidc.hierarchical.chunking import Chunk, plan_chunks
from multidc.hierarchical.compression import get_codec
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.errors import WanError, _site_message, _wan_message
from multidc.hierarchical.topology import Topology

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = ("sum", "avg")


def all_reduce(
    tensor: torch.Tensor,
    topology: Topology,
    *,
    wan: WanConfig | None = None,
    op: str = "sum",
    async_op: bool = False,
    replicated: bool = False,
    residual: torch.Tensor | None = None,
    weight: float | None = None,
) -> torch.futures.Future | None:
    """Sum (or average) ``tensor`` over every rank of ``topology``, in place. Every rank must call it.

    Any shape and size; float32, bfloat16 or float16. Every rank ends with bitwise-identical values, also with
    compression. Compression (``wan.compression``) applies to the inter-site hop only.

    Args:
        tensor: the local values; overwritten with the result.
        topology: from ``Topology.build``.
        wan: WAN settings; default ``topology.wan`` (agreed by every rank in ``Topology.build``). Every rank
            must pass the same settings. ``wan.streams`` may not exceed the
            streams the topology was built with.
        op: ``"sum"`` or ``"avg"`` (the sum divided by the number of ranks).
        async_op: return a ``torch.futures.Future`` at once; ``wait()`` returns ``tensor`` or raises.
        replicated: every rank of a site holds the same values (DiLoCo's pseudo-gradients): the site reduction
            is skipped, each rank sends only its ``1/site_size`` share over its rail, and the result is the sum
            (``op="sum"``) or mean (``op="avg"``) over *sites*, not ranks.
        residual: error feedback for a lossy codec: a float32 buffer of ``residual_numel`` elements, this rank's
            own; added to what this rank encodes, then set to what the codec dropped from it. Unchanged by a
            chunk whose WAN transfer failed (elastic sites) and when nothing crosses the WAN.
        weight: with ``replicated`` and ``op="avg"``: this rank's part of its site's weight (a site weighs the sum
            of its ranks' parts, e.g. the samples each trained): the result is the weighted mean
            ``sum_s w_s * x_s / sum_s w_s`` over sites instead of the plain mean. Every rank passes one, or none
            does. Before the transfer starts (also with ``async_op``) the parts are exchanged in one small
            all-reduce over the topology's group on the calling thread, and checked: a bad part (negative, not
            finite) raises the same ValueError on every rank. When every site weighs the same (or nothing) the
            result is bitwise the plain mean. Each site's values are multiplied by ``w_s / sum w`` in float32
            (compressed: decoded, then summed in the same order on every rank; uncompressed: rounded to the
            tensor's dtype and summed by the rails' all-reduce), so every rank still ends bitwise identical.

    Returns:
        ``None``, or the future when ``async_op``.
    """
    if weight is not None and not (replicated and op == "avg"):
        raise ValueError("all_reduce(weight=...) weighs sites' replicated values: pass replicated=True, op='avg'.")
    wan = _check(tensor, topology, wan, op)
    # on the caller's thread: a collective over the job's group must not race the caller's own collectives there
    weights = site_weights(topology, wan, weight, tensor.device) if weight is not None else None
    if residual is not None:
        numel = residual_numel(tensor.numel(), tensor.element_size(), topology, wan)
        if residual.dtype != torch.float32 or residual.numel() != numel:
            raise ValueError(f"residual must be a float32 tensor of residual_numel(...) = {numel} elements, not "
                             f"{residual.dtype} x {residual.numel()}.")
    # The executor's own future: ``wait()`` raises the WanError itself (``submit`` wraps it for C++ callers).
    future = topology.executor().submit(lambda: _all_reduce(tensor, topology, wan, op, residual, replicated, weights))
    if async_op:
        return future
    future.wait()
    return None


def submit(
    tensor: torch.Tensor,
    topology: Topology,
    wan: WanConfig,
    *,
    op: str,
    residual: torch.Tensor | None = None,
) -> torch.futures.Future:
    """Queue a checked all-reduce on the topology's worker thread. ``residual``: see ``residual_numel``.

    For framework hooks (DDP, FSDP): the returned future fails at the C++ level when the all-reduce fails, so
    DDP's reducer raises ``RuntimeError("... WanError: <message>")`` from ``backward`` instead of failing to
    read the error object as a tensor.
    """
    future = topology.executor().submit(lambda: _all_reduce(tensor, topology, wan, op, residual))
    return future.then(_value)


def _value(future: torch.futures.Future):
    return future.value()  # re-raises the job's exception inside ``then``: the chained future gets an error


def residual_numel(numel: int, element_size: int, topology: Topology, wan: WanConfig) -> int:
    """Length of the float32 error-feedback buffer for a tensor: one slot per element this rank sends."""
    chunks = plan_chunks(numel, element_size, wan.chunk_mb, topology.num_rails)
    return sum(c.shard_numel for c in chunks)


def _check(tensor: torch.Tensor, topology: Topology, wan: WanConfig | None, op: str) -> WanConfig:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in SUPPORTED_DTYPES:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"all_reduce supports float32, bfloat16 and float16 tensors, not {got}.")
    if op not in OPS:
        raise ValueError(f"op={op!r} is not supported; use 'sum' or 'avg'.")
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology from Topology.build, not {type(topology).__name__}.")
    wan = wan if wan is not None else topology.wan
    if not isinstance(wan, WanConfig):
        raise ValueError(f"wan must be a multidc.hierarchical.WanConfig, not {type(wan).__name__}.")
    if wan.streams > topology.streams:
        raise ValueError(
            f"wan.streams={wan.streams} but the topology prepared {topology.streams}; pass the same WanConfig "
            f"to Topology.build(wan=...) or lower streams."
        )
    return wan


def _all_reduce(tensor, topology, wan, op, residual, replicated=False, weights=None):
    started = time.perf_counter()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    if flat.numel():
        if topology.num_sites > 1:
            _Pipeline(flat, topology, wan, residual, replicated=replicated, weights=weights).run()
        elif not replicated:
            dist.all_reduce(flat, group=topology.intra_group)
        if op == "avg" and weights is None:
            flat.div_(topology.num_sites if replicated else topology.size)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    topology.wan_stats.add(calls=1, seconds=time.perf_counter() - started)
    return tensor


@dataclass
class _ChunkState:
    """Where one chunk is in the pipeline. Works are waited for (and cleared) before the next stage starts."""

    buffer: torch.Tensor
    """The chunk (a zero-padded copy when it does not split evenly into shards); holds the result at the end."""
    shard: torch.Tensor | None
    """This rank's shard of ``buffer`` after the site reduction; ``None`` off the rails (unequal sites)."""
    works: list = field(default_factory=list)
    """Pending intra-site operations: the reduction, later the all-gather / broadcast of the result."""
    wan: dist.Work | None = None
    """The pending inter-site operation of ``shard``."""
    values: torch.Tensor | None = None
    """With compression: the float32 shard (plus residual) that was encoded."""
    gathered: torch.Tensor | None = None
    """With compression: every site's encoded shard, one row per site."""


class _Pipeline:
    """One hierarchical all-reduce of a flat tensor. Issues operations in a fixed order on every rank."""

    def __init__(
        self,
        flat: torch.Tensor,
        topology: Topology,
        wan: WanConfig,
        residual: torch.Tensor | None,
        *,
        replicated: bool = False,
        weights: torch.Tensor | None = None,
    ):
        self.flat = flat
        self.replicated = replicated  # the site's ranks hold equal values: no reduction inside the site
        # per gathered row (a rail group's rank order, which is the job's rank order, not always site order)
        self.weights = None if weights is None or not topology.rail_groups else weights[row_sites(topology)]
        self.topo = topology
        self.codec = get_codec(wan.compression)
        self.streams = wan.streams
        self.timeout_s = wan.timeout_s
        self.timeout = datetime.timedelta(seconds=wan.timeout_s)
        # A wait inside the site may include a peer's full WAN wait; the grace lets that peer report the WAN
        # timeout first (the more precise message) while still bounding every wait of the collective.
        self.site_timeout = datetime.timedelta(seconds=wan.timeout_s + _site_grace_s(wan.timeout_s))
        self.chunks = plan_chunks(flat.numel(), flat.element_size(), wan.chunk_mb, topology.num_rails)
        self.residual = residual if self.codec is not None else None
        offsets = [0]
        for chunk in self.chunks:
            offsets.append(offsets[-1] + chunk.shard_numel)
        self.residual_offsets = offsets
        intra = topology.intra_group
        self.leaders = [dist.get_global_rank(intra, r) for r in range(topology.num_rails)]
        self.state: list[_ChunkState] = []  # chunk i's, once _reduce_in_site(i) started it
        self.own_row = topology.rail_row
        # a tolerated WAN failure (elastic sites): no more WAN traffic in this all-reduce
        self.wan_failed = not topology.wan_usable()

    def run(self) -> None:
        started = finished = 0
        for i in range(len(self.chunks)):
            self._reduce_in_site(i)
            if i >= 1:
                finished = self._start_wan(started, finished)
                started += 1
        finished = self._start_wan(started, finished)
        while finished < len(self.chunks):
            self._finish_wan(finished)
            finished += 1
        for i, chunk in enumerate(self.chunks):
            self._finish_in_site(i, chunk)

    def _start_wan(self, i: int, finished: int) -> int:
        if i - finished >= self.streams:  # keep at most `streams` WAN transfers in flight
            self._finish_wan(finished)
            finished += 1
        state = self.state[i]
        self._wait_in_site(state, i, "reduce")
        if self.topo.rail is None or self.wan_failed:
            return finished
        try:
            self._issue_wan(state, i)
        except (RuntimeError, ValueError) as exc:
            error = WanError(_wan_message(self.topo, self.timeout_s, i, len(self.chunks), exc))
            # a ValueError is a mistake in the call, never a failed link: not tolerated
            if not isinstance(exc, RuntimeError) or not self.topo.tolerate_wan_error(error):
                raise
            self.wan_failed = True
        return finished

    def _issue_wan(self, state: _ChunkState, i: int) -> None:
        shard = state.shard
        group = self.topo.rail_groups[i % self.streams]
        if self.codec is None:
            if self.weights is not None:  # w_s * x_s in float32, summed over sites (the shard is overwritten after)
                shard.copy_(shard.float().mul_(self.weights[self.own_row]))
            state.wan = dist.all_reduce(shard, group=group, async_op=True)
            ring = shard.numel() * shard.element_size() * 2 * (self.topo.num_sites - 1) // self.topo.num_sites
            self.topo.wan_stats.add(sent=ring, received=ring)
            return
        values = shard.to(torch.float32, copy=True)
        if self.residual is not None:
            values += self._residual_slice(i)
        state.values = values
        wire = self.codec.encode(values)
        gathered = wire.new_empty(self.topo.num_sites * wire.numel())  # gloo wants a flat output
        state.gathered = gathered.view(self.topo.num_sites, wire.numel())
        state.wan = self.topo.rail_all_gather(gathered, wire, group)
        moved = wire.numel() * wire.element_size() * (self.topo.num_sites - 1)
        self.topo.wan_stats.add(sent=moved, received=moved)

    def _finish_wan(self, i: int) -> None:
        state = self.state[i]
        chunk = self.chunks[i]
        if state.wan is not None and not self.wan_failed:
            self._wait_wan(state.wan, i)
        state.wan = None
        if state.gathered is not None and self.wan_failed:
            state.gathered = state.values = None  # the site keeps its own values: the step is discarded anyway
        if state.gathered is not None:
            gathered, values, state.gathered, state.values = state.gathered, state.values, None, None
            if self.residual is not None:
                own = self.codec.decode(gathered[self.own_row], chunk.shard_numel)
                residual = torch.sub(values, own, out=self._residual_slice(i))
                # An overflowed step (skipped by a GradScaler) must not poison every later step's residual.
                residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            state.shard.copy_(self.codec.decode_sum(gathered, chunk.shard_numel, self.weights))
        state.works = self._gather_in_site(state)

    def _reduce_in_site(self, i: int) -> None:
        chunk = self.chunks[i]
        if not chunk.padded:
            buffer = self.flat[chunk.start : chunk.end]
        else:
            buffer = self.flat.new_zeros(chunk.padded_numel)
            buffer[: chunk.numel].copy_(self.flat[chunk.start : chunk.end])
        pieces = buffer.split(chunk.shard_numel)
        topo = self.topo
        if topo.site_size == 1:
            state = _ChunkState(buffer, shard=buffer)
        elif self.replicated:  # this rank's share already holds the site's value: nothing to reduce
            own = pieces[topo.rail] if topo.rail is not None else None
            if own is not None and topo.layout.equal_sites:
                own = own.clone()  # the all-gather writes into buffer: its input must not alias it
            state = _ChunkState(buffer, shard=own)
        elif topo.layout.equal_sites:
            state = _ChunkState(buffer, shard=buffer.new_empty(chunk.shard_numel))
            state.works = [_compat.reduce_scatter_single(state.shard, buffer, group=topo.intra_group, async_op=True)]
        else:  # unequal sites: only the first num_rails ranks of a site hold a shard
            state = _ChunkState(buffer, shard=pieces[topo.rail] if topo.rail is not None else None)
            state.works = [
                dist.reduce(piece, dst=leader, group=topo.intra_group, async_op=True)
                for piece, leader in zip(pieces, self.leaders)
            ]
        self.state.append(state)

    def _gather_in_site(self, state: _ChunkState) -> list:
        topo, buffer = self.topo, state.buffer
        if topo.site_size == 1:
            return []
        if topo.layout.equal_sites:
            return [_compat.all_gather_single(buffer, state.shard, group=topo.intra_group, async_op=True)]
        pieces = buffer.split(buffer.numel() // topo.num_rails)
        return [
            dist.broadcast(piece, src=leader, group=topo.intra_group, async_op=True)
            for piece, leader in zip(pieces, self.leaders)
        ]

    def _finish_in_site(self, i: int, chunk: Chunk) -> None:
        state = self.state[i]
        self._wait_in_site(state, i, "share")
        if chunk.padded:
            self.flat[chunk.start : chunk.end].copy_(state.buffer[: chunk.numel])

    def _residual_slice(self, i: int) -> torch.Tensor:
        return self.residual[self.residual_offsets[i] : self.residual_offsets[i + 1]]

    def _wait_wan(self, work, i: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            error = WanError(_wan_message(self.topo, self.timeout_s, i, len(self.chunks), exc))
            if not self.topo.tolerate_wan_error(error):
                raise error from exc
            # Elastic sites: the site's ranks still do the same intra-site steps, and every site discards the step
            self.wan_failed = True

    def _wait_in_site(self, state: _ChunkState, i: int, what: str) -> None:
        works, state.works = state.works, []
        for work in works:
            try:
                work.wait(self.site_timeout)
            except RuntimeError as exc:
                seconds = self.site_timeout.total_seconds()
                raise WanError(_site_message(self.topo, seconds, i, len(self.chunks), what, exc)) from exc


def _site_grace_s(timeout_s: float) -> float:
    return min(30.0, max(2.0, 0.2 * timeout_s))
