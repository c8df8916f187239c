"""The ``Checkpointer``'s steps under regions (one store per site; the protocol is ``checkpoint.regions``'s):
planning a save per region (and the copies of each site's own state in other regions, with ``replicas``), writing
the regional commit record, opening a checkpoint in this rank's view, and reporting the bytes a load read from
other regions."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from torch.distributed.checkpoint.storage import WriteResult

from multidc.hierarchical import _env
from multidc.plugins.checkpoint.format import (
    COMMIT,
    Commit,
    RegionalCommit,
    commit_record,
    decode_any,
    encode_regional_commit,
)
from multidc.plugins.checkpoint.object_store import ObjectStore
from multidc.plugins.checkpoint.regions import CheckpointRegionUnavailableError, Regions
from multidc.plugins.checkpoint.storage import subset

_log = logging.getLogger("multidc.plugins.checkpoint")


def plan_by_region(planner, plans: list, regions_of_rank: list[str]) -> list:
    """DCP's global save plan made for each region's ranks alone (replicated state striped over them, stored once
    per region; a key held with other values by another site stays that site's); each region's metadata goes to
    ``planner.region_metadata``. Returns every rank's plan, in rank order.

    Raises:
        ValueError: a region's ranks hold only part of a tensor (state sharded across sites, e.g.
            ``fsdp_across_sites=True``): no region would hold it whole, so a load from one region would miss the rest.
    """
    out, planner.region_metadata = [None] * len(plans), {}
    for region in dict.fromkeys(regions_of_rank):
        ranks = [rank for rank, r in enumerate(regions_of_rank) if r == region]
        _check_whole([plans[rank] for rank in ranks], region)
        region_plans, metadata = planner.create_global_plan([plans[rank] for rank in ranks])
        planner.region_metadata[region] = metadata
        for rank, plan in zip(ranks, region_plans, strict=True):
            out[rank] = plan
    return out


def _check_whole(plans: list, region: str) -> None:
    """ValueError naming the first tensor of which ``region``'s ranks (their local save plans) hold only a part."""
    chunks: dict[str, dict[tuple, int]] = {}
    sizes: dict[str, tuple] = {}
    for plan in plans:
        for item in plan.items:
            if item.tensor_data is None:
                continue
            fqn, chunk = item.index.fqn, item.tensor_data.chunk
            sizes[fqn] = tuple(item.tensor_data.size)
            chunks.setdefault(fqn, {})[tuple(chunk.offsets)] = math.prod(chunk.sizes)  # replicas: the same chunk
    for fqn, size in sizes.items():
        held = sum(chunks[fqn].values())
        if held < math.prod(size):
            raise ValueError(
                f"region-local checkpoint: the ranks of region {region!r} hold only {held} of the {math.prod(size)} "
                f"elements of {fqn!r} (state sharded across sites, e.g. Parallel3DStrategy(fsdp_across_sites=True)), "
                f"so no region would hold it whole: save it with one URL, or shard it inside each site only.")


@dataclass(frozen=True)
class Shard:
    """A rank's shard object (``file``, in its own region) whose items of the keys ``copied`` (its site's own state)
    also go to each region of ``to``, as the object :func:`copy_file` names there."""

    file: str
    copied: frozenset
    to: tuple[str, ...]


def file_of(storage_data) -> str:
    """The shard object a rank's global save plan names (its ``storage_data``: the file, or a :class:`Shard`)."""
    return storage_data.file if isinstance(storage_data, Shard) else storage_data


def copy_file(file: str) -> str:
    """The object holding a rank's copy of its site's own items in another region: ``data/copy-rank00002.distcp``
    for ``data/rank00002.distcp`` (its own region's shard may hold more items under the plain name)."""
    folder, _, leaf = file.rpartition("/")
    return f"{folder}/copy-{leaf}" if folder else f"copy-{leaf}"


