"""DiLoCo across the sites of a parallel layout: each site trains alone (FSDP2 / tensor / pipeline parallelism
inside it) and every ``sync_every`` steps ``multidc.hierarchical.DiLoCo`` averages the sites' pseudo-gradients.
Framework-free: ``Parallel3DStrategy(cross_site="diloco")`` and the Accelerate plugin are thin adapters over it.

A training loop::

    mesh = ParallelLayout(num_sites=2, dp_shard=2).build_mesh()
    pm = parallelize(model, mesh, blocks=model.blocks(), cross_site="diloco")
    optimizer = torch.optim.AdamW(pm.parameters())
    diloco = build_diloco(pm, optimizer, DiLoCoConfig(sync_every=50))   # collective, after the optimizer exists
    for x, y in batches:   # this rank's rows: data_parallel_coordinate(mesh)
        pm.step(x, y, loss_fn)
        optimizer.step()   # DiLoCo steps in the optimizer's post-hook
        optimizer.zero_grad()
    diloco.close()

The invariant it protects: nothing crosses the WAN on inner steps, and nothing on an inner step uses a group of
DiLoCo's topology (its syncs run on the topology's worker thread; two threads issuing collectives on one group
deadlock). So under ``cross_site="diloco"`` the per-step replica reduction (``dp_replicate > 1``) runs over a
group of its own (``SiteGroups.replicate``), gradient clipping takes each site's own norm over ``SiteGroups.site``,
and no gradient is reduced across sites.

What syncs with what: DiLoCo works on local shards (``DTensor.to_local()``). Its topology (``diloco_topology``)
is this rank's ``"replicate"`` mesh group: the ranks of every site and ``dp_replicate`` index that hold the same
pipeline stage, FSDP shard and tensor shard as this one. Each rank therefore averages only its own shard, with
the ranks holding that shard in the other sites; the settings and fragment sizes that ``DiLoCo`` compares across
its topology are those of one shard, and ``build_diloco`` compares the settings over the whole job as well.

Fragments (streaming DiLoCo) are the model's blocks dealt strided by their index in the whole model: block ``i``
is in fragment ``i mod fragments``, as without pipeline parallelism. Under pipeline parallelism a rank holds
only its stages' blocks (the others are parameter-free ``RemoteBlock`` placeholders that keep the indices), so
each stage syncs its part of fragment ``p`` at fragment ``p``'s step, together with the ranks holding the same
stage: the whole model's fragment ``p`` syncs at once, as it would in one process. Every fragment needs a
trainable parameter on every stage: ``fragments`` at most the fewest blocks a stage holds.

Checkpoints: the model and optimizer states differ between sites (store them under ``site_key(topology.site)``),
and the DiLoCo state differs between shards: store ``DiLoCoShardState(diloco, mesh)`` under ``"diloco"``. Resume
with the same layout (the DiLoCo state is per local shard; the model state alone would reshard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical import DiLoCo, DiLoCoConfig, Topology, WanConfig
from multidc.hierarchical.diloco.config import CROSS_SITE_MODES, agree, config_or_default
from multidc.hierarchical.diloco.fragments import split_fragments
from multidc.hierarchical.parallel import unequal_sites
from multidc.hierarchical.parallel.data_parallel import mesh_topology
from multidc.hierarchical.parallel.layout import submesh
from multidc.hierarchical.parallel.unequal_sites import job_layout

if TYPE_CHECKING:
    from multidc.hierarchical.parallel.parallelize import ParallelModel


def check_cross_site(cross_site: str) -> str:
    """``cross_site`` if it is ``"allreduce"`` or ``"diloco"`` (front-ends resolve ``MULTIDC_CROSS_SITE`` and their
    ``diloco=`` with ``multidc.hierarchical.diloco.config.resolve_cross_site``); else a ValueError."""
    if cross_site not in CROSS_SITE_MODES:
        raise ValueError(
            f"cross_site={cross_site!r}: choose 'allreduce' (every step's gradients cross the WAN) or 'diloco' (sites "
            f"train alone; build_diloco syncs them every DiLoCoConfig.sync_every steps)."
        )
    return cross_site


@dataclass(frozen=True)
class SiteGroups:
    """The process groups inner steps use under ``cross_site="diloco"``: this site's ranks only, and none of them
    a group of DiLoCo's topology (see the module docstring). Built by ``site_groups(mesh)``."""

    site: Any
    """Every rank of this rank's site (gradient clipping by the site's norm); ``None`` when the job is one site
    (the default group)."""
    replicate: Any
    """This rank's ``dp_replicate`` ranks (same stage and shards, same site), for the per-step replica average;
    ``None`` when ``dp_replicate == 1``."""


def site_groups(mesh) -> SiteGroups:
    """New groups for inner-step traffic inside each site (see ``SiteGroups``). Every rank must call it."""
    layout = job_layout(mesh)
    if layout is not None:  # unequal sites: the mesh is this site's only
        return SiteGroups(*unequal_sites.site_groups(layout))
    full = mesh.mesh  # [site, pp, dp_replicate, dp_shard, tp] global ranks
    sites = [row.reshape(-1).tolist() for row in full]
    site = dist.new_subgroups_by_enumeration(sites)[0] if len(sites) > 1 else None
    replicate = None
    if submesh(mesh, "dp_replicate").size() > 1:
        rows = full.movedim(2, -1).reshape(-1, full.shape[2]).tolist()
        replicate = dist.new_subgroups_by_enumeration(rows)[0]
    return SiteGroups(site=site, replicate=replicate)


