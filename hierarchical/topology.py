"""``Topology``: which rank sits in which site, and the process groups that follow from it.

Built once per process, collectively, right after ``init_process_group``; then passed to every hierarchical
collective. Nothing here is global: two topologies over different groups live side by side.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from multidc.hierarchical import _compat, _env
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.stats import WanStats


@dataclass(frozen=True)
class _Claim:
    """What one rank says about its own site, gathered from every rank before anything is decided."""

    site: int | str | None
    num_sites: int | None
    error: str | None = None
    wan: WanConfig | None = None
    """This rank's WAN settings: ranks must agree on them, or their collectives would not match."""


@dataclass(frozen=True)
class SiteLayout:
    """The resolved site layout, identical on every rank. Pure data: no process groups.

    ``site_ranks[s]`` lists the group ranks of site ``s`` in increasing order; ``site_names[s]`` is its name.
    """

    site_ranks: tuple[tuple[int, ...], ...]
    site_names: tuple[str, ...]

    @property
    def num_sites(self) -> int:
        return len(self.site_ranks)

    @property
    def num_rails(self) -> int:
        """Rails = the smallest site size: local index ``j < num_rails`` exists in every site."""
        return min(len(r) for r in self.site_ranks)

    @property
    def equal_sites(self) -> bool:
        return len({len(r) for r in self.site_ranks}) == 1

    def site_of(self, rank: int) -> int:
        for site, ranks in enumerate(self.site_ranks):
            if rank in ranks:
                return site
        raise ValueError(f"rank {rank} is in no site of {self.site_ranks}")

    @classmethod
    def contiguous(cls, num_sites: int, per_site: int) -> SiteLayout:
        """``num_sites`` sites of ``per_site`` ranks each, in rank order, named by their index."""
        return cls(site_ranks=tuple(tuple(range(s * per_site, (s + 1) * per_site)) for s in range(num_sites)),
                   site_names=tuple(str(s) for s in range(num_sites)))

    def rail_ranks(self, rail: int) -> tuple[int, ...]:
        """Ranks with local index ``rail`` in each site, in site order: the ranks that talk over the WAN."""
        return tuple(ranks[rail] for ranks in self.site_ranks)


