"""``multidc ckpt ls|verify|rm`` for a region-local checkpoint (one store per site, ``checkpoint.regions``).

The URL arguments become a ``Regions``: a ``{site}`` template with ``--sites N`` (sites ``0``..``N-1``) or
``--sites a,b``, or ``--region NAME=URL`` once per region; each region's storage options from
``MULTIDC_CKPT_STORAGE_OPTIONS`` (a JSON object site -> options), as in training. What each command does per region:

* ``ls``: the checkpoints committed in every available region, one line per region (its part: bytes, shards,
  items); an unavailable region is left out with a warning.
* ``verify``: every region must be available; each region's shards are checked against that region's part of the
  regional commit record (``verify.verify`` with the part, whose shard names are the region's own), and the
  records of all regions must be the same bytes.
* ``rm``: every region must be available before anything is deleted; the commit record goes from every region
  first, then the folders, so a half-done ``rm`` never leaves a checkpoint committed everywhere with shards gone.
"""

from __future__ import annotations

import datetime
import json
import logging
import time

from multidc.hierarchical import _env
from multidc.plugins.checkpoint import retention
from multidc.plugins.checkpoint.format import COMMIT, RegionalCommit, checkpoint_name, decode_any, parse_step
from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreError
from multidc.plugins.checkpoint.regions import SITE, Regions, is_regional, site_urls
from multidc.plugins.checkpoint.state import SITE_PREFIX
from multidc.plugins.checkpoint.verify import verify

_log = logging.getLogger("multidc.plugins.checkpoint")
_MIB = 1 << 20


def regions_from_args(url, options, *, sites: str | None) -> Regions | None:
    """The ``Regions`` a regional ``url`` (a ``{site}`` template or a mapping from ``--region``) names, or ``None``
    for one store. ValueError: a template without ``--sites``, or ``--sites`` without a template."""
    if not is_regional(url):
        if sites is not None:
            raise ValueError(f"--sites is for a URL with {SITE} (one store per site); {url!r} has none.")
        return None
    if isinstance(url, dict):
        names = list(url)
        if sites is not None:
            raise ValueError("--sites is for a URL with {site}; --region NAME=URL names the regions already.")
    elif sites is None:
        raise ValueError(f"{url!r} has {SITE}: pass --sites N (sites 0..N-1) or --sites NAME,NAME, or one "
                         "--region NAME=URL per region.")
    else:
        names = list(range(int(sites))) if sites.isdigit() else [s for s in sites.split(",") if s]
        if not names:
            raise ValueError(f"--sites {sites!r}: pass a number of sites >= 1 or comma-separated site names.")
    urls, per_region = site_urls(url, options, site_names=[str(n) for n in names], setting="--region")
    return Regions(urls, per_region, local=next(iter(urls)), setting=_env.CKPT_STORAGE_OPTIONS)