def diloco_topology(mesh, wan: WanConfig | None = None) -> Topology:
    """DiLoCo's topology for this rank: its ``"replicate"`` mesh group (``site`` x ``dp_replicate``, the ranks
    holding the same stage and shards), also when that is this rank alone (one site: DiLoCo is local training plus
    the outer optimizer). Every rank must call it (extra WAN streams create groups collectively). On unequal sites,
    the ranks of every site holding this rank's stage and tensor shard (``unequal_sites.column_topology``)."""
    wan = wan if wan is not None else WanConfig()
    layout = job_layout(mesh)
    if layout is not None:
        return unequal_sites.column_topology(layout, wan)
    return mesh_topology(mesh, wan)


def build_diloco(
    parallel: ParallelModel,
    optimizer: torch.optim.Optimizer | None,
    config: DiLoCoConfig | None = None,
    *,
    wan: WanConfig | None = None,
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
) -> DiLoCo:
    """``DiLoCo`` over a model placed by ``parallelize(..., cross_site="diloco")``. Every rank of the job calls it,
    after the inner optimizer exists (and before a checkpoint is loaded into it).

    Args:
        parallel: from ``parallelize`` / ``prepare_parallel`` / ``adopt_sharded`` with ``cross_site="diloco"``.
        optimizer: the inner optimizer over ``parallel.parameters()``: DiLoCo steps after each of its steps.
            ``None``: call ``diloco.step()`` after every inner step yourself.
        config: ``DiLoCoConfig``; ``None`` builds ``DiLoCoConfig()`` (env ``MULTIDC_DILOCO_*``) on every rank.
        wan: as for ``DiLoCo``; defaults to the topology's.
        outer_optimizer: as for ``DiLoCo``.

    Raises:
        ValueError: on every rank alike: the model was not placed with ``cross_site="diloco"``, bad settings,
            settings that differ between ranks, or a fragment without parameters on some rank (more fragments
            than a pipeline stage holds blocks).
    """
    if parallel.site_groups is None:
        raise ValueError(
            "build_diloco needs a model placed with cross_site='diloco' (parallelize / prepare_parallel / "
            "adopt_sharded): with 'allreduce' the sites' gradients are already averaged every step."
        )
    config, blocks = _agree(parallel, config)
    common = None
    if parallel.layout.unequal_sites:  # each site its own shards: sync the fragments' full tensors
        common = unequal_sites.ShardGather(submesh(parallel.mesh, "dp_shard").get_group())
    return DiLoCo(parallel.model, optimizer, parallel.topology, config, wan=wan, outer_optimizer=outer_optimizer,
                  blocks=blocks, common_layout=common)


def _agree(parallel: ParallelModel, config: DiLoCoConfig | None) -> tuple[DiLoCoConfig, list[nn.Module] | None]:
    """The settings and blocks, after every rank of the job compared its settings and checked its fragments:
    ``DiLoCo`` itself compares only the ranks of one shard, which must not be left running when another shard's
    ranks fail (they would wait in the next pipeline or FSDP collective)."""
    blocks, error = parallel.blocks or None, None
    try:
        config = config_or_default(config)
        unequal_sites.check_codec(parallel.layout, config.compression)
        _check_fragments(parallel, config.fragments, blocks)
    except Exception as exc:  # noqa: BLE001  (any failure: told to every rank, or the others wait in the gather)
        error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    agree(error, config)  # over the whole job
    return config, blocks


def _check_fragments(parallel: ParallelModel, fragments: int, blocks: list[nn.Module] | None) -> None:
    try:
        split_fragments(parallel.model, fragments, blocks)
    except ValueError as exc:
        if parallel.pipeline is None or blocks is None:
            raise
        from multidc.hierarchical.parallel.parallelize import RemoteBlock

        here = [i for i, block in enumerate(blocks) if not isinstance(block, RemoteBlock)]
        raise ValueError(
            f"{exc} Under pipeline parallelism block i of the whole model is in fragment i mod fragments, and every "
            f"stage must hold a parameter of every fragment; this rank holds blocks {here} of {len(blocks)}: use "
            f"fragments <= the fewest blocks a stage holds."
        ) from None


class DiLoCoShardState:
    """The checkpoint entry for ``DiLoCo`` under a parallel layout (Stateful): its state under a key naming this
    rank's shard (pipeline stage, FSDP shard, tensor shard, with the layout's sizes), since ranks of different
    shards hold different DiLoCo states while all ranks of one shard hold the same outer state (stored once) and,
    with a top-k codec, each its own residuals for its shard (under its global rank). Put it under ``"diloco"``
    next to ``{site_key(site): model and optimizer state}``; loading needs the same layout.
    ``state_dict()`` / ``load_state_dict()`` are collective, as ``DiLoCo``'s."""

    def __init__(self, diloco: DiLoCo, mesh) -> None:
        self.diloco = diloco
        self.key = shard_key(mesh)

    def state_dict(self) -> dict:
        return {self.key: self.diloco.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.diloco.load_state_dict(state[self.key])


def shard_key(mesh) -> str:
    """``"pp<i>of<n>_dp_shard<i>of<n>_tp<i>of<n>"``: which shard of the model this rank holds, in which layout."""
    return "_".join(f"{axis}{mesh.get_local_rank(axis)}of{submesh(mesh, axis).size()}"
                    for axis in ("pp", "dp_shard", "tp"))

