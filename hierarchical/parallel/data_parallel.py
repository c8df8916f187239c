"""Data parallelism for the layout: FSDP2 inside a site, hierarchical WAN reduction across replicas.

``apply_data_parallel`` shards parameters with ``fully_shard`` over the ``"dp_shard"`` axis only (1 = plain
replicated data parallelism: FSDP2 over a one-rank axis shards nothing, as torch's own ``replicate`` does). The
replicas (axes ``site`` x ``dp_replicate``) are then reduced by an FSDP all-reduce hook that runs
``multidc.hierarchical``'s chunked, optionally compressed, hierarchical all-reduce on each reduce-scatter output:
inside the site first, across the WAN once per shard. No flat all-reduce crosses sites. Under DiLoCo
(``cross_site="diloco"``) the hook averages the ``dp_replicate`` replicas inside the site only
(``add_site_replica_reduction``) and DiLoCo syncs the sites.

A module sharded by its own code (Lightning ``ModelParallelStrategy`` style, ``fully_shard(m,
mesh=mesh["data_parallel"])``) gets the same treatment: inside ``data_parallel_within_sites`` that call shards over
``"dp_shard"``, and ``add_replica_reduction`` adds the hook afterwards.

Gradient accumulation: ``set_requires_gradient_sync(model, False)`` skips the reduce-scatter and the hook, so a
non-sync micro-step sends nothing over the WAN.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical import SiteLayout, Topology, WanConfig
from multidc.hierarchical._error_feedback import ErrorFeedback, default_error_feedback, refuse_sparse_per_step
from multidc.hierarchical.all_reduce import submit
from multidc.hierarchical.parallel._patches import fsdp_mesh_info, resolving_fsdp_meshes_with
from multidc.hierarchical.parallel.layout import submesh


def mesh_topology(mesh, wan: WanConfig) -> Topology:
    """The ``Topology`` of this rank's ``"replicate"`` group of the mesh, from the mesh's own groups.

    ``Topology.build`` would create every site and rail group again, collectively, for each of the
    ``world / replicate`` replicate groups. The mesh already has them: the intra-site group is the
    ``"dp_replicate"`` axis and rail 0 is the ``"site"`` axis. Extra WAN streams get their own rail groups (every
    rank must call it then).
    """
    num_sites, per_site = submesh(mesh, "site").size(), submesh(mesh, "dp_replicate").size()
    layout = SiteLayout.contiguous(num_sites, per_site)
    rail_groups = [submesh(mesh, "site").get_group()] + _extra_rail_groups(mesh, wan.streams - 1)
    return Topology(layout=layout, site=mesh.get_local_rank("site"),
                    local_rank_in_site=mesh.get_local_rank("dp_replicate"),
                    intra_group=submesh(mesh, "dp_replicate").get_group(), rail_groups=rail_groups,
                    rail_row=dist.get_group_rank(rail_groups[0], dist.get_rank()), wan=wan,
                    group=submesh(mesh, "replicate").get_group())


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
    return mesh_topology(mesh, wan)


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
        error_feedback: keep per-unit compression residuals; default on for ``int8`` and ``int4``.

    Returns:
        ``module`` (now an ``FSDPModule``).
    """
    from torch.distributed.fsdp import fully_shard

    shard_mesh = submesh(mesh, "dp_shard")
    for unit in units:
        fully_shard(unit, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
    if topology is not None:
        add_replica_reduction(module, mesh, topology, wan=wan, error_feedback=error_feedback)
    return module


def add_replica_reduction(
    module: nn.Module, mesh, topology: Topology, *, wan: WanConfig | None = None, error_feedback: bool | None = None
) -> int:
    """Reduce the replicas of every FSDP unit of ``module`` sharded over ``mesh["dp_shard"]``, hierarchically.

    Such a unit's reduce-scatter stays inside the site; an FSDP all-reduce hook then averages its output over the
    ``"replicate"`` ranks (``site`` x ``dp_replicate``) through ``multidc.hierarchical``. Units on other meshes are
    left as they are. Every rank must call it with the same module.

    Args:
        module: a model (or stage) after ``fully_shard``.
        mesh: the root mesh from ``ParallelLayout.build_mesh``.
        topology: from ``replicate_topology(mesh, wan)``.
        wan: WAN settings for the cross-site hop; default ``topology.wan``.
        error_feedback: keep per-unit compression residuals; default on for ``int8`` and ``int4``.

    Returns:
        How many units now reduce their replicas.
    """
    replicas = submesh(mesh, "replicate").size()
    if topology.size != replicas:
        raise ValueError(
            f"topology spans {topology.size} ranks but the mesh's replicate axis has {replicas}; build it with "
            f"replicate_topology(mesh)."
        )
    wan = wan if wan is not None else topology.wan
    refuse_sparse_per_step(wan.compression, "the replicas' FSDP all-reduce hook")
    feedback = default_error_feedback(wan.compression) if error_feedback is None else error_feedback
    state = _ReplicaReduction(topology, wan, feedback)
    units = _units_on(module, submesh(mesh, "dp_shard"))
    for index, unit in enumerate(units):
        unit.set_all_reduce_hook(partial(_reduce_replicas, state, index))
    return len(units)


def add_site_replica_reduction(module: nn.Module, mesh, group) -> int:
    """Average the replicas of every FSDP unit of ``module`` sharded over ``mesh["dp_shard"]`` over ``group``: the
    ``dp_replicate`` ranks of this rank's site, for ``cross_site="diloco"``, where nothing crosses the WAN on an
    inner step. ``group`` must be a group of its own (``SiteGroups.replicate``), never a topology's: DiLoCo's
    syncs use those from their worker thread. Every rank must call it with the same module.

    Returns:
        How many units now average their replicas inside the site.
    """
    size = dist.get_world_size(group)
    units = _units_on(module, submesh(mesh, "dp_shard"))
    for unit in units:
        unit.set_all_reduce_hook(partial(_average_in_site, group, size))
    return len(units)


def _average_in_site(group, size: int, reduce_output: torch.Tensor) -> None:
    """FSDP all-reduce hook (FSDP runs it on its all-reduce stream): the mean over the site's replicas."""
    dist.all_reduce(reduce_output, group=group)  # a sum: gloo has no ReduceOp.AVG
    reduce_output.div_(size)


def _units_on(module: nn.Module, shard_mesh) -> list[nn.Module]:
    """The FSDP units of ``module`` whose own parameters FSDP shards over ``shard_mesh``'s ranks (FSDP puts its
    shard axis first in each parameter's mesh, before any tensor-parallel axis)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    shard_ranks = dist.get_process_group_ranks(shard_mesh.get_group())
    found = []
    for unit in (m for m in module.modules() if isinstance(m, FSDPModule)):
        meshes = [p.device_mesh for p in _own_parameters(unit) if isinstance(p, DTensor)]
        if meshes and all(dist.get_process_group_ranks(m.get_group(0)) == shard_ranks for m in meshes):
            found.append(unit)
    return found


def _own_parameters(unit: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters of ``unit`` outside the FSDP units nested in it: the ones its own reduce-scatter handles."""
    from torch.distributed.fsdp import FSDPModule

    stack = [unit]
    while stack:
        module = stack.pop()
        yield from module.parameters(recurse=False)
        stack += [child for child in module.children() if not isinstance(child, FSDPModule)]


class _ReplicaReduction:
    """What the FSDP hooks of one model share: topology, WAN settings and, with error feedback (int8), one
    residual per FSDP unit (see ``multidc.hierarchical._error_feedback``)."""

    def __init__(self, topology: Topology, wan: WanConfig, error_feedback: bool) -> None:
        self.topology = topology
        self.wan = wan
        self.feedback = ErrorFeedback(topology, wan) if error_feedback else None

    def residual(self, index: int, values: torch.Tensor) -> torch.Tensor | None:
        return self.feedback.residual(index, values) if self.feedback is not None else None


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


@contextmanager
def data_parallel_within_sites(mesh) -> Generator[bool, None, None]:
    """Inside, ``fully_shard(m, mesh=mesh["data_parallel"])`` shards ``m`` over ``mesh["dp_shard"]`` instead.

    For a module written for Lightning's ``ModelParallelStrategy``, whose ``configure_model`` shards over the
    1-D ``"data_parallel"`` mesh: across sites, that mesh would all-gather parameters and reduce-scatter gradients
    over the WAN in every forward and backward. Sharded inside the site instead, the module keeps a replica per
    ``site`` x ``dp_replicate`` index, which ``add_replica_reduction`` then reduces hierarchically, once per step.
    The ``"data_parallel"`` mesh the module sees is unchanged (still 1-D, over all sites); only what ``fully_shard``
    does with it changes. Other meshes pass through. Parameters and optimizer state take ``num_sites x
    dp_replicate`` times the memory they would take sharded over all of ``"data_parallel"``.

    torch has no public way to pick the mesh behind a caller's back, so this swaps ``fully_shard``'s private mesh
    resolution for the duration of the block (``multidc.hierarchical.parallel._patches``). Yields
    ``False`` and changes nothing when the mesh has one site, or when this torch lacks that function.
    """
    original = fsdp_mesh_info()
    if original is None or submesh(mesh, "site").size() == 1:
        yield False
        return
    flat, shard = submesh(mesh, "data_parallel"), submesh(mesh, "dp_shard")

    def get_mesh_info(user_mesh, dp_mesh_dims=None):
        if dp_mesh_dims is None and user_mesh == flat:
            return original(shard, None)
        return original(user_mesh, dp_mesh_dims)

    with resolving_fsdp_meshes_with(get_mesh_info):
        yield True