def parse_region(text: str) -> tuple[str, str]:
    """``NAME=URL`` of ``--region``; ValueError otherwise."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise ValueError(f"--region {text!r}: expected NAME=URL, e.g. --region us=s3://ckpt-us/run1.")
    return name, url


def _up(regions: Regions, *, every: bool, what: str) -> list[str]:
    """The available regions; with ``every`` an unavailable one raises ObjectStoreError naming it, else it is
    logged and left out. Refused credentials always raise (naming the region and the setting)."""
    up, down = regions.available()
    for region, why in down.items():
        if every:
            raise ObjectStoreError(f"cannot {what}: checkpoint region {region!r} is unavailable: {why}")
        _log.warning("checkpoint region %r is unavailable, left out: %s", region, why)
    if not up:
        raise ObjectStoreError(f"no checkpoint region is available ({regions.where()})")
    return up


def _committed(regions: Regions, up: list[str]) -> list[tuple[int, str]]:
    """``(step, name)`` committed in every region of ``up``, oldest first."""
    return sorted(set.intersection(*(set(regions.call(r, retention.committed)) for r in up)))


def _record(regions: Regions, region: str, name: str) -> RegionalCommit:
    store = regions.stores[region]
    record = decode_any(regions.call(region, ObjectStore.get, f"{name}/{COMMIT}"), store.where(f"{name}/{COMMIT}"))
    if not isinstance(record, RegionalCommit):  # saved with one URL into what is now one of the regions
        record = RegionalCommit(step=record.step, world_size=record.world_size, created_unix=record.created_unix,
                                extra=record.extra, parts={region: record})
    return record


def _describe(regions: Regions, up: list[str], step: int, name: str) -> dict:
    record = _record(regions, up[0], name)
    parts = {r: {"url": regions.stores[r].where(name) if r in regions.stores else None,
                 "bytes": sum(p.files.values()), "shards": len(p.files), "items": len(p.locations)}
             for r, p in record.parts.items()}
    sites = sorted({fqn.split(".", 1)[0] for p in record.parts.values() for fqn in p.metadata.state_dict_metadata
                    if fqn.startswith(SITE_PREFIX)})
    created = datetime.datetime.fromtimestamp(record.created_unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return {"step": step, "name": name, "bytes": sum(p["bytes"] for p in parts.values()), "sites": sites,
            "world_size": record.world_size, "shards": sum(p["shards"] for p in parts.values()),
            "created_utc": created, "regions": parts}


def ls(regions: Regions, args) -> int:
    up = _up(regions, every=False, what="list")
    rows = [_describe(regions, up, step, name) for step, name in _committed(regions, up)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print(f"no checkpoint committed in every available region ({regions.where()})")
        return 0
    print(f"{'step':>12s} {'region':>10s} {'size MiB':>10s} {'sites':>12s}  {'layout':28s} {'created (UTC)':19s}")
    for row in rows:
        sites = ",".join(s.removeprefix(SITE_PREFIX) for s in row["sites"]) or "-"
        for region, part in row["regions"].items():
            layout = f"{row['world_size']} ranks, {part['shards']} shards, {part['items']} items"
            print(f"{row['step']:12d} {region:>10s} {part['bytes'] / _MIB:10.1f} {sites:>12s}  {layout:28s} "
                  f"{row['created_utc']}")
    return 0


def _chosen(regions: Regions, up: list[str], args) -> list[str]:
    done = _committed(regions, up)
    if args.all or args.step is None:
        if not done:
            raise FileNotFoundError(f"no checkpoint committed in every region ({regions.where()})")
        return [name for _, name in done] if args.all else [done[-1][1]]
    name = checkpoint_name(args.step)
    for region in up:
        regions.call(region, retention.require_committed, name)  # FileNotFoundError naming the region's folder
    return [name]


def verify_all(regions: Regions, args) -> int:
    """``verify`` of every region's part; returns the exit status (0, 1 corrupt, 2 a region not given)."""
    up = _up(regions, every=True, what="verify every region's part")
    code, unchecked = 0, set()
    for name in _chosen(regions, up, args):
        raw = {r: regions.call(r, ObjectStore.get, f"{name}/{COMMIT}") for r in up}
        first = up[0]
        for region in up:
            started = time.monotonic()
            store, record = regions.stores[region], _record(regions, region, name)
            part = record.parts.get(region)
            unchecked |= set(record.parts) - set(regions.stores)
            problems = [] if raw[region] == raw[first] else [
                f"commit record {store.where(f'{name}/{COMMIT}')} differs from region {first!r}'s"]
            if part is None:
                print(f"OK      region {region!r} {store.where(name)}: holds no items of step {record.step}")
                continue
            verdict = verify(store, name, commit=part, slice_bytes=int(args.slice_mb * _MIB),
                             concurrency=args.concurrency)
            problems += verdict.problems
            if problems:
                code = 1
                print(f"CORRUPT region {region!r} {store.where(name)}: {len(problems)} problem(s)")
                for problem in problems:
                    print(f"  {problem}")
            else:
                print(f"OK      region {region!r} {store.where(name)}: step {record.step}, {verdict.items} items, "
                      f"{verdict.bytes_read / _MIB:.1f} MiB checked in {time.monotonic() - started:.1f} s")
    if unchecked:
        print(f"NOT CHECKED region(s) {sorted(unchecked)}: the commit record lists them, no URL was given for them "
              "(pass --sites with every site, or --region NAME=URL for each)")
        code = code or 2
    return code


def _delete(regions: Regions, name: str) -> None:
    for region in regions.stores:  # every commit record first: never committed everywhere, half gone
        if regions.call(region, ObjectStore.exists, f"{name}/{COMMIT}"):
            regions.call(region, ObjectStore.delete, f"{name}/{COMMIT}")
    for region in regions.stores:
        regions.call(region, ObjectStore.delete_tree, name)


def rm(regions: Regions, args) -> int:
    up = _up(regions, every=True, what="delete from every region")
    if args.all:
        if args.include_uncommitted:
            names = sorted({n for r in up for n in regions.call(r, ObjectStore.list_dirs)
                            if parse_step(n) is not None and regions.call(r, ObjectStore.list_files, n)})
        else:
            names = [name for _, name in _committed(regions, up)]
        for name in names:
            _delete(regions, name)
        print(f"deleted {len(names)} checkpoint folder(s) in {len(up)} region(s): {regions.where()}")
        return 0
    name = checkpoint_name(args.step)
    if not [r for r in up if regions.call(r, ObjectStore.list_files, name)]:
        raise FileNotFoundError(f"no checkpoint of step {args.step} in any region ({regions.where(name)})")
    missing = [r for r in up if not regions.call(r, ObjectStore.exists, f"{name}/{COMMIT}")]
    if missing and not args.include_uncommitted:
        raise FileNotFoundError(
            f"{name} is not committed in region(s) {missing} (half-written, or a save in flight that would then "
            "commit deleted shards): not deleted. Pass --include-uncommitted to delete it when no job writes there.")
    _delete(regions, name)
    print(f"deleted {name} in {len(up)} region(s): {regions.where(name)}")
    return 0