def with_copies(plans: list, regions_of_rank: list[str], targets: dict[str, tuple[str, ...]]) -> list:
    """Every rank's global save plan (its shard file assigned), a rank that holds keys no other region holds (its
    site's own state: a DiLoCo site model, per-rank residuals) given a :class:`Shard` that also sends those items
    to ``targets[its region]`` (``regions.replica_targets``). Keys several regions hold are not copied: a site whose
    region is lost reads them from another region already."""
    if not any(targets.values()):
        return plans
    held: dict[str, set[str]] = {}
    for plan, region in zip(plans, regions_of_rank, strict=True):
        held.setdefault(region, set()).update(item.index.fqn for item in plan.items)
    out = []
    for plan, region in zip(plans, regions_of_rank, strict=True):
        elsewhere = set().union(*(keys for other, keys in held.items() if other != region))
        own = frozenset(item.index.fqn for item in plan.items) - elsewhere
        if own and targets.get(region):
            plan = dataclasses.replace(plan, storage_data=Shard(plan.storage_data, own, targets[region]))
        out.append(plan)
    return out


def sending_copies(send, storage_data, regions: Regions):
    """``send`` (``storage.upload``'s signature) that, for a :class:`Shard`, then uploads the copied items to each
    region of ``Shard.to`` (errors naming the region); the copies' results carry their region in
    ``ItemLocation.region``."""
    if not isinstance(storage_data, Shard):
        return send

    def send_all(staged, store, name: str, stop=None) -> list:
        results = list(send(staged, store, name, stop))
        copy = subset(staged, storage_data.copied, copy_file(staged.file))
        for region in storage_data.to:
            sent = regions.call(region, lambda target: send(copy, target, name, stop))
            results += [WriteResult(index=r.index, size_in_bytes=r.size_in_bytes,
                                    storage_data=dataclasses.replace(r.storage_data, region=region)) for r in sent]
        return results

    return send_all


def commit(regions: Regions, region_metadata: dict, results: list[list], regions_of_rank: list[str], *, name: str,
           step: int, extra: dict | None) -> dict[str, set[str]]:
    """Write the regional commit record of checkpoint ``name`` (rank 0, after every upload succeeded) into every
    region: each region's part lists the items stored there, copies of other sites' own state included (their
    result names the region); returns each region's shard objects. Raises if a region's record could not be
    written (then none is)."""
    held: dict[str, list] = {region: [] for region in region_metadata}  # region -> [(writer's region, result)]
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            region = result.storage_data.region or regions_of_rank[rank]
            held.setdefault(region, []).append((regions_of_rank[rank], result))
    parts, files_by_region = {}, {}
    for region, entries in held.items():
        locations, files = {}, {}
        for _, result in entries:
            loc = dataclasses.replace(result.storage_data, region=None)
            locations[result.index] = loc
            files[loc.file] = max(files.get(loc.file, 0), loc.offset + loc.length)
        metadata = _part_metadata(region_metadata, region, entries)
        metadata.storage_data = locations
        parts[region] = commit_record(metadata, locations, step=step, world_size=len(results), files=files,
                                      extra=extra)
        files_by_region[region] = set(files)
    regions.commit(name, encode_regional_commit(parts, step=step, world_size=len(results), extra=extra))
    return files_by_region


def _part_metadata(region_metadata: dict, region: str, entries: list):
    """The DCP metadata of ``region``'s part: its own ranks' (``region_metadata[region]``; none for a region without
    ranks) and, for each copied item, its key's entry in the metadata of the region that wrote it."""
    own = region_metadata.get(region) or next(iter(region_metadata.values()))
    entries_md = dict(own.state_dict_metadata) if region in region_metadata else {}
    planner_data = dict(own.planner_data or {}) if region in region_metadata else {}
    for source, result in entries:
        fqn = result.index.fqn
        if source != region:
            entries_md[fqn] = region_metadata[source].state_dict_metadata[fqn]
            if fqn in (region_metadata[source].planner_data or {}):
                planner_data[fqn] = region_metadata[source].planner_data[fqn]
    return dataclasses.replace(own, state_dict_metadata=entries_md, planner_data=planner_data, storage_data=None)


