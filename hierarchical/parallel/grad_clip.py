"""Gradient clipping by the global norm over every shard of every stage: TP shards, FSDP shards, pipeline stages.

Each gradient piece is counted once in the whole job: a rank adds a local piece only when its coordinate is 0 on
every mesh axis over which that piece is replicated (for a plain tensor: every axis but ``pp``; for a DTensor:
every axis its placements do not shard). One scalar all-reduce over all ranks then gives the global norm, the same
value on every rank, so replicas stay bitwise identical after clipping. Under DiLoCo the sites train apart, so
each site clips by its own norm: ``per_site`` counts the pieces of every site and reduces over the site's ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from multidc.hierarchical.parallel.layout import ALIASES, MESH_AXES

if TYPE_CHECKING:
    from multidc.hierarchical.parallel.diloco import SiteGroups


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    mesh,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    per_site: SiteGroups | None = None,
) -> torch.Tensor:
    """Scale the gradients in place so their global norm is at most ``max_norm``. Every rank must call it.

    Args:
        parameters: this rank's parameters (local stages only under pipeline parallelism); plain tensors or
            DTensors on axes of ``mesh`` (or its aliases).
        max_norm: the largest allowed global norm.
        mesh: the root ``DeviceMesh`` from ``ParallelLayout.build_mesh``.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max norm.
        error_if_nonfinite: raise RuntimeError when the global norm is nan or inf.
        per_site: under ``cross_site="diloco"`` the model's ``SiteGroups`` (``ParallelModel.site_groups``): the
            norm is then this site's own, over its shards and stages, and no value crosses the WAN.

    Returns:
        The global gradient norm before clipping, a float32 scalar tensor, identical on every rank (of the site,
        with ``per_site``).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    coords = dict(zip(MESH_AXES, mesh.get_coordinate()))
    own = ("pp", "site") if per_site is not None else ("pp",)  # axes whose ranks each count their own pieces
    # On the mesh's device: no host sync per gradient, and a rank without gradients still all-reduces a tensor
    # its backend takes (NCCL refuses CPU tensors).
    total = torch.zeros((), dtype=torch.float32, device=torch.device(mesh.device_type))
    for grad in grads:
        local, sharded = _local_and_sharded_axes(grad)
        if any(coords[a] for a in MESH_AXES if a not in own and a not in sharded):
            continue  # another rank holds the same piece and counts it
        piece = torch.linalg.vector_norm(local.detach().float(), norm_type).to(total.device)
        total = torch.maximum(total, piece) if math.isinf(norm_type) else total + piece**norm_type
    group = per_site.site if per_site is not None else None
    dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    total_norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"the global gradient norm is {total_norm.item()}; refusing to clip non-finite gradients.")
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        local, _ = _local_and_sharded_axes(grad)
        local.mul_(coef.to(local.device, local.dtype))
    return total_norm


def _local_and_sharded_axes(grad: torch.Tensor) -> tuple[torch.Tensor, set[str]]:
    """The locally stored values and the root mesh axes over which they are split."""
    if not isinstance(grad, DTensor):
        return grad, set()
    names = grad.device_mesh.mesh_dim_names or ()
    sharded: set[str] = set()
    for name, placement in zip(names, grad.placements):
        axes = ALIASES.get(name, (name,))
        if any(a not in MESH_AXES for a in axes):
            raise ValueError(
                f"a gradient lives on mesh axis {name!r}, which is not an axis of the ParallelLayout mesh "
                f"{MESH_AXES + tuple(ALIASES)}; build tensor/data parallelism on that mesh."
            )
        if placement.is_shard() or "Shard" in type(placement).__name__:  # _StridedShard (FSDP over TP) too
            sharded.update(axes)
        elif not placement.is_replicate():
            raise ValueError(f"cannot clip a gradient with placement {placement} (expected Shard or Replicate).")
    return grad.to_local(), sharded
