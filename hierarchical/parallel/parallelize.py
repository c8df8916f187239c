"""``parallelize``: put a model into a ``ParallelLayout`` (tensor -> pipeline split -> data parallel), framework-
agnostic. The Lightning strategy and the Accelerate plugin are thin adapters over it.

Order, as in torchtitan: tensor parallelism on the blocks, then the pipeline split (this rank keeps its stages;
other stages' blocks are replaced by ``RemoteBlock`` placeholders that hold no parameters), then FSDP2 per block
and per stage with the hierarchical cross-site reduction (or, with ``cross_site="diloco"``, a reduction inside
each site only: see ``multidc.hierarchical.parallel.diloco``), then the schedule.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from multidc.hierarchical import Topology, WanConfig
from multidc.hierarchical.parallel import unequal_sites
from multidc.hierarchical.parallel.data_parallel import (
    add_replica_reduction,
    add_site_replica_reduction,
    apply_data_parallel,
    replicate_topology,
    set_requires_gradient_sync,
)
from multidc.hierarchical.parallel.diloco import SiteGroups, check_cross_site, diloco_topology, site_groups
from multidc.hierarchical.parallel.grad_clip import clip_grad_norm_
from multidc.hierarchical.parallel.layout import MESH_AXES, ParallelLayout, submesh
from multidc.hierarchical.parallel.pipeline import Pipeline, PipelineConfig, build_pipeline, split_blocks, stage_modules
from multidc.hierarchical.parallel.tensor_parallel import apply_tensor_parallel


class RemoteBlock(nn.Module):
    """Stands in for a block that lives on another pipeline stage; calling it is an error."""

    def __init__(self, stage: int, name: str) -> None:
        super().__init__()
        self.stage = stage
        self.block_name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"block {self.block_name!r} lives on pipeline stage {self.stage}, not on this rank. With "
            f"pipeline_parallel_size > 1 run the model through the pipeline step, not model(x)."
        )


@dataclass
class ParallelModel:
    """A model placed into a layout. ``model`` is the original object, changed in place.

    Attributes:
        model: the user's model: TP/FSDP applied; under PP, only this rank's blocks remain real.
        mesh: the root ``DeviceMesh``.
        layout: the resolved layout.
        pipeline: the pipeline, or ``None`` when ``pipeline_parallel_size == 1``.
        topology: this rank's replica topology (WAN statistics in ``topology.wan_stats``), or ``None``; under
            ``cross_site="diloco"`` DiLoCo's topology (``diloco_topology``), never ``None``.
        originals: ``{id: (weakref, qualified name)}`` of the parameters before ``parallelize`` (which TP and FSDP
            replace with new objects), for ``rebind_optimizer``.
        blocks: the ``blocks`` given to ``parallelize`` as placed now (other stages' as ``RemoteBlock``), or ``[]``.
        site_groups: under ``cross_site="diloco"`` the groups inner steps use inside the site; else ``None``.
    """

    model: nn.Module
    mesh: object
    layout: ParallelLayout
    pipeline: Pipeline | None = None
    topology: Topology | None = None
    roots: list[nn.Module] = field(default_factory=list)
    originals: dict[int, tuple[weakref.ref, str]] = field(default_factory=dict, repr=False)
    blocks: list[nn.Module] = field(default_factory=list, repr=False)
    site_groups: SiteGroups | None = None

    @property
    def cross_site(self) -> str:
        """``"diloco"`` (sites train alone between DiLoCo syncs: ``build_diloco``) or ``"allreduce"``."""
        return "allreduce" if self.site_groups is None else "diloco"

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (its pipeline stages only)."""
        return self.model.parameters()

    @property
    def replica_group(self):
        """The ranks of this rank's site that hold the same stage and shards (the ``"dp_replicate"`` axis): what
        an elastic site averages its gradients and shares its state over (``ElasticSite(replica_group=)``)."""
        return submesh(self.mesh, "dp_replicate").get_group()

    def step(self, inputs: torch.Tensor, target: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of one batch (all microbatches under PP). Every rank must call it.

        Returns:
            The batch's mean loss, detached; under PP broadcast from the last stage to every pipeline rank.
        """
        if self.pipeline is not None:
            return self.pipeline.step(inputs, target, loss_fn)
        loss = loss_fn(self.model(inputs), target)
        loss.backward()
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over every TP/FSDP shard and pipeline stage (under DiLoCo: of this site's); see
        ``grad_clip.clip_grad_norm_``."""
        return clip_grad_norm_(list(self.parameters()), max_norm, self.mesh, norm_type=norm_type,
                               per_site=self.site_groups)

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """Off: backward accumulates locally, nothing crosses sites (gradient accumulation)."""
        for root in self.roots:
            set_requires_gradient_sync(root, requires_sync)

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` at the parameters ``parallelize`` left in ``model``; works on any rank alone.

        A parameter from before ``parallelize`` becomes the parallelized parameter of the same name, or is dropped
        when another pipeline stage holds it; one that already is parallelized stays (a no-op for an optimizer
        built after ``parallelize``). Parameter groups keep their settings.

        Raises:
            ValueError: the optimizer holds parameters from before ``parallelize`` and has stepped (its state
                belongs to the replaced tensors), or parameters that are not the model's, before or after.
        """
        current = {id(p) for p in self.model.parameters()}
        after = dict(self.model.named_parameters())
        groups, stale, unknown = [], [], 0
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                entry = self.originals.get(id(p))
                if id(p) in current:
                    params.append(p)
                elif entry is not None and entry[0]() is p:
                    stale.append(p)
                    params += [after[entry[1]]] if entry[1] in after else []
                else:
                    unknown += 1
            groups.append(params)
        if unknown:
            raise ValueError(
                f"the optimizer holds {unknown} parameters that are not the model's (before or after parallelize); "
                f"build it over model.parameters()."
            )
        if any(p in optimizer.state for p in stale):
            raise ValueError(
                "the optimizer was built over the model before it was parallelized and has already stepped: its "
                "state belongs to the replaced tensors. Prepare (parallelize) the model before training."
            )
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params


def layout_of(mesh) -> ParallelLayout:
    """The resolved ``ParallelLayout`` a mesh from ``ParallelLayout.build_mesh`` was built from."""
    if tuple(mesh.mesh_dim_names or ()) != MESH_AXES:
        raise ValueError(f"expected a mesh from ParallelLayout.build_mesh with axes {MESH_AXES}.")
    if unequal_sites.job_layout(mesh) is not None:  # a site's mesh on unequal sites: the job's layout
        return unequal_sites.job_layout(mesh)
    sites, pp, rep, shard, tp = mesh.shape
    return ParallelLayout(
        num_sites=sites, pipeline_parallel_size=pp, dp_replicate=rep, dp_shard=shard, tensor_parallel_size=tp,
        world_size=mesh.size(),
    )


def parallelize(
    model: nn.Module,
    mesh,
    *,
    blocks: Sequence[nn.Module] | None = None,
    tensor_parallel: str | Callable | None = None,
    pipeline: PipelineConfig | None = None,
    wan: WanConfig | None = None,
    wrap_root: bool = True,
    device: torch.device | str = "cpu",
    cross_site: str = "allreduce",
) -> ParallelModel:
    """Place ``model`` into the layout of ``mesh``, in place. Every rank must call it with the same model.

    Args:
        model: the full model, identical on every rank (same seed).
        mesh: from ``ParallelLayout.build_mesh``.
        blocks: the model's ordered blocks (submodules of ``model``): block 0 takes the input tensor, each next
            block the previous one's output, the last one's output goes to the loss. Required when
            ``pipeline_parallel_size > 1``; otherwise they become the FSDP units.
        tensor_parallel: ``None`` (already applied, or tp = 1), ``"transformer"`` (``apply_tensor_parallel`` on
            the blocks), or ``fn(model, tp_mesh)``.
        pipeline: schedule settings; default ``PipelineConfig()`` when pp > 1.
        wan: cross-site reduction settings; default ``WanConfig()``.
        wrap_root: make ``model`` the outer FSDP unit (its ``forward`` must be what runs); ``False`` wraps each
            outermost submodule with parameters instead, looking into ``ModuleList``/``ModuleDict`` (a
            LightningModule whose ``training_step`` calls its children). Ignored under pipeline parallelism.
        device: where stages run.
        cross_site: ``"allreduce"``: replicas' gradients averaged across sites every step, hierarchically.
            ``"diloco"``: only inside each site (nothing crosses the WAN on a step); then ``build_diloco`` once the
            optimizer exists.

    Raises:
        ValueError: before any change, when ``cross_site`` is neither, pp > 1 without blocks, blocks are not
            submodules of ``model``, the blocks cannot be split into the stages, blocks of different stages share a
            parameter (tied weights), or (``wrap_root=False``) a module holds parameters directly.
    """
    layout = layout_of(mesh)
    check_cross_site(cross_site)
    unequal_sites.refuse_without_diloco(layout, cross_site, "parallelize")
    names = _block_names(model, blocks or ())
    originals = {id(p): (weakref.ref(p), n) for n, p in model.named_parameters()}
    if layout.pipeline_parallel_size == 1:
        roots = [model] if wrap_root else _fsdp_roots(model)
    if layout.pipeline_parallel_size > 1:
        if not blocks:
            raise ValueError(
                f"pipeline_parallel_size={layout.pipeline_parallel_size} needs the model's ordered blocks: pass "
                f"blocks=[...] (a LightningModule defines pipeline_blocks())."
            )
        pipeline = pipeline if pipeline is not None else PipelineConfig()
        num_stages = layout.pipeline_parallel_size * pipeline.stages_per_rank
        _check_ties_within_stages(blocks, names, split_blocks(len(blocks), num_stages, pipeline.split_points))
        pipeline.resolved_microbatches(layout.pipeline_parallel_size)
    if tensor_parallel == "transformer":
        apply_tensor_parallel(blocks or [model], submesh(mesh, "tensor_parallel"))
    elif callable(tensor_parallel):
        tensor_parallel(model, submesh(mesh, "tensor_parallel"))
    elif tensor_parallel is not None:
        raise ValueError(f"tensor_parallel={tensor_parallel!r}: use None, 'transformer' or fn(model, tp_mesh).")
    topology, groups = _replicas(mesh, wan, cross_site)
    if layout.pipeline_parallel_size == 1:
        for root in roots:
            units = [b for b in (blocks or ()) if b is not root and _is_within(b, root)]
            apply_data_parallel(root, mesh, units=units, wan=wan)
            _reduce_replicas(root, mesh, topology, groups, wan)
        return ParallelModel(model, mesh, layout, None, topology, roots, originals, list(blocks or ()), groups)
    stages = stage_modules(list(blocks), mesh, pipeline)
    local_blocks = {id(b) for stage in stages.values() for b in stage}
    _drop_remote_blocks(model, blocks, names, local_blocks, layout, pipeline)
    for stage in stages.values():
        apply_data_parallel(stage, mesh, units=list(stage), wan=wan, reshard_after_forward=False)
        _reduce_replicas(stage, mesh, topology, groups, wan)
    built = build_pipeline(stages, mesh, pipeline, device)
    placed = [model.get_submodule(name) for name in names]  # other stages' blocks are RemoteBlocks now
    return ParallelModel(model, mesh, layout, built, topology, list(stages.values()), originals, placed, groups)


def adopt_sharded(module: nn.Module, mesh, *, wan: WanConfig | None = None,
                  cross_site: str = "allreduce") -> ParallelModel:
    """A module that applied ``fully_shard`` itself over ``mesh["dp_shard"]`` (a ``configure_model`` sharding over
    ``"data_parallel"`` inside ``data_parallel_within_sites``): add the replica reduction ``parallelize`` would
    (``cross_site`` as there) to its FSDP units on that axis. Every rank must call it. Without pipeline
    parallelism only.

    Raises:
        ValueError: bad ``cross_site``; under ``"diloco"`` with ``dp_replicate > 1``, no FSDP unit on
            ``mesh["dp_shard"]`` (the site's replicas would drift apart), on every rank alike.
    """
    check_cross_site(cross_site)
    unequal_sites.refuse_without_diloco(layout_of(mesh), cross_site, "adopt_sharded")
    topology, groups = _replicas(mesh, wan, cross_site)
    reduced = _reduce_replicas(module, mesh, topology, groups, wan)
    if groups is None and topology is not None and reduced == 0:
        topology.close()
        topology = None
    if groups is not None and groups.replicate is not None and reduced == 0:
        raise ValueError(
            f"cross_site='diloco' with dp_replicate={submesh(mesh, 'dp_replicate').size()}, but no FSDP unit of "
            f"{type(module).__name__} is sharded over the data-parallel mesh, so nothing would keep the replicas of "
            f"a site equal; apply fully_shard(..., mesh=device_mesh['data_parallel']) in configure_model, or leave "
            f"data parallelism to the strategy."
        )
    return ParallelModel(module, mesh, layout_of(mesh), topology=topology, roots=[module], site_groups=groups)


def _replicas(mesh, wan: WanConfig | None, cross_site: str) -> tuple[Topology | None, SiteGroups | None]:
    """The replicas' topology and, under DiLoCo, the site's own groups. Every rank must call it."""
    if cross_site == "diloco":
        return diloco_topology(mesh, wan), site_groups(mesh)
    return replicate_topology(mesh, wan), None


def _reduce_replicas(root: nn.Module, mesh, topology, groups: SiteGroups | None, wan) -> int:
    """The per-step replica reduction of ``root``'s FSDP units: across sites hierarchically (``"allreduce"``), or
    over the site's own replica group (``"diloco"``). Returns how many units reduce."""
    if groups is not None:
        return add_site_replica_reduction(root, mesh, groups.replicate) if groups.replicate is not None else 0
    return add_replica_reduction(root, mesh, topology, wan=wan) if topology is not None else 0


def _block_names(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    where = {id(m): name for name, m in model.named_modules() if name}
    missing = [i for i, b in enumerate(blocks) if id(b) not in where]
    if missing:
        raise ValueError(f"blocks {missing} are not submodules of {type(model).__name__}; declare its own modules.")
    return [where[id(b)] for b in blocks]


def _check_ties_within_stages(blocks: Sequence[nn.Module], names: list[str], ranges: list[range]) -> None:
    """ValueError when one ``Parameter`` (tied weights) is held by blocks of two pipeline stages: each stage would
    update its own copy and the two would silently come apart."""
    owner: dict[int, tuple[int, int, str]] = {}
    for stage, indices in enumerate(ranges):
        for index in indices:
            for param_name, param in blocks[index].named_parameters():
                name = f"{names[index]}.{param_name}"
                first_stage, first_index, first_name = owner.setdefault(id(param), (stage, index, name))
                if first_stage != stage:
                    raise ValueError(
                        f"parameter {first_name!r} (block {first_index}, pipeline stage {first_stage}) is the same "
                        f"Parameter as {name!r} (block {index}, stage {stage}): tied weights across stages would be "
                        f"updated separately on each stage and come apart. Untie them (give each block its own "
                        f"nn.Parameter), or keep blocks {first_index}..{index} on one stage with split_points (stages "
                        f"now start at blocks {[r.start for r in ranges]})."
                    )


def _fsdp_roots(module: nn.Module) -> list[nn.Module]:
    """The outermost submodules with parameters whose ``forward`` runs: containers are looked into."""
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"{type(module).__name__} holds parameters directly; move them into a submodule.")
    roots = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # no forward of their own: FSDP cannot hook them
            roots += _fsdp_roots(child)
        else:
            roots.append(child)
    return roots


def _is_within(module: nn.Module, root: nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _drop_remote_blocks(model, blocks, names, local_ids, layout, config) -> None:
    """Replace the blocks of other stages with parameter-free ``RemoteBlock`` placeholders."""
    ranges = split_blocks(len(blocks), layout.pipeline_parallel_size * config.stages_per_rank, config.split_points)
    stage_of = {i: s for s, r in enumerate(ranges) for i in r}
    for index, (block, name) in enumerate(zip(blocks, names)):
        if id(block) in local_ids:
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent._modules[leaf] = RemoteBlock(stage_of[index], name)


def prepare_parallel(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], mesh, **parallelize_kwargs
) -> ParallelModel:
    """``parallelize`` a model whose optimizers already exist (Accelerate's ``prepare`` order), then rebind them.

    Every rank must call it. The optimizers must not have stepped; their parameter groups keep their settings
    and lose the parameters of other pipeline stages. ``parallelize_kwargs`` as for ``parallelize``.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for optimizer in optimizers:
        _check_fresh(optimizer, names)
    prepared = parallelize(model, mesh, **parallelize_kwargs)
    for optimizer in optimizers:
        prepared.rebind_optimizer(optimizer)
    return prepared


def data_parallel_coordinate(mesh) -> tuple[int, int]:
    """``(index, size)`` of this rank among the data-parallel replicas: ranks with the same index (the stages
    and tensor shards of one replica) must get the same batches; shard a data loader over ``size`` by ``index``.
    On unequal sites the sites' replicas are numbered in site order."""
    layout = unequal_sites.job_layout(mesh)
    if layout is not None:
        return unequal_sites.data_parallel_coordinate(layout, mesh)
    data_parallel = submesh(mesh, "data_parallel")
    return data_parallel.get_local_rank(), data_parallel.size()


def _check_fresh(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    if optimizer.state:
        raise ValueError("the optimizer has already stepped; prepare the model and optimizer before training.")
    unknown = sum(id(p) not in names for group in optimizer.param_groups for p in group["params"])
    if unknown:
        raise ValueError(f"{unknown} optimizer parameters are not parameters of the model being prepared.")