def open_view(comm, regions: Regions, which, *, what: str) -> tuple[str, Commit, dict[str, str]]:
    """``(name, this rank's view of its commit record, {unavailable region: why})`` for ``which``, on every rank
    (collective): its own region first when available, then the other available regions in site order. Refused
    credentials of any rank's region fail the load on every rank, naming the region."""

    def open_():
        up, down = regions.available()  # on every rank: the same requests, so the same error on every rank
        if comm.rank != 0:
            return None
        name = regions.resolve(which, up)
        source = regions.local if regions.local in up else up[0]
        return name, regions.call(source, ObjectStore.get, f"{name}/{COMMIT}"), source, up, down

    name, raw, source, up, down = comm.broadcast(comm.raise_if_any(open_, what=what))
    record = decode_any(raw, regions.stores[source].where(f"{name}/{COMMIT}"))
    if not isinstance(record, RegionalCommit):  # saved with one URL into what is now one of the regions
        record = RegionalCommit(step=record.step, world_size=record.world_size, created_unix=record.created_unix,
                                extra=record.extra, parts={source: record})
    if regions.local not in up and regions.local in down:
        _log.warning("checkpoint region %r (this site's) is unavailable, reading %s from regions %s: %s",
                     regions.local, name, up, down[regions.local])
    order = ([regions.local] if regions.local in up else []) + [r for r in up if r != regions.local]
    return name, record.view(order), down


def check_held(commit: Commit, wanted, *, name: str, down: dict[str, str]) -> None:
    """Raise ``CheckpointRegionUnavailableError`` if a key of ``wanted`` (flattened state dict keys) is held only by
    regions outside ``commit``'s view (``Commit.elsewhere``); ``down`` says why a region is unavailable. Every rank
    sees the same regions left out, so the ranks that want such keys raise the same message."""
    missing = sorted(key for key in wanted if key in commit.elsewhere)
    if not missing:
        return
    held = sorted({region for key in missing for region in commit.elsewhere[key]})
    why = "; ".join(f"region {r!r}: " + (f"unavailable ({down[r]})" if r in down else "this job has no URL for it")
                    for r in held)
    keys = ", ".join(repr(key) for key in missing[:3]) + (", ..." if len(missing) > 3 else "")
    raise CheckpointRegionUnavailableError(
        f"{len(missing)} key(s) of checkpoint {name} ({keys}) are stored only in region(s) {', '.join(map(repr, held))}"
        f", which this load cannot read: {why}. Bring that region's store back (or give this job its URL and "
        f"credentials: url[{held[0]!r}] / {_env.CKPT_URL}, storage_options[{held[0]!r}] / "
        f"{_env.CKPT_STORAGE_OPTIONS}) and load again; or load a state without those keys (a site's own state is "
        "saved in its region only), or an older checkpoint.")


def log_crossing(schedule, rank: int, sites: list[int], regions_of_rank: list[str]) -> int:
    """On the lowest rank of each site, log one line: the bytes this site's ranks read from other regions' stores
    in ``schedule`` (a ``ReadSchedule``). Returns that count (0 elsewhere)."""
    site, region = sites[rank], regions_of_rank[rank]
    if sites.index(site) != rank:
        return 0
    crossed: dict[str, int] = {}
    for piece in schedule.pieces():
        source = schedule.locations[piece.loc].region
        if sites[piece.reader] == site and source != region:
            crossed[source] = crossed.get(source, 0) + piece.size
    total = sum(crossed.values())
    if total:
        _log.warning("site %r: this load reads %d bytes (%.1f MiB) from other regions (%s)", region, total,
                     total / (1 << 20), ", ".join(f"{r}: {n} bytes" for r, n in sorted(crossed.items())))
    else:
        _log.info("site %r: this load reads 0 bytes from other regions", region)
    return total
