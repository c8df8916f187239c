"""Data parallelism for the layout: FSDP2 inside a site, hierarchical WAN reduction across replicas.

``apply_data_parallel`` shards parameters with ``fully_shard`` over the ``"dp_shard"`` axis only (1 = plain
replicated data parallelism: FSDP2 over a one-rank axis shards nothing, as torch's own ``replicate`` does). The
replicas (axes ``site`` x ``dp_replicate``) are then reduced by an FSDP all-reduce hook that runs
``multidc.hierarchical``'s chunked, optionally compressed, hierarchical all-reduce on each reduce-scatter output:
inside the site first, across the WAN once per shard. No flat all-reduce crosses sites.

Gradient accumulation: ``set_requires_gradient_sync(model, False)`` skips the reduce-scatter and the hook, so a
non-sync micro-step sends nothing over the WAN.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical import SiteLayout, Topology, WanConfig, WanStats
from multidc.hierarchical.all_reduce import residual_numel, submit
from multidc.strategies.parallel.layout import submesh


class _MeshTopology(Topology):
    """A ``Topology`` over this rank's ``"replicate"`` group of the mesh, reusing the mesh's groups.

    ``Topology.build`` would create every site and rail group again, collectively, for each of the
    ``world / replicate`` replicate groups. The mesh already has them: the intra-site group is the
    ``"dp_replicate"`` axis and rail 0 is the ``"site"`` axis. Extra WAN streams get their own rail groups.
    Sets exactly the attributes ``Topology.__init__`` sets, so every hierarchical collective accepts it.
    """

    def __init__(self, mesh, wan: WanConfig) -> None:  # noqa: D107 - see class docstring
        num_sites, per_site = submesh(mesh, "site").size(), submesh(mesh, "dp_replicate").size()
        self.layout = SiteLayout(
            site_ranks=tuple(tuple(range(s * per_site, (s + 1) * per_site)) for s in range(num_sites)),
            site_names=tuple(str(s) for s in range(num_sites)),
        )
        self.group = submesh(mesh, "replicate").get_group()
        self.wan = wan
        self.streams = wan.streams
        self.wan_stats = WanStats()
        self._lock = threading.Lock()
        self._executor = None
        self.site = mesh.get_local_rank("site")
        self.site_name = self.layout.site_names[self.site]
        self.num_sites = num_sites
        self.site_size = per_site
        self.local_rank_in_site = mesh.get_local_rank("dp_replicate")
        self.rank = self.site * per_site + self.local_rank_in_site
        self.intra_group = submesh(mesh, "dp_replicate").get_group()
        self.rail_groups = [submesh(mesh, "site").get_group()] + _extra_rail_groups(mesh, wan.streams - 1)


def _extra_rail_groups(mesh, count: int) -> list:
    """``count`` more groups per site-axis group (one per extra WAN stream). Every rank must call it."""
    if count <= 0 or submesh(mesh, "site").size() == 1:
        return []
    full = mesh.mesh  # [site, pp, dp_replicate, dp_shard, tp] global ranks
    site_groups = full.movedim(0, -1).reshape(-1, full.shape[0]).tolist()
    mine = []
    for _ in range(count):
        group, _ = dist.new_subgroups_by_enumeration(site_groups)
        mine.append(group)
    return mine


def replicate_topology(mesh, wan: WanConfig | None = None) -> Topology | None:
    """The hierarchical topology of this rank's replicas (``site`` x ``dp_replicate``); ``None`` when alone.

    Every rank must call it (extra WAN streams create groups collectively).
    """
    wan = wan if wan is not None else WanConfig()
    if submesh(mesh, "replicate").size() == 1:
        return None
    return _MeshTopology(mesh, wan)


def apply_data_parallel(
    module: nn.Module,
    mesh,
    *,
    units: Sequence[nn.Module] = (),
    topology: Topology | None = None,
    wan: WanConfig | None = None,
    reshard_after_forward: bool = True,
    error_feedback: bool | None = None,
) -> nn.Module:
    """Shard ``module`` with FSDP2 over ``"dp_shard"`` and reduce replicas hierarchically. In place.

    Each of ``units`` (e.g. transformer blocks) becomes its own FSDP unit, then ``module`` (the rest). Tensor
    parallelism, if any, must already be applied (parameters as DTensors on ``mesh["tp"]``).

    Args:
        module: the model or one pipeline stage.
        mesh: the root mesh from ``ParallelLayout.build_mesh``.
        units: submodules to shard separately, in forward order.
        topology: from ``replicate_topology(mesh, wan)``; ``None`` when this rank has no replicas.
        wan: WAN settings for the cross-site hop; default ``topology.wan``.
        reshard_after_forward: free gathered parameters after forward (False under pipeline parallelism avoids
            one all-gather per microbatch).
        error_feedback: keep per-unit compression residuals; default on for ``int8``.

    Returns:
        ``module`` (now an ``FSDPModule``).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    replicas = submesh(mesh, "replicate").size()
    if topology is not None and topology.size != replicas:
        raise ValueError(
            f"topology spans {topology.size} ranks but the mesh's replicate axis has {replicas}; build it with "
            f"replicate_topology(mesh)."
        )
    shard_mesh = submesh(mesh, "dp_shard")
    for unit in units:
        fully_shard(unit, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    if topology is not None:
        wan = wan if wan is not None else topology.wan
        if error_feedback is None:
            error_feedback = wan.compression == "int8"
        state = _ReplicaReduction(topology, wan, error_feedback)
        fsdp_units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for index, unit in enumerate(fsdp_units):
            unit.set_all_reduce_hook(partial(_reduce_replicas, state, index))
    return module


class _ReplicaReduction:
    """What the FSDP hooks of one model share: topology, WAN settings, per-unit error-feedback residuals.

    With error feedback (int8), each unit keeps what WAN compression dropped from the shards this rank sent and
    adds it back next step, so the compression error does not accumulate.
    """

    def __init__(self, topology: Topology, wan: WanConfig, error_feedback: bool) -> None:
        self.topology = topology
        self.wan = wan
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}

    def residual(self, index: int, values: torch.Tensor) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        numel = residual_numel(values.numel(), values.element_size(), self.topology, self.wan)
        current = self.residuals.get(index)
        if current is None or current.numel() != numel:
            current = self.residuals[index] = torch.zeros(numel, dtype=torch.float32, device=values.device)
        return current