def resolve_sites(claims: list[_Claim]) -> SiteLayout:
    """Turn every rank's claim (indexed by group rank) into one layout, or raise ValueError saying why.

    Every rank runs this on the same gathered claims, so every rank raises the same error.
    """
    world = len(claims)
    for rank, claim in enumerate(claims):
        if claim.error:
            raise ValueError(f"rank {rank}: {claim.error}")
    counts = sorted({c.num_sites for c in claims if c.num_sites is not None})
    if len(counts) > 1:
        per_rank = {rank: c.num_sites for rank, c in enumerate(claims)}
        raise ValueError(
            f"ranks disagree on num_sites ({per_rank}); pass the same num_sites / {_env.NUM_SITES} on every rank."
        )
    num_sites = counts[0] if counts else None
    if num_sites is not None and num_sites < 1:
        raise ValueError(f"num_sites={num_sites} must be at least 1.")
    explicit = [c.site for c in claims]
    if any(s is not None for s in explicit):
        return _explicit_layout(explicit, num_sites)
    if num_sites is None:
        return SiteLayout(site_ranks=(tuple(range(world)),), site_names=("0",))
    if world % num_sites:
        raise ValueError(
            f"{world} ranks cannot be split into num_sites={num_sites} equal contiguous sites; use a num_sites "
            f"that divides {world}, or give every rank its site (site= or {_env.SITE}) for unequal sites."
        )
    return SiteLayout.contiguous(num_sites, world // num_sites)


def _explicit_layout(sites: list[int | str | None], num_sites: int | None) -> SiteLayout:
    missing = [rank for rank, s in enumerate(sites) if s is None]
    if missing:
        raise ValueError(
            f"ranks {missing} have no site while others do; set site= or {_env.SITE} on every rank or on none."
        )
    kinds = {type(s) for s in sites}
    if kinds == {int}:
        count = num_sites if num_sites is not None else max(sites) + 1
        bad = sorted({s for s in sites if not 0 <= s < count})
        if bad:
            raise ValueError(f"site indices {bad} are outside 0..{count - 1} (num_sites={count}).")
        names = [str(s) for s in range(count)]
        index = list(sites)
    elif kinds == {str}:
        names = list(dict.fromkeys(sites))  # ordered by the lowest rank in each site
        if num_sites is not None and num_sites != len(names):
            raise ValueError(f"num_sites={num_sites} but ranks name {len(names)} sites: {names}.")
        index = [names.index(s) for s in sites]
    else:
        raise ValueError(f"sites mix indices and names ({sorted(map(str, set(sites)))}); use one kind.")
    site_ranks = tuple(tuple(r for r, s in enumerate(index) if s == site) for site in range(len(names)))
    empty = [names[s] for s, ranks in enumerate(site_ranks) if not ranks]
    if empty:
        given = f", num_sites={num_sites} from num_sites / {_env.NUM_SITES}" if num_sites is not None else ""
        raise ValueError(
            f"site(s) {empty} have no ranks (of {len(names)} sites{given}); every site needs at least one rank: fix "
            f"num_sites or the sites given per rank (site= / {_env.SITE})."
        )
    return SiteLayout(site_ranks=site_ranks, site_names=tuple(names))


def _local_claim(site: int | str | None, num_sites: int | None, wan: WanConfig | None) -> tuple[_Claim, WanConfig]:
    """This rank's claim and WAN settings from arguments, else environment.

    Errors are carried in the claim, not raised, so that every rank raises them together: see ``build``.
    """
    try:
        wan = wan if wan is not None else WanConfig()
        if site is None:
            site = _env.read(_env.SITE)
        if isinstance(site, str) and site.lstrip("-").isdigit():
            site = int(site)
        if site is not None and (isinstance(site, bool) or not isinstance(site, (int, str))):
            raise ValueError(f"site={site!r} must be an int index or a name such as 'us-east'.")
        if num_sites is None:
            num_sites = _env.read_int(_env.NUM_SITES)
        if num_sites is not None and (isinstance(num_sites, bool) or not isinstance(num_sites, int)):
            raise ValueError(f"num_sites={num_sites!r} must be an int.")
        return _Claim(site=site, num_sites=num_sites, wan=wan), wan
    except ValueError as exc:
        return _Claim(site=None, num_sites=None, error=str(exc)), wan


def _check_same_wan(claims: list[_Claim]) -> None:
    """Raise the same ValueError on every rank when ranks were given different WAN settings.

    Different ``streams`` would create different numbers of groups, different ``chunk_mb`` or ``compression``
    mismatched collectives: both hang until the WAN timeout and then blame the network.
    """
    groups: list[tuple[WanConfig, list[int]]] = []  # WanConfig compares by its fields but is not hashable
    for rank, claim in enumerate(claims):
        ranks = next((ranks for wan, ranks in groups if wan == claim.wan), None)
        if ranks is None:
            groups.append((claim.wan, ranks := []))
        ranks.append(rank)
    if len(groups) > 1:
        seen = "; ".join(f"ranks {ranks}: {wan}" for wan, ranks in groups)
        raise ValueError(
            f"ranks disagree on the WAN settings ({seen}); pass the same WanConfig / MULTIDC_WAN_* values "
            "(compression, chunk_mb, streams, timeout_s) to every rank of every site."
        )


def _create_groups(layout: SiteLayout, group, wan: WanConfig, members: list[int]) -> tuple[int, list, list]:
    """``(this rank in group, the intra-site group of each site, per stream the group of each rail)``; every rank
    of the default group must call it (torch creates groups collectively there), also those outside ``group``
    (their rank is negative). ``members``: the default-group ranks of ``group``, in its rank order."""

    def new_group(ranks, **kwargs):
        return dist.new_group([members[r] for r in ranks], **kwargs)

    intra = [new_group(ranks) for ranks in layout.site_ranks]
    timeout = datetime.timedelta(seconds=wan.timeout_s)
    rails = [[new_group(layout.rail_ranks(j), timeout=timeout) for j in range(layout.num_rails)]
             for _ in range(wan.prepared_streams)]
    return dist.get_rank(group), intra, rails


class FailFast:
    """The failure policy of a job whose sites train every step together: a failed WAN transfer raises
    (``WanError``, on every rank of the collective)."""

    def usable(self) -> bool:
        """Whether an all-reduce starting now may send over the WAN. Always."""
        return True

    def tolerate(self, error: Exception) -> bool:
        """Whether the all-reduce survives ``error`` (a failed WAN transfer). Never: it raises."""
        return False


FAIL_FAST = FailFast()


def torch_rail_all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> dist.Work:
    """Start an all-gather of ``tensor`` into the flat ``output`` over a torch rail group (the compressed WAN hop)."""
    return _compat.all_gather_single(output, tensor, group=group, async_op=True)


class Topology:
    """Sites of the ranks of one process group, with the intra-site and inter-site ("rail") groups.

    Rail ``j`` joins the ranks with local index ``j`` in every site; only rails cross the WAN. With unequal
    sites there are ``min(site sizes)`` rails and the other ranks of larger sites stay inside their site.

    One value, built by factories: ``Topology.build`` (the ranks of a process group; creates the groups),
    ``multidc.hierarchical.parallel.data_parallel.mesh_topology`` (a layout's replicas, the mesh's groups) and the
    elastic site's quorum (``multidc.hierarchical.elastic.site.quorum_topology``: torchft's group, a policy that
    discards a step instead of raising).

    Attributes:
        site: index of this process's site (sites are ordered by their lowest rank).
        site_name: the site's name (its index as a string when sites were given by index or count; an elastic
            site's own name).
        num_sites: number of sites.
        site_size: ranks in this process's site.
        local_rank_in_site: this process's index inside its site.
        rank: this process's rank in the topology (its group's rank order).
        layout: the full ``SiteLayout``, identical on every rank.
        group: the process group the topology spans (``None`` = the default group).
        intra_group: this site's group.
        rail_groups: one group per WAN stream for this rank's rail; empty for off-rail ranks.
        rail_row: this rank's row in an all-gather over its rail (``None`` off the rails).
        wan: the ``WanConfig`` every rank agreed on at build time; the default of ``all_reduce`` and the hooks.
        streams: how many WAN streams were prepared (``WanConfig.streams`` at build time).
        policy: what a failed WAN transfer does (``FAIL_FAST``: raise; an elastic step's: discard the step).
        wan_stats: bytes and seconds of this rank's WAN traffic, see ``WanStats``.
        rail_sites: the site of each member of this rank's rail groups, in the groups' rank order, for groups
            outside torch's group map (an elastic round's); ``None``: read off the groups.
    """

    def __init__(self, *, layout: SiteLayout, site: int, local_rank_in_site: int, intra_group, rail_groups: list,
                 rail_row: int | None, wan: WanConfig, group=None, rank: int | None = None, streams: int | None = None,
                 policy=FAIL_FAST, rail_all_gather=torch_rail_all_gather, wan_stats: WanStats | None = None,
                 site_name: str | None = None, rail_sites: list[int] | None = None) -> None:
        self.layout, self.group, self.wan = layout, group, wan
        self.rail_sites = rail_sites
        self.site, self.site_name = site, site_name if site_name is not None else layout.site_names[site]
        self.num_sites, self.site_size = layout.num_sites, len(layout.site_ranks[site])
        self.local_rank_in_site = local_rank_in_site
        self.rank = rank if rank is not None else layout.site_ranks[site][local_rank_in_site]
        self.intra_group, self.rail_groups, self.rail_row = intra_group, rail_groups, rail_row
        self.streams = streams if streams is not None else wan.streams
        self.policy, self._rail_all_gather = policy, rail_all_gather
        self.wan_stats = wan_stats if wan_stats is not None else WanStats()
        self._lock = threading.Lock()
        self._executor = None

    @classmethod
    def build(
        cls,
        *,
        num_sites: int | None = None,
        site: int | str | None = None,
        group: dist.ProcessGroup | None = None,
        wan: WanConfig | None = None,
    ) -> Topology | None:
        """Resolve this process's site and build the groups. Every rank of the default group must call it.

        Site of this process: ``site`` (an index or a name such as ``"us-east"``), else env ``MULTIDC_SITE``,
        else contiguous equal blocks of ranks from ``num_sites`` / env ``MULTIDC_NUM_SITES``, else one site.
        Sites may have unequal sizes and need not be contiguous in rank order.

        Args:
            num_sites: number of sites; with no explicit sites, ranks form contiguous equal blocks.
            site: this process's site index or name.
            group: the ranks to span (default: all). Ranks outside it still call ``build`` (torch creates
                groups collectively over the default group) and get ``None``.
            wan: the WAN settings every rank must share; default ``WanConfig()`` (env ``MULTIDC_WAN_*``).
                ``wan.prepared_streams`` rail groups are made per rail, with ``wan.timeout_s``; it becomes
                ``topology.wan``, the default of every hierarchical collective on this topology. Later
                collectives may use fewer streams than this, not more.

        Raises:
            ValueError: on every rank alike, before any group is created, when the layout cannot work, a
                ``MULTIDC_*`` value is bad on any rank, or ranks were given different WAN settings.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build needs torch.distributed: call init_process_group first.")
        member = group is None or dist.get_rank(group) >= 0
        # A bad MULTIDC_WAN_* value on one site travels in its claim, so the other sites raise too instead of
        # waiting in the gather; the settings themselves are compared before any group exists.
        claim, wan = _local_claim(site, num_sites, wan) if member else (None, wan)
        claims: list[_Claim | None] = [None] * dist.get_world_size()
        dist.all_gather_object(claims, claim)
        # Members sent a claim, others None: every rank learns the members, also those outside ``group``.
        members = [r for r, claim in enumerate(claims) if claim is not None]
        layout = resolve_sites([claims[r] for r in members])
        _check_same_wan([claims[r] for r in members])
        if not member:  # it only helps create the members' groups, so it takes their (agreed) settings
            wan = claims[members[0]].wan
        rank, intra, rails = _create_groups(layout, group, wan, members)
        if not member:  # it only helped create the groups
            return None
        site = layout.site_of(rank)
        local = layout.site_ranks[site].index(rank)
        rail = local if local < layout.num_rails else None
        rail_groups = [per_stream[rail] for per_stream in rails] if rail is not None else []
        rail_row = dist.get_group_rank(rail_groups[0], dist.get_rank()) if rail_groups else None
        return cls(layout=layout, site=site, local_rank_in_site=local, intra_group=intra[site], rail_groups=rail_groups,
                   rail_row=rail_row, wan=wan, group=group, rank=rank, streams=len(rails))

    @property
    def num_rails(self) -> int:
        return self.layout.num_rails

    @property
    def size(self) -> int:
        """Ranks in all sites together."""
        return sum(len(ranks) for ranks in self.layout.site_ranks)

    @property
    def rail(self) -> int | None:
        """This rank's rail index, or ``None`` for a rank that never talks over the WAN."""
        return self.local_rank_in_site if self.local_rank_in_site < self.num_rails else None

    def rail_all_gather(self, output: torch.Tensor, tensor: torch.Tensor, group) -> dist.Work:
        """Start an all-gather of ``tensor`` into the flat ``output`` over a rail group (the compressed WAN hop)."""
        return self._rail_all_gather(output, tensor, group)

    def wan_usable(self) -> bool:
        """Whether an all-reduce starting now may send over the WAN (``policy``)."""
        return self.policy.usable()

    def tolerate_wan_error(self, error: Exception) -> bool:
        """Whether a failed WAN transfer is survived (``policy``); if not, the all-reduce raises it."""
        return self.policy.tolerate(error)

    def executor(self):
        """The one worker thread that issues this topology's hierarchical collectives, in call order."""
        from multidc.hierarchical._executor import SerialExecutor

        with self._lock:
            if self._executor is None:
                self._executor = SerialExecutor(name=f"multidc-wan-site{self.site}")
            return self._executor

    def close(self) -> None:
        """Wait for queued collectives and stop the worker thread. Groups are freed with the default group."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __repr__(self) -> str:
        sizes = [len(r) for r in self.layout.site_ranks]
        return (
            f"Topology(site={self.site_name!r} ({self.site}/{self.num_sites}), site_sizes={sizes}, "
            f"local_rank_in_site={self.local_rank_in_site}, rail={self.rail})"
        )
