"""The table, targets and plot of ``bench_checkpoint_regions.py`` (pure: takes rank 0's gathered records).

A record is one rank's run of one operation in one measured repeat: ``{"name", "rep", "site", "rank", "seconds",
"wan_tx", "wan_rx", "tcp_retrans", "http_retries", "remote_read"}``; ``wan_*`` (bytes of the site's WAN interface
over the operation) and ``tcp_retrans`` (TCP segments the site retransmitted) are set on one rank per site,
``http_retries`` (botocore's own retries of S3 requests) on every rank, ``remote_read`` (the bytes the library
says the site's load read from other regions) on the site's lowest rank after a region-local load, else ``None``.
"""

from __future__ import annotations

import json
import os
import statistics

from multidc.hierarchical.tools import _figures
from multidc.hierarchical.tools.lab import parse_rate

_MIB = 1 << 20
SAVE, LOAD = "region-local save", "region-local load"
SINGLE_SAVE, SINGLE_LOAD = "single URL save", "single URL load"
PUT = "raw PUT (bound)"
FLOORS = ("raw GET, then exchange", "raw GET, exchange overlapped")
CONTROL_MIB = 1.0  # WAN bytes a region-local save or load may take: barriers, planning, heartbeats, commit records


def targets(num_sites: int) -> dict:
    """name -> (figure key, comparison, target); the per-region ratios one per site."""
    out = {
        "region-local load reads 0 checkpoint bytes from other regions (library count, every site and repeat)": (
            "load_remote_read_bytes", "<=", 0),
        f"region-local load: WAN bytes <= {CONTROL_MIB:g} MiB, no checkpoint data (worst repeat)": (
            "load_wan_mib", "<=", CONTROL_MIB),
        f"region-local save: WAN bytes <= {CONTROL_MIB:g} MiB, the commit round only (worst repeat)": (
            "save_wan_mib", "<=", CONTROL_MIB),
        f"site {num_sites - 1}'s load >= 5x faster than with the single URL": ("remote_load_speedup", ">=", 5.0),
    }
    for site in range(num_sites):
        out[f"region {site}: save <= 1.15x its raw PUT bound"] = (f"save_over_put_{site}", "<=", 1.15)
        out[f"region {site}: load <= 1.25x its GET + exchange floor"] = (f"load_over_floor_{site}", "<=", 1.25)
    return out


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def per_site(records: list[dict]) -> dict:
    """name -> site -> {"seconds": [...], "wan_tx": [...], ...}, one value per repeat: the slowest of the site's
    ranks, the site's counters, its ranks' HTTP retries summed, the library's count (where reported)."""
    runs: dict = {}
    for r in records:
        run = runs.setdefault(r["name"], {}).setdefault(r["site"], {}).setdefault(r["rep"], {
            "seconds": 0.0, "wan_tx": None, "wan_rx": None, "tcp_retrans": None, "http_retries": 0,
            "remote_read": None})
        run["seconds"] = max(run["seconds"], r["seconds"])
        run["http_retries"] += r.get("http_retries") or 0
        for key in ("wan_tx", "wan_rx", "tcp_retrans", "remote_read"):
            if r.get(key) is not None:
                run[key] = r[key]
    out: dict = {}
    for name, sites in runs.items():
        for site, reps in sorted(sites.items()):
            ordered = [reps[rep] for rep in sorted(reps)]
            out.setdefault(name, {})[site] = {key: [run[key] for run in ordered if run[key] is not None]
                                              for key in _KEYS}
    return out


_KEYS = ("seconds", "wan_tx", "wan_rx", "tcp_retrans", "http_retries", "remote_read")


def _wan_sent(sites: dict) -> list[int]:
    """Per repeat, the bytes every site together sent onto the WAN (each crosses it once)."""
    return [sum(values) for values in zip(*(s["wan_tx"] for s in sites.values()))]


def figures(table: dict) -> dict:
    """Every figure the targets are stated in, from the medians (WAN bytes: the worst repeat)."""
    med = {name: {site: statistics.median(v["seconds"]) for site, v in sites.items()} for name, sites in table.items()}
    sites = sorted(med[SAVE])
    remote = sites[-1]
    out = {"load_remote_read_bytes": max(b for s in table[LOAD].values() for b in s["remote_read"] or [0]),
           "load_wan_mib": max(_wan_sent(table[LOAD])) / _MIB, "save_wan_mib": max(_wan_sent(table[SAVE])) / _MIB,
           "single_save_wan_mib": statistics.median(_wan_sent(table[SINGLE_SAVE])) / _MIB,
           "single_load_wan_mib": statistics.median(_wan_sent(table[SINGLE_LOAD])) / _MIB,
           "remote_load_speedup": med[SINGLE_LOAD][remote] / med[LOAD][remote],
           "save_speedup": max(med[SINGLE_SAVE].values()) / max(med[SAVE].values())}
    if any(not table[LOAD][s]["remote_read"] for s in sites):
        out["load_remote_read_bytes"] = float("inf")  # a site's load never reported its count: cannot pass
    for site in sites:
        out[f"save_over_put_{site}"] = med[SAVE][site] / med[PUT][site]
        out[f"load_over_floor_{site}"] = med[LOAD][site] / min(med[f][site] for f in FLOORS)
    return out


def verdicts(values: dict, num_sites: int) -> dict:
    out = {}
    for name, (key, op, target) in targets(num_sites).items():
        value = values[key]
        out[name] = {"value": value, "target": target, "pass": value <= target if op == "<=" else value >= target}
    return out


