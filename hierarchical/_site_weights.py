"""The sites' weights of a weighted all-reduce (``all_reduce(weight=...)``): every site's share of the total, the
same float32 values on every rank, in site order.

Two exchanges, by what a WAN failure does (the topology's ``policy``):

* a job whose sites train together (``FailFast``): one all-reduce of a slot per rank over the job's group, checked
  alike everywhere (a bad part raises the same ValueError on every rank);
* an elastic round (the quorum's topology, a failure discards the round): the site's total over its own ranks,
  then one all-gather of the sites' totals over this rank's rail (torchft's group: the job has no group that spans
  the sites). A failed exchange discards the round as a failed transfer does, and the sites weigh the same (the
  round's result is not applied anywhere).
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.errors import wan_failure
from multidc.hierarchical.topology import FailFast, Topology


def site_weights(topology: Topology, wan: WanConfig, weight: float, device: torch.device) -> torch.Tensor | None:
    """Every site's share of the total weight (float32, site order) from every rank's part ``weight``. Collective
    over the topology's ranks, on the calling thread. None when there is one site, the sites weigh the same (or
    nothing), or an elastic round's exchange failed (the round is then discarded)."""
    if topology.num_sites == 1:
        return None
    part = float(weight) if isinstance(weight, (int, float)) else math.nan
    exchange = _over_job if isinstance(topology.policy, FailFast) else _over_rail
    sites = exchange(topology, datetime.timedelta(seconds=wan.timeout_s), part, device)
    if sites is None:
        return None
    total = sum(sites)
    if total <= 0 or len(set(sites)) == 1:
        return None
    return torch.tensor([w / total for w in sites], dtype=torch.float64).float()


def _over_job(topology: Topology, timeout: datetime.timedelta, part: float, device) -> list[float]:
    parts = torch.zeros(topology.size, dtype=torch.float64, device=device)
    parts[topology.rank] = part
    try:
        dist.all_reduce(parts, group=topology.group, async_op=True).wait(timeout)
    except RuntimeError as exc:
        raise wan_failure(topology, "exchanging the sites' weights", timeout.total_seconds(), exc) from exc
    parts = parts.cpu().tolist()
    bad = {rank: w for rank, w in enumerate(parts) if not (math.isfinite(w) and w >= 0)}
    if bad:
        raise ValueError(f"all_reduce(weight=...): ranks {sorted(bad)} gave {list(bad.values())}; every rank's part "
                         f"of its site's weight must be a finite number >= 0 (e.g. the samples it trained).")
    sites = [0.0] * topology.num_sites
    for rank, w in enumerate(parts):
        sites[topology.layout.site_of(rank)] += w
    return sites


def _over_rail(topology: Topology, timeout: datetime.timedelta, part: float, device) -> list[float] | None:
    if not topology.rail_groups or topology.num_rails != topology.site_size:
        raise ValueError("all_reduce(weight=...) in an elastic round needs every rank on a rail (sites of equal size).")
    bad = not (math.isfinite(part) and part >= 0)  # sent as NaN: every rank of the site raises below, none hangs
    own = torch.tensor([math.nan if bad else part], dtype=torch.float64, device=device)
    dist.all_reduce(own, group=topology.intra_group)  # inside the site: its collectives do not discard a round
    if not math.isfinite(own.item()):
        raise ValueError(f"all_reduce(weight=...): a rank of site {topology.site_name!r} gave a part that is not a "
                         f"finite number >= 0 (this rank: {part}); every rank's part of its site's weight must be one "
                         "(e.g. the samples it trained).")
    if not topology.wan_usable():
        return None
    totals = own.new_zeros(topology.num_sites)
    try:
        topology.rail_all_gather(totals, own, topology.rail_groups[0]).wait(timeout)
    except Exception as exc:  # noqa: BLE001 - the policy decides: an elastic round records it and is discarded
        if not topology.tolerate_wan_error(exc):
            raise wan_failure(topology, "exchanging the sites' weights", timeout.total_seconds(), exc) from exc
        return None
    rows = totals.cpu().tolist()
    sites = [0.0] * topology.num_sites
    for site, w in zip(row_sites(topology), rows):
        sites[site] = w
    return sites


def row_sites(topology: Topology) -> list[int]:
    """The site of each row of an all-gather over this rank's rails (their ranks in the rail group's order)."""
    if topology.rail_sites is not None:  # a group outside torch's group map (an elastic round's, torchft's)
        return list(topology.rail_sites)
    members = dist.get_process_group_ranks(topology.rail_groups[0])  # default-group ranks, in rail-group order
    if topology.group is not None:
        members = [dist.get_group_rank(topology.group, g) for g in members]
    return [topology.layout.site_of(r) for r in members]
