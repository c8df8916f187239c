"""The table, targets, bounds and plot of ``bench_checkpoint.py`` (pure: takes rank 0's measurements)."""

from __future__ import annotations

import json
import os
import statistics

from multidc.hierarchical.tools import _figures

TARGETS = {  # name -> (ratio key, comparison, target)
    "multidc save <= 1.10x the raw parallel PUT bound": ("save_over_raw_put", "<=", 1.10),
    "multidc load <= 1.15x the raw parallel GET bound": ("load_over_raw_get", "<=", 1.15),
    "multidc load >= 1.5x faster than Lightning single-file load": ("load_speedup_vs_lightning", ">=", 1.5),
    "peak extra host memory during save <= 1.25x the rank's share": ("save_rss_over_share", "<=", 1.25),
    "peak extra host memory during load <= 1.25x the rank's share": ("load_rss_over_share", "<=", 1.25),
    "async save blocks training <= 10% of the multidc sync save time": (
        "async_blocked_share_of_sync_save", "<=", 0.10),
    "multidc sync save >= 3x faster than Lightning single-file save": ("speedup_vs_lightning_save", ">=", 3.0),
}
_MIB = 1 << 20


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def ratios(rows: dict, memory: dict, share_bytes: float) -> dict:
    """Every figure the targets and bounds are stated in, from the medians."""
    med = {name: row["median"] for name, row in rows.items()}
    return {
        "save_over_raw_put": med["multidc save"] / med["raw parallel PUT (bound)"],
        "load_over_raw_get": med["multidc load"] / med["raw parallel GET (bound)"],
        "load_over_raw_get_and_exchange": med["multidc load"] / _transfers(med),
        "speedup_vs_lightning_save": med["lightning single-file save"] / med["multidc save"],
        "speedup_ceiling_vs_lightning_save": med["lightning single-file save"] / med["raw parallel PUT (bound)"],
        "load_speedup_vs_lightning": med["lightning single-file load"] / med["multidc load"],
        "load_speedup_ceiling_vs_lightning": med["lightning single-file load"] / med["raw parallel GET (bound)"],
        "speedup_vs_dcp_fsspec_save": med["dcp-fsspec save"] / med["multidc save"],
        "speedup_vs_dcp_fsspec_load": med["dcp-fsspec load"] / med["multidc load"],
        "async_blocked_share_of_sync_save": med["multidc async: blocked"] / med["multidc save"],
        "save_rss_over_share": memory["multidc save"]["median"] / share_bytes,
        "load_rss_over_share": memory["multidc load"]["median"] / share_bytes,
    }


def _transfers(med: dict) -> float:
    """Seconds of the transfers a replicated load cannot avoid: GETs of the shares and the exchange, one after the
    other or overlapped, whichever was faster here."""
    return min(med["raw GET, then exchange"], med.get("raw GET, exchange overlapped", float("inf")))


def verdicts(figures: dict) -> dict:
    out = {}
    for name, (key, op, target) in TARGETS.items():
        value = figures[key]
        out[name] = {"value": value, "target": target, "pass": value <= target if op == "<=" else value >= target}
    return out


