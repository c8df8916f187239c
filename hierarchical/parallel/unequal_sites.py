"""Unequal sites under a parallel layout: sites that differ in ``dp_shard`` only (the same ``pipeline_parallel_size``,
``tensor_parallel_size`` and ``dp_replicate``), trained with DiLoCo (``cross_site="diloco"``).

A ``ParallelLayout`` with ``site_sizes`` (from the ranks' ``MULTIDC_SITE`` names, contiguous blocks of different
sizes) gives site ``s`` its own ``dp_shard = site_sizes[s] / (pp x dp_replicate x tp)``. No ``DeviceMesh`` spans sites
of different shapes, so ``build_site_mesh`` builds one mesh per site (every rank builds every site's, in site order:
torch creates groups collectively over the whole job) and returns this rank's, its ``"site"`` axis of size 1 and the
job's layout attached (``layout_of`` reads it). FSDP2, tensor and pipeline parallelism run on it unchanged.

What syncs with what: ranks of different sites hold different dim-0 shards of a parameter, so a rank has no peer
holding its shard. DiLoCo's topology is instead this rank's *column* (``column_topology``): the ranks of every site
with the same pipeline stage and tensor shard, sites of ``dp_replicate x dp_shard_s`` ranks. At each sync
``ShardGather`` all-gathers the fragment's pseudo-gradient over the site's ``dp_shard`` group (inside the site, on the
calling thread) into the fragment's full tensors, a layout every site shares; the hierarchical all-reduce then runs in
its ``replicated`` mode (every rank of a site holds the same values): each site sends the fragment once over the WAN,
split over ``min_s(dp_replicate x dp_shard_s)`` rails, the WAN bytes of equal sites; each rank then takes its own
shard of the result. The outer step runs on each rank's shard as before (elementwise: the same values everywhere).

Refused (ValueError on every rank): unequal sites with ``cross_site="allreduce"`` (a per-step reduction of shards that
differ between sites; use ``hierarchical_ddp``), an explicit ``dp_shard`` or inferred pipeline / tensor / replicate
sizes, and a top-k codec (its residual follows one rank's share of its own shard).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from multidc.hierarchical import Topology, WanConfig, _compat
from multidc.hierarchical.parallel.layout import ALIASES, MESH_AXES, ParallelLayout, submesh

_JOB_LAYOUT = "_multidc_job_layout"


def site_grid(layout: ParallelLayout, site: int) -> torch.Tensor:
    """Global ranks of ``site`` as its mesh, shape ``(1, pp, dp_replicate, dp_shard_s, tp)``."""
    start = sum(layout.site_sizes[:site])
    shape = (1, layout.pipeline_parallel_size, layout.dp_replicate, layout.dp_shards[site],
             layout.tensor_parallel_size)
    return torch.arange(start, start + layout.site_sizes[site]).view(shape)


def build_site_mesh(layout: ParallelLayout, device_type: str):
    """This rank's site's ``DeviceMesh`` (axes ``MESH_AXES``, the aliases flattened), the job's ``layout`` attached.
    Every rank must call it: torch creates a mesh's groups collectively over the whole job (``new_group`` numbers
    them in call order), so every rank builds every site's mesh in site order, and for a site it is not in makes
    the group creations of that mesh's aliases itself (torch cannot slice a mesh for a rank outside it)."""
    from torch.distributed.device_mesh import DeviceMesh

    own, mine = layout.site_of(dist.get_rank()), None
    for site in range(layout.num_sites):
        grid = site_grid(layout, site)
        mesh = DeviceMesh(device_type, grid, mesh_dim_names=MESH_AXES)
        for alias, axes in ALIASES.items():
            if site == own:
                submesh(mesh, axes)._flatten(alias)
            else:
                _alias_groups(grid, axes)
        mine = mesh if site == own else mine
    setattr(mine, _JOB_LAYOUT, layout)
    return mine


def _alias_groups(grid: torch.Tensor, axes: tuple[str, ...]) -> None:
    """The ``new_group`` calls ``submesh(mesh, axes)._flatten(alias)`` makes on the mesh of ``grid`` (one per group
    along the flattened axes), from a rank outside that mesh."""
    dims = [MESH_AXES.index(a) for a in axes]
    size = math.prod(grid.shape[d] for d in dims)
    for ranks in grid.movedim(dims, list(range(grid.dim() - len(dims), grid.dim()))).reshape(-1, size).tolist():
        dist.new_group(ranks)


def job_layout(mesh) -> ParallelLayout | None:
    """The job's layout attached to a site's mesh by ``build_site_mesh``; ``None`` for any other mesh."""
    return getattr(mesh, _JOB_LAYOUT, None)


def refuse_without_diloco(layout: ParallelLayout, cross_site: str, where: str) -> None:
    """ValueError (on every rank alike: the layout is) for unequal sites without DiLoCo."""
    if layout.unequal_sites and cross_site != "diloco":
        raise ValueError(
            f"{where}: the sites differ in size ({layout.describe()}), so their FSDP shards differ and a per-step "
            f"all-reduce (cross_site={cross_site!r}) has no matching shard to reduce with. Use cross_site='diloco' "
            f"(each site trains alone; DiLoCo syncs the shards across layouts), or strategy 'hierarchical_ddp' "
            f"(replicated models; unequal sites work there), or give every site the same number of ranks."
        )


def check_codec(layout: ParallelLayout, compression: str) -> None:
    """ValueError for a top-k codec on unequal sites (its residual would follow one rank's share of its shard)."""
    from multidc.hierarchical.compression import is_sparse

    if layout.unequal_sites and is_sparse(compression):
        raise ValueError(
            f"DiLoCoConfig.compression={compression!r} on unequal sites ({layout.describe()}): top-k keeps a residual "
            f"per rank for its share of the shard it syncs, and on unequal sites each fragment is synced in full "
            f"tensors gathered inside the site. Use 'none', 'bf16', 'int8' or 'int4', or sites of equal size."
        )


