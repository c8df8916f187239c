"""``ParallelLayout``: how the ranks split into sites, data-parallel replicas and shards, pipeline stages and
tensor-parallel groups, and the one ``DeviceMesh`` that follows from it.

Mesh axes, outermost first: ``("site", "pp", "dp_replicate", "dp_shard", "tp")``.

* ``site`` is outermost, so site ``s`` owns the contiguous ranks ``[s * site_size, (s + 1) * site_size)`` and every
  group along the other axes stays inside one site: tensor- and pipeline-parallel traffic never crosses the WAN.
  Only the data-parallel replica reduction (the ``"replicate"`` groups = ``site`` x ``dp_replicate``) does, and it
  goes through the hierarchical all-reduce.
* Inside a site the order is torchtitan's: ``tp`` innermost (the fastest links: it talks every layer), then
  ``dp_shard`` (FSDP all-gathers and reduce-scatters every layer), then ``dp_replicate`` (one all-reduce per step),
  then ``pp`` (point-to-point activations, the lightest traffic, tolerant of the slowest links inside a site).

Flattened aliases on the same mesh: ``"data_parallel"`` = site x dp_replicate x dp_shard (what a Lightning
``ModelParallelStrategy`` ``configure_model`` expects), ``"tensor_parallel"`` = tp, ``"pipeline_parallel"`` = pp,
``"replicate"`` = site x dp_replicate (the groups whose gradients cross the WAN). ``data_parallel_size``, when
given, is that alias's size (as in ``ModelParallelStrategy``): it fixes ``dp_shard`` (or the one inferred size).

Unequal sites (``site_sizes``, or ``MULTIDC_SITE`` names in contiguous blocks of different sizes) differ in
``dp_shard`` only, each site its own; they train with DiLoCo only: see ``multidc.hierarchical.parallel.unequal_sites``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields, replace

from multidc.hierarchical import _env
from multidc.hierarchical.parallel._layout_checks import (
    _DATA_PARALLEL_FIELDS,
    AUTO,
    _block_sizes,
    _check_sites,
    _check_sizes_agree,
    _check_unequal,
    _fill_data_parallel,
    _parse,
    _parse_site_sizes,
    _resolve_world,
)

MESH_AXES = ("site", "pp", "dp_replicate", "dp_shard", "tp")
ALIASES = {
    "data_parallel": ("site", "dp_replicate", "dp_shard"),
    "replicate": ("site", "dp_replicate"),
    "tensor_parallel": ("tp",),
    "pipeline_parallel": ("pp",),
}
_FIELD_OF_AXIS = {
    "site": "num_sites",
    "pp": "pipeline_parallel_size",
    "dp_replicate": "dp_replicate",
    "dp_shard": "dp_shard",
    "tp": "tensor_parallel_size",
}
_ENV_OF_FIELD = {
    "num_sites": _env.NUM_SITES,
    "dp_replicate": _env.DP_REPLICATE,
    "dp_shard": _env.DP_SHARD,
    "pipeline_parallel_size": _env.PP_SIZE,
    "tensor_parallel_size": _env.TP_SIZE,
}
_DEFAULTS = {"num_sites": 1, "dp_replicate": 1, "dp_shard": -1, "pipeline_parallel_size": 1, "tensor_parallel_size": 1}


@dataclass(kw_only=True, frozen=True)
class ParallelLayout:
    """Sizes of the five mesh axes, validated. Pure data: building it touches no process group.

    A size left at ``None`` takes its environment variable (``MULTIDC_NUM_SITES``, ``MULTIDC_DP_REPLICATE``,
    ``MULTIDC_DP_SHARD``, ``MULTIDC_PP_SIZE``, ``MULTIDC_TP_SIZE``), else its default. At most one size may be
    ``-1`` or ``"auto"``: it becomes whatever makes the product equal the world size. ``dp_shard`` is the one
    inferred by default; when another size is ``-1``/``"auto"``, an unset ``dp_shard`` is 1 instead. With
    ``world_size`` given (or after ``resolve(world_size)``) every size is a concrete int and the product is checked.
    """

    num_sites: int | str | None = None
    """Sites (datacenters); ranks of site ``s`` are the ``s``-th contiguous block. Default 1; but when every rank
    sets ``MULTIDC_SITE`` (and no ``world_size`` is given here), ``resolve_job`` / ``build_mesh`` count the
    distinct names."""
    dp_replicate: int | str | None = None
    """Data-parallel replicas inside each site (HSDP replicate degree per site). Default 1."""
    dp_shard: int | str | None = None
    """FSDP2 shard degree inside a site; 1 = plain replicated data parallelism. Default ``-1`` (inferred), or 1
    when another size is ``-1``/``"auto"``."""
    pipeline_parallel_size: int | str | None = None
    """Pipeline stages (rank groups); each holds a contiguous run of the model's blocks. Default 1."""
    tensor_parallel_size: int | str | None = None
    """Tensor-parallel degree (innermost axis). Default 1."""
    data_parallel_size: int | str | None = None
    """Data-parallel ranks over all sites, ``num_sites x dp_replicate x dp_shard``: Lightning
    ``ModelParallelStrategy``'s ``data_parallel_size``. ``None``, ``-1`` or ``"auto"``: whatever the other sizes
    leave. A number fixes the one ``-1``/``"auto"`` size among those three, else ``dp_shard`` when it is unset,
    and must equal their product; with it, one of ``pipeline_parallel_size`` / ``tensor_parallel_size`` may be
    inferred from the world as well."""
    world_size: int | None = None
    """Ranks in all; when given, sizes are resolved and checked at construction."""
    site_sizes: tuple[int, ...] | None = None
    """Ranks of each site (contiguous blocks in rank order) when the sites differ in size: site ``s`` then has
    ``dp_shard = site_sizes[s] / (pipeline_parallel_size x dp_replicate x tensor_parallel_size)`` (leave
    ``dp_shard`` unset), and ``world_size`` is their sum. ``None``: equal sites; ``resolve_job`` sets it when the
    ranks' ``MULTIDC_SITE`` names form blocks of different sizes."""
    _count_sites: bool = field(default=False, init=False, repr=False, compare=False)
    """See ``counts_site_names``."""

    def __post_init__(self) -> None:
        defaulted = set()
        for name, default in _DEFAULTS.items():
            value = getattr(self, name)
            if value is None:
                env_value = _env.read(_ENV_OF_FIELD[name])
                if env_value is None:
                    defaulted.add(name)
                value = default if env_value is None else _parse(name, env_value, _ENV_OF_FIELD[name])
            object.__setattr__(self, name, _parse(name, value))
        if self.data_parallel_size is not None:
            object.__setattr__(self, "data_parallel_size", _parse("data_parallel_size", self.data_parallel_size))
        if self.site_sizes is not None and self._take_site_sizes(defaulted):
            return
        given = self._given_data_parallel_size
        # The default auto dp_shard yields to a size the user asked to infer from the same total (the world, or
        # data_parallel_size when given).
        rivals = [n for n in (_DATA_PARALLEL_FIELDS if given else _DEFAULTS) if n != "dp_shard"]
        if "dp_shard" in defaulted and any(getattr(self, n) == AUTO for n in rivals):
            object.__setattr__(self, "dp_shard", 1)
        object.__setattr__(self, "_count_sites", "num_sites" in defaulted and self.world_size is None)
        self._check_one_auto(given)
        if given and not self._count_sites:  # counted sites: resolve_job fills the sizes once it knows the count
            for name, value in _fill_data_parallel(self._sizes(), given).items():
                object.__setattr__(self, name, value)
        if self.world_size is not None:
            if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
                raise ValueError(f"ParallelLayout.world_size={self.world_size!r} must be a positive int.")
            for name, value in _resolve_world(self._sizes(), given, self.world_size).items():
                object.__setattr__(self, name, value)

    def _take_site_sizes(self, defaulted: set) -> bool:
        """Check ``site_sizes``; equal ones become ``num_sites`` and ``world_size``. Returns whether the sites are
        unequal (then resolved here: ``dp_shard`` per site, see ``dp_shards``)."""
        sizes = _parse_site_sizes(self.site_sizes)
        if "num_sites" not in defaulted and self.num_sites != len(sizes):
            raise ValueError(f"ParallelLayout: num_sites={self.num_sites} but site_sizes={list(sizes)} has "
                             f"{len(sizes)} sites; give one of them, or both alike.")
        if self.world_size is not None and self.world_size != sum(sizes):
            raise ValueError(f"ParallelLayout: site_sizes={list(sizes)} add up to {sum(sizes)} ranks, but "
                             f"world_size={self.world_size}.")
        object.__setattr__(self, "num_sites", len(sizes))
        object.__setattr__(self, "world_size", sum(sizes))
        if len(set(sizes)) == 1:
            object.__setattr__(self, "site_sizes", None)
            return False
        object.__setattr__(self, "site_sizes", sizes)
        _check_unequal(self, explicit_dp_shard="dp_shard" not in defaulted and self.dp_shard != AUTO)
        return True

    @property
    def unequal_sites(self) -> bool:
        """The sites differ in size (``site_sizes``): each its own ``dp_shard`` (``dp_shards``)."""
        return self.site_sizes is not None

    @property
    def dp_shards(self) -> tuple[int, ...]:
        """``dp_shard`` of each site, in site order."""
        self._require_resolved()
        if self.site_sizes is None:
            return (self.dp_shard,) * self.num_sites
        inner = self.pipeline_parallel_size * self.dp_replicate * self.tensor_parallel_size
        return tuple(size // inner for size in self.site_sizes)

    def site_layout(self, site: int) -> ParallelLayout:
        """The one-site layout of ``site`` (its own ``dp_shard``)."""
        return ParallelLayout(num_sites=1, dp_replicate=self.dp_replicate, dp_shard=self.dp_shards[site],
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              tensor_parallel_size=self.tensor_parallel_size,
                              world_size=self.world_size // self.num_sites if self.site_sizes is None
                              else self.site_sizes[site])

    @property
    def _given_data_parallel_size(self) -> int | None:
        size = self.data_parallel_size
        return None if size is None or size == AUTO else size

    def _check_one_auto(self, given: int | None) -> None:
        """One size per total may be inferred: the world's, and ``data_parallel_size``'s when it is given."""
        auto = [name for name in _DEFAULTS if getattr(self, name) == AUTO]
        if given is None and len(auto) > 1:
            raise ValueError(
                f"ParallelLayout: only one size can be inferred, but {auto} are all -1/'auto'; give all but one "
                f"of them a number."
            )
        dp_auto = [name for name in auto if name in _DATA_PARALLEL_FIELDS]
        if given is not None and (len(dp_auto) > 1 or len(auto) - len(dp_auto) > 1):
            raise ValueError(
                f"ParallelLayout: {auto} are all -1/'auto'; with data_parallel_size={given} at most one of "
                f"{list(_DATA_PARALLEL_FIELDS)} (taken from data_parallel_size) and one of pipeline_parallel_size, "
                f"tensor_parallel_size (taken from the world size) can be inferred; give the others a number."
            )

    def resolve(self, world_size: int) -> ParallelLayout:
        """Return this layout with concrete sizes for ``world_size`` ranks; ValueError saying what would fit."""
        if self.world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"ParallelLayout was resolved for world_size={self.world_size} but the job has {world_size} ranks."
            )
        return replace(self, world_size=world_size)

    def resolve_job(self) -> ParallelLayout:
        """This layout resolved for the running job. Every rank must call it, after ``init_process_group``.

        The world size comes from ``torch.distributed``; ``num_sites``, when neither given nor in
        ``MULTIDC_NUM_SITES``, is the number of distinct ``MULTIDC_SITE`` names when every rank sets one (else 1).
        Every rank's sizes and site name are gathered first, so a disagreement, a layout that does not fit or a
        site that is not a contiguous block of ranks raises the same ValueError on every rank.
        """
        return self._resolve_job()[0]

    def _resolve_job(self) -> tuple[ParallelLayout, list]:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ParallelLayout.resolve_job needs torch.distributed: call init_process_group first.")
        claims: list = [None] * dist.get_world_size()
        sizes = {**self._sizes(), "data_parallel_size": self.data_parallel_size}
        dist.all_gather_object(claims, (sizes, self._count_sites, _env.read(_env.SITE)))
        _check_sizes_agree(claims)
        names = [c[2] for c in claims]
        counted = self._count_sites and all(n is not None for n in names)
        blocks = _block_sizes(names) if self.site_sizes is None else None
        try:
            if blocks is not None and len(set(blocks)) > 1:  # unequal sites, from the names
                layout = replace(self, site_sizes=tuple(blocks), num_sites=len(blocks) if counted else self.num_sites)
            else:
                layout = replace(self, num_sites=len(set(names))) if counted else self
            resolved = layout.resolve(len(claims))
        except ValueError as exc:
            unequal = f", in blocks of {blocks} ranks," if blocks is not None and len(set(blocks)) > 1 else ""
            if counted:
                raise ValueError(f"num_sites={len(set(names))} was counted from the {_env.SITE} names of the ranks "
                                 f"({sorted(set(names))}){unequal} and that layout does not fit: {exc}") from None
            if unequal:
                raise ValueError(f"the {_env.SITE} names of the ranks make sites{unequal} and that layout does "
                                 f"not fit: {exc}") from None
            raise
        _check_sites(resolved, names, counted=counted)
        return resolved, names

    @property
    def counts_site_names(self) -> bool:
        """``num_sites`` was neither given nor in ``MULTIDC_NUM_SITES`` (and no ``world_size``): ``resolve_job``
        takes it from the ``MULTIDC_SITE`` names of the ranks."""
        return self._count_sites

    @property
    def resolved(self) -> bool:
        return self.world_size is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``MESH_AXES`` order (equal sites; see ``site_layout`` for unequal ones)."""
        self._require_resolved()
        self._require_equal_sites("shape")
        return tuple(getattr(self, _FIELD_OF_AXIS[axis]) for axis in MESH_AXES)

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` for ``MESH_AXES`` and the flattened aliases."""
        shape = dict(zip(MESH_AXES, self.shape))
        return {**shape, **{alias: math.prod(shape[a] for a in axes) for alias, axes in ALIASES.items()}}

    @property
    def site_size(self) -> int:
        """Ranks per site (equal sites; ``site_sizes`` for unequal ones)."""
        self._require_resolved()
        self._require_equal_sites("site_size")
        return self.world_size // self.num_sites

    @property
    def dp_size(self) -> int:
        """Data-parallel degree over all sites: different batches are fed to this many model replicas."""
        if self.unequal_sites:
            return sum(self.dp_replicate * d for d in self.dp_shards)
        return self.sizes["data_parallel"]

    @property
    def replicate_size(self) -> int:
        """Ranks holding the same shard of the same stage, across all sites: site x dp_replicate."""
        return self.sizes["replicate"]

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of ``rank`` on each of ``MESH_AXES``. Pure arithmetic, the same as the mesh's (on
        unequal sites: its site's mesh, ``"site"`` the site's index)."""
        self._require_resolved()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}.")
        if self.unequal_sites:
            site = self.site_of(rank)
            return {**self.site_layout(site).coordinates(rank - sum(self.site_sizes[:site])), "site": site}
        shape = self.shape
        coords = {}
        for axis, size in zip(reversed(MESH_AXES), reversed(shape)):
            rank, coords[axis] = divmod(rank, size)
        return {axis: coords[axis] for axis in MESH_AXES}

    def groups(self, axis: str) -> list[list[int]]:
        """Every rank group along ``axis`` (a mesh axis or an alias), each in increasing rank order."""
        axes = ALIASES.get(axis, (axis,))
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(f"unknown mesh axis {axis!r}; use one of {MESH_AXES + tuple(ALIASES)}.")
        by_key: dict[tuple, list[int]] = {}
        self._require_resolved()
        for rank in range(self.world_size):
            coords = self.coordinates(rank)
            key = tuple(coords[a] for a in MESH_AXES if a not in axes)
            by_key.setdefault(key, []).append(rank)
        return list(by_key.values())

    def site_of(self, rank: int) -> int:
        if self.unequal_sites:
            ends = [sum(self.site_sizes[: s + 1]) for s in range(self.num_sites)]
            return next(s for s, end in enumerate(ends) if rank < end)
        return rank // self.site_size

    def describe(self) -> str:
        """One line such as ``8 ranks = site 2 x pp 2 x dp_replicate 1 x dp_shard 1 x tp 2`` (unequal sites:
        ``3 ranks = sites of [2, 1] x pp 1 x dp_replicate 1 x dp_shard [2, 1] x tp 1``)."""
        if self.unequal_sites:
            return (f"{self.world_size} ranks = sites of {list(self.site_sizes)} x pp {self.pipeline_parallel_size} "
                    f"x dp_replicate {self.dp_replicate} x dp_shard {list(self.dp_shards)} x tp "
                    f"{self.tensor_parallel_size}")
        shape = self.shape
        return f"{self.world_size} ranks = " + " x ".join(f"{a} {s}" for a, s in zip(MESH_AXES, shape))

    def build_mesh(self, device_type: str = "cpu"):
        """Build the ``DeviceMesh`` (with aliases). Every rank must call it, after ``init_process_group``.

        The layout is resolved by ``resolve_job`` (world size, ``num_sites`` counted from ``MULTIDC_SITE`` when not
        given, agreement across ranks) before any mesh group is created; a mismatch raises ValueError on every rank.

        Returns:
            The root ``DeviceMesh`` with axes ``MESH_AXES``; ``mesh["data_parallel"]``, ``mesh["tensor_parallel"]``,
            ``mesh["pipeline_parallel"]`` and ``mesh["replicate"]`` are flattened views. On unequal sites, this
            rank's site's mesh (``"site"`` of size 1; ``unequal_sites.build_site_mesh``).
        """
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.resolve_job()
        if layout.unequal_sites:
            from multidc.hierarchical.parallel.unequal_sites import build_site_mesh

            return build_site_mesh(layout, device_type)
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_AXES)
        for alias, axes in ALIASES.items():
            submesh(mesh, axes)._flatten(alias)
        return mesh

    def _sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _DEFAULTS}

    def _require_resolved(self) -> None:
        if self.world_size is None:
            raise ValueError("ParallelLayout is not resolved yet: pass world_size= or call resolve(world_size).")

    def _require_equal_sites(self, what: str) -> None:
        if self.unequal_sites:
            raise ValueError(f"ParallelLayout.{what}: {self.describe()} has no single mesh; each site has its own "
                             f"(site_layout(site), multidc.hierarchical.parallel.unequal_sites).")

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"ParallelLayout({inner})"


def submesh(mesh, axis: str):
    """``mesh[axis]`` for an axis or alias of a ``build_mesh`` mesh, without torch's warning about slicing
    flattened axes from the root (it still works in torch 2.13; this is the one place to change if it stops)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
        return mesh[axis]