def _reduce_replicas(state: _ReplicaReduction, index: int, reduce_output: torch.Tensor) -> None:
    """FSDP all-reduce hook: average this unit's reduce-scatter output over the replicas, hierarchically."""
    if reduce_output.is_cuda:  # FSDP produced it on another stream; the WAN worker thread must see it finished
        torch.cuda.current_stream().synchronize()
    residual = state.residual(index, reduce_output)
    submit(reduce_output, state.topology, state.wan, op="avg", residual=residual).wait()
    if reduce_output.is_cuda:
        torch.cuda.synchronize(reduce_output.device)


def set_requires_gradient_sync(module: nn.Module, requires_sync: bool) -> None:
    """Turn gradient reduction (intra-site and WAN) on or off for every FSDP unit in ``module``."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_requires_gradient_sync(requires_sync, recurse=False)


def fsdp_mesh_crosses_sites(module: nn.Module, mesh) -> bool:
    """True when a parameter of ``module`` is sharded or replicated by FSDP over ranks of different sites, i.e. its
    gradient reduction would cross the WAN flat instead of through the hierarchical hook."""
    from torch.distributed.tensor import DTensor

    site_size = mesh.size() // submesh(mesh, "site").size()
    if site_size == mesh.size():
        return False
    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        param_mesh = param.device_mesh
        for dim in range(param_mesh.ndim):
            if param_mesh.size(dim) > 1:
                ranks = dist.get_process_group_ranks(param_mesh.get_group(dim))
                if len({r // site_size for r in ranks}) > 1:
                    return True
    return False