def columns(layout: ParallelLayout) -> list[list[int]]:
    """Per (pipeline stage, tensor shard), in that order: the global ranks of every site holding it, in rank order."""
    grids = [site_grid(layout, s) for s in range(layout.num_sites)]
    return [sorted(r for g in grids for r in g[0, pp, :, :, tp].reshape(-1).tolist())
            for pp in range(layout.pipeline_parallel_size) for tp in range(layout.tensor_parallel_size)]


def column_topology(layout: ParallelLayout, wan: WanConfig) -> Topology:
    """DiLoCo's topology for this rank: its column (see the module docstring), sites by index. Every rank must call
    it (each column's groups are created collectively, in column order)."""
    site, mine = layout.site_of(dist.get_rank()), None
    for ranks in columns(layout):
        topology = Topology.build(site=site, group=dist.new_group(ranks), wan=wan)
        mine = topology if topology is not None else mine
    return mine


def site_groups(layout: ParallelLayout) -> tuple:
    """``(site group, dp_replicate group or None)`` of this rank, as ``SiteGroups`` holds them. Every rank must call
    it."""
    grids = [site_grid(layout, s) for s in range(layout.num_sites)]
    site = dist.new_subgroups_by_enumeration([g.reshape(-1).tolist() for g in grids])[0]
    replicate = None
    if layout.dp_replicate > 1:
        rows = [row for g in grids for row in g.movedim(2, -1).reshape(-1, layout.dp_replicate).tolist()]
        replicate = dist.new_subgroups_by_enumeration(rows)[0]
    return site, replicate


def data_parallel_coordinate(layout: ParallelLayout, mesh) -> tuple[int, int]:
    """``(index, size)`` of this rank among the job's data-parallel replicas: the sites' replicas numbered in site
    order (site ``s`` has ``dp_replicate x dp_shard_s``)."""
    site = layout.site_of(dist.get_rank())
    per_site = [layout.dp_replicate * d for d in layout.dp_shards]
    return sum(per_site[:site]) + submesh(mesh, "data_parallel").get_local_rank(), sum(per_site)


class ShardGather:
    """Maps a rank's dim-0 shards of a fragment to the fragment's full tensors (the layout every site shares) and
    back: DiLoCo's ``common_layout`` on unequal sites. ``group``: the site's ``dp_shard`` ranks (FSDP2 shards dim 0
    over them in group-rank order, ``torch.chunk`` sizes)."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def fragment(self, params: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> GatheredFragment:
        """The plan for one fragment: ``params`` as placed (DTensors are sharded on dim 0 over the group, other
        tensors replicated), ``local`` this rank's tensors of them. Collective over the group (their sizes)."""
        rows = [t.shape[0] if t.dim() else 1 for t in local]
        every: list = [None] * self.size
        dist.all_gather_object(every, rows, group=self.group)
        sharded = [hasattr(p, "to_local") and t.dim() > 0 for p, t in zip(params, local)]
        return GatheredFragment(self, local, every, sharded)


class GatheredFragment:
    """One fragment's pieces: per tensor, the rows each rank of the site holds; see ``ShardGather``."""

    def __init__(self, owner: ShardGather, local: Sequence[torch.Tensor], rows: list[list[int]],
                 sharded: list[bool]) -> None:
        self.owner = owner
        widths = [math.prod(t.shape[1:]) if t.dim() else 1 for t in local]
        self.pieces = []  # per tensor: (offset in the full flat, [(start, numel) per rank]), offset locally
        full = own = 0
        for j, width in enumerate(widths):
            counts = [rows[r][j] for r in range(owner.size)] if sharded[j] else [rows[owner.rank][j]] * owner.size
            starts = [sum(counts[:r]) if sharded[j] else 0 for r in range(owner.size)]
            self.pieces.append((full, own, [(s * width, c * width) for s, c in zip(starts, counts)]))
            full += (sum(counts) if sharded[j] else counts[0]) * width
            own += counts[owner.rank] * width
        self.numel, self.local_numel = full, own
        self.padded = sum(max(n for _, n in spans) for _, _, spans in self.pieces)

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The full tensors of ``flat`` (this rank's fragment, its tensors' values concatenated), concatenated.
        Collective over the site's ``dp_shard`` group; ``flat`` itself when that group is this rank alone."""
        owner = self.owner
        if owner.size == 1:
            return flat
        padded = flat.new_zeros(self.padded)
        slot = 0
        for _, own, spans in self.pieces:
            n = spans[owner.rank][1]
            padded[slot : slot + n].copy_(flat[own : own + n])
            slot += max(m for _, m in spans)
        out = flat.new_empty(owner.size * self.padded)
        _compat.all_gather_single(out, padded, group=owner.group)
        full = flat.new_empty(self.numel)
        slot = 0
        for offset, _, spans in self.pieces:
            for r, (start, n) in enumerate(spans):
                source = r * self.padded + slot
                full[offset + start : offset + start + n].copy_(out[source : source + n])
            slot += max(m for _, m in spans)
        return full

    def take(self, full: torch.Tensor, flat: torch.Tensor) -> None:
        """Copy this rank's shards of ``full`` (a ``gather`` result) into ``flat``. Not collective."""
        if full.data_ptr() == flat.data_ptr():
            return
        for offset, own, spans in self.pieces:
            start, n = spans[self.owner.rank]
            flat[own : own + n].copy_(full[offset + start : offset + start + n])