def report(out: dict, *, ranks: int, repeats: int, part_size_mb: float, concurrency: int,
           min_state_bytes: int) -> dict:
    """Print the table, the figures, PASS/FAIL lines and the bounds; return the JSON record (also printed)."""
    rows = {name: _summary(values) for name, values in out["times"].items()}
    memory = {name: _summary(values) for name, values in out["memory"].items()}
    size_mib = out["state_bytes"] / _MIB
    share = out["state_bytes"] / ranks  # what each rank writes on save and GETs on load
    print(f"\ncheckpoint of {size_mib:.0f} MiB model state, {ranks} ranks (replicas), SeaweedFS S3 on loopback, "
          f"{os.cpu_count()} CPU cores, {repeats} repeats, multidc parts of {part_size_mb:g} MiB x {concurrency} in "
          f"flight per rank; a rank's share = {share / _MIB:.0f} MiB; bounds and multidc measured in turn (each "
          "first in every other repeat), each on a settled server; peak RSS: "
          f"{'sampled every 2 ms' if out.get('rss_sampled') else 'the kernel high-water mark'}")
    print(f"{'method':32s} {'median s':>9s} {'min s':>8s} {'max s':>8s} {'MiB/s':>8s} {'peak extra RSS MiB':>19s}")
    for name, row in rows.items():
        rss = f"{memory[name]['median'] / _MIB:19.0f}" if name in memory else f"{'':19s}"
        print(f"{name:32s} {row['median']:9.2f} {row['min']:8.2f} {row['max']:8.2f} "
              f"{size_mib / row['median']:8.0f} {rss}")
    figures = ratios(rows, memory, share)
    for name, value in figures.items():
        print(f"{name:40s} {value:6.2f}")
    valid = out["state_bytes"] >= min_state_bytes
    checks = verdicts(figures)
    print(f"\ntargets (medians){'' if valid else ' -- SMOKE RUN, state under 200 MB: verdicts do not measure them'}")
    for name, v in checks.items():
        print(f"  {'PASS' if v['pass'] else 'FAIL'}  {name}: {v['value']:.2f} (target {v['target']:g})")
    put, get = rows["raw parallel PUT (bound)"]["median"], rows["raw parallel GET (bound)"]["median"]
    then = rows["raw GET, then exchange"]["median"]
    overlapped = rows.get("raw GET, exchange overlapped", {}).get("median", float("nan"))
    print(f"  bounds: raw parallel PUTs of the same bytes take {put:.2f} s and raw parallel GETs of the saved shard "
          f"objects {get:.2f} s on this server, so no striped save can be more than "
          f"{figures['speedup_ceiling_vs_lightning_save']:.2f}x faster than Lightning's and no striped load more "
          f"than {figures['load_speedup_ceiling_vs_lightning']:.2f}x; multidc's save takes "
          f"{figures['save_over_raw_put']:.2f}x the PUT bound, its load {figures['load_over_raw_get']:.2f}x the GET "
          f"bound.\n  A replicated load must also hand every rank the other ranks' shares: GETting the shares and "
          f"sending each to the other ranks (gloo send/recv, no checkpoint work) takes {then:.2f} s here one after "
          f"the other, {overlapped:.2f} s overlapped (each piece sent as it lands); multidc's load takes "
          f"{figures['load_over_raw_get_and_exchange']:.2f}x the faster of the two.")
    record = {"bench": "checkpoint", "state_mib": size_mib, "share_mib": share / _MIB, "ranks": ranks,
              "repeats": repeats, "part_size_mb": part_size_mb, "concurrency": concurrency,
              "cpu_count": os.cpu_count(), "rows": rows, "peak_extra_rss_bytes": memory, **figures,
              "targets": checks, "valid_size": valid, "pass": all(v["pass"] for v in checks.values())}
    print(json.dumps(record))
    return record


def plot(record: dict, path: str) -> None:
    """Save and load seconds per method (median, min-max whiskers), the raw PUT / GET bounds as lines."""
    plt = _figures.pyplot()
    rows = record["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    sides = ((axes[0], "save", ["raw parallel PUT (bound)"]),
             (axes[1], "load", [b for b in ("raw parallel GET (bound)", "raw GET, then exchange",
                                            "raw GET, exchange overlapped") if b in rows]))
    for ax, kind, bounds in sides:
        names = [n for n in rows if n.endswith(kind) or (kind == "save" and n.startswith("multidc async"))]
        medians = [rows[n]["median"] for n in names]
        errors = [[rows[n]["median"] - rows[n]["min"] for n in names],
                  [rows[n]["max"] - rows[n]["median"] for n in names]]
        colors = ["tab:blue" if n.startswith("multidc") else "tab:gray" for n in names]
        ax.barh(names, medians, xerr=errors, color=colors)
        for bound, style in zip(bounds, ("--", ":", "-.")):
            ax.axvline(rows[bound]["median"], color="tab:red", linestyle=style,
                       label=f"{bound}: {rows[bound]['median']:.2f} s")
        ax.set_title(f"{kind}: {record['state_mib']:.0f} MiB, {record['ranks']} ranks, SeaweedFS")
        ax.set_xlabel("seconds (median, min-max)")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    _figures.save(fig, path, dpi=110)