def report(out: dict, *, wan_rate: str, ranks_per_site: int, repeats: int, min_state_bytes: int) -> dict:
    """Print the table, the WAN bound, PASS/FAIL lines; return the JSON record (also printed)."""
    table = per_site(out["records"])
    size_mib = out["state_bytes"] / _MIB
    rate_bps = parse_rate(wan_rate)
    num_sites = len(out["sites"])
    print(f"\nregion-local vs single-URL checkpoints: {size_mib:.0f} MiB model state, {num_sites} sites x "
          f"{ranks_per_site} ranks (replicas), lab WAN {wan_rate} per direction, one SeaweedFS S3 per site in its "
          f"namespace (single URL: site 0's), {os.cpu_count()} CPU cores, {repeats} repeats; seconds: the slowest "
          f"rank of the site; WAN MiB: the site's wan0 counters, sent (median, max) / received (median); retries: "
          f"botocore's resent S3 requests and the site's TCP retransmitted segments, over all repeats")
    print(f"{'operation':28s} {'site':>4s} {'median s':>8s} {'min s':>6s} {'max s':>6s} {'MiB out':>8s} {'max':>7s} "
          f"{'MiB in':>7s} {'other regions MiB':>17s} {'HTTP retries':>12s} {'TCP retrans':>11s}")
    rows = {}
    for name, sites in table.items():
        for site, v in sites.items():
            row = rows.setdefault(name, {})[str(site)] = {
                **_summary(v["seconds"]), "wan_tx_bytes": _summary(v["wan_tx"]), "wan_rx_bytes": _summary(v["wan_rx"]),
                "remote_read_bytes": max(v["remote_read"]) if v["remote_read"] else None,
                "http_retries": sum(v["http_retries"]), "tcp_retrans": sum(v["tcp_retrans"])}
            remote = "" if row["remote_read_bytes"] is None else f"{row['remote_read_bytes'] / _MIB:.1f}"
            print(f"{name:28s} {site:>4} {row['median']:8.2f} {row['min']:6.2f} {row['max']:6.2f} "
                  f"{row['wan_tx_bytes']['median'] / _MIB:8.2f} {row['wan_tx_bytes']['max'] / _MIB:7.2f} "
                  f"{row['wan_rx_bytes']['median'] / _MIB:7.2f} {remote:>17s} {row['http_retries']:12d} "
                  f"{row['tcp_retrans']:11d}")
    values = figures(table)
    link_s = {n: values[f"{n}_wan_mib"] * _MIB * 8 / rate_bps for n in ("single_save", "single_load")}
    print(f"  bound: the single URL's save sends {values['single_save_wan_mib']:.0f} MiB over the WAN "
          f"({link_s['single_save']:.1f} s at {wan_rate}), its load {values['single_load_wan_mib']:.0f} MiB "
          f"({link_s['single_load']:.1f} s); region-local: at most {values['save_wan_mib']:.3f} MiB (save) and "
          f"{values['load_wan_mib']:.3f} MiB (load); save {values['save_speedup']:.1f}x faster than the single URL's")
    valid = out["state_bytes"] >= min_state_bytes
    checks = verdicts(values, num_sites)
    print(f"\ntargets (medians){'' if valid else ' -- SMOKE RUN, state under 200 MB: verdicts do not measure them'}")
    for name, v in checks.items():
        print(f"  {'PASS' if v['pass'] else 'FAIL'}  {name}: {v['value']:.3f} (target {v['target']:g})")
    record = {"bench": "checkpoint_regions", "state_mib": size_mib, "sites": num_sites,
              "ranks_per_site": ranks_per_site, "wan_rate": wan_rate, "repeats": repeats,
              "cpu_count": os.cpu_count(), "rows": rows, **values, "targets": checks, "valid_size": valid,
              "pass": all(v["pass"] for v in checks.values())}
    print(json.dumps(record))
    return record


def plot(record: dict, path: str) -> None:
    """Seconds per operation and site (median, min-max whiskers) beside the MiB each site sent over the WAN."""
    plt = _figures.pyplot()
    rows = record["rows"]
    labels, medians, low, high, wan = [], [], [], [], []
    for name, sites in rows.items():
        for site, row in sites.items():
            labels.append(f"{name}, site {site}")
            medians.append(row["median"])
            low.append(row["median"] - row["min"])
            high.append(row["max"] - row["median"])
            wan.append(row["wan_tx_bytes"]["median"] / _MIB)
    colors = ["tab:blue" if n.startswith("region-local") else "tab:orange" if n.startswith("single") else "tab:gray"
              for n in labels]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.32 * len(labels) + 1.6), sharey=True)
    axes[0].barh(labels, medians, xerr=[low, high], color=colors)
    axes[0].set_xlabel("seconds (median, min-max; the site's slowest rank)")
    axes[0].invert_yaxis()
    axes[1].barh(labels, wan, color=colors)
    for y, mib in enumerate(wan):
        axes[1].annotate(f"{mib:.2f}", (mib, y), xytext=(3, -3), textcoords="offset points", fontsize=7)
    axes[1].set_xlabel("MiB the site sent over the WAN (median)")
    fig.suptitle(f"{record['state_mib']:.0f} MiB model, {record['sites']} sites x {record['ranks_per_site']} ranks, "
                 f"{record['wan_rate']} WAN: region-local (blue) vs one URL in site 0 (orange), bounds (gray)")
    fig.tight_layout()
    _figures.save(fig, path, dpi=110)
