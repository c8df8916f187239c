"""A DDP communication hook that sends each gradient bucket through the hierarchical all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist

from multidc.hierarchical.all_reduce import _check, residual_numel, submit
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.topology import Topology


class HierarchicalHookState:
    """State of one registered hook: the topology, the WAN settings and per-bucket error-feedback residuals.

    With error feedback, each rank keeps, for every bucket, what WAN compression dropped from the shards it
    sent, and adds it to the next step's shards, so the compression error does not accumulate over steps.
    """

    def __init__(self, topology: Topology, wan: WanConfig, error_feedback: bool) -> None:
        self.topology = topology
        self.wan = wan
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}

    def residual(self, index: int, buffer: torch.Tensor) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        numel = residual_numel(buffer.numel(), buffer.element_size(), self.topology, self.wan)
        current = self.residuals.get(index)
        if current is None or current.numel() != numel:  # first step, or DDP rebuilt its buckets
            current = self.residuals[index] = torch.zeros(numel, dtype=torch.float32, device=buffer.device)
        return current


def hierarchical_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Average ``bucket`` over all ranks hierarchically; the future resolves to the bucket's buffer."""
    buffer = bucket.buffer()
    return submit(buffer, state.topology, state.wan, op="avg", residual=state.residual(bucket.index(), buffer))


def register_ddp_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    topology: Topology,
    *,
    wan: WanConfig | None = None,
    error_feedback: bool | None = None,
) -> HierarchicalHookState:
    """Route every gradient bucket of ``ddp_model`` through ``all_reduce`` (``op="avg"``), asynchronously.

    Communication overlaps backward: each bucket is queued as soon as DDP hands it over. Call once, before the
    first backward, on every rank.

    Args:
        ddp_model: a ``DistributedDataParallel`` model over the same ranks as ``topology``.
        topology: from ``Topology.build``.
        wan: WAN settings; default ``WanConfig()``.
        error_feedback: keep per-bucket compression residuals; default on for ``int8``, off otherwise.

    Returns:
        The hook state (its ``residuals`` are inspectable).
    """
    wan = wan if wan is not None else WanConfig()
    _check(torch.empty(0), topology, wan, "avg")
    ddp_size = dist.get_world_size(ddp_model.process_group)
    if ddp_size != topology.size:
        raise ValueError(
            f"the DDP model spans {ddp_size} ranks but the topology {topology.size}; build the topology over "
            f"the DDP model's process group (Topology.build(group=...))."
        )
    if error_feedback is None:
        error_feedback = wan.compression == "int8"
    state = HierarchicalHookState(topology, wan, error_feedback)
    ddp_model.register_comm_hook(state, hierarchical_hook)
    return state
