"""``multidc bench allreduce``: flat ``torch.distributed.all_reduce`` vs the hierarchical one, side by side.

As root on Linux the ranks run inside a lab WAN (``lab.Lab``: one network namespace per site, links shaped
with ``tc tbf`` in both directions); otherwise on loopback without shaping, which it says. Every mode runs in
the same processes in the same run, ``--warmup`` untimed and ``--repeats`` timed repetitions each; a
repetition's time is the slowest rank's. Prints a table and writes the raw records plus the summary as JSON, and
with ``--plot`` a PNG of the times next to their bound (the WAN bytes at line rate).

Example::

    multidc bench allreduce --sites 2 --ranks-per-site 2 --size-mb 64 --wan-rate 400mbit \\
        --compression none,bf16,int8 --plot docs/bench_allreduce.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

from multidc.hierarchical.config import COMPRESSIONS
from multidc.hierarchical.tools import _figures
from multidc.hierarchical.tools.lab import SITE_IFACE, parse_rate
from multidc.hierarchical.tools.launch import SiteJob


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", type=int, default=2, help="number of sites (default 2)")
    parser.add_argument("--ranks-per-site", type=int, default=2, help="ranks in each site (default 2)")
    parser.add_argument("--size-mb", type=float, default=64.0, help="fp32 tensor size in MiB (default 64)")
    parser.add_argument("--wan-rate", default="400mbit", help="per-direction WAN rate, e.g. 400mbit, 1gbit")
    parser.add_argument("--compression", default="none,bf16,int8",
                        help=f"comma-separated hierarchical modes from {COMPRESSIONS} (default none,bf16,int8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per mode (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions per mode (default 1)")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="WanConfig.chunk_mb (default 4)")
    parser.add_argument("--streams", type=int, default=2, help="WanConfig.streams (default 2)")
    parser.add_argument("--loopback", action="store_true", help="skip the lab WAN even as root")
    parser.add_argument("--json", default=None, help="results file (default bench-results/allreduce-<time>.json)")
    parser.add_argument("--plot", default=None, help="also draw the times and their bounds to this PNG (matplotlib)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up after this many seconds")


def _validate(args: argparse.Namespace) -> list[str]:
    if args.sites < 1 or args.ranks_per_site < 1 or args.sites * args.ranks_per_site < 2:
        raise ValueError(f"--sites {args.sites} x --ranks-per-site {args.ranks_per_site} needs at least 2 ranks "
                         f"and at least 1 of each.")
    if args.size_mb <= 0 or args.repeats < 1 or args.warmup < 0:
        raise ValueError("--size-mb must be > 0, --repeats >= 1 and --warmup >= 0.")
    parse_rate(args.wan_rate)
    if args.plot:
        try:
            _figures.pyplot()
        except ImportError as exc:
            raise ValueError(f"--plot {args.plot}: {exc}.") from exc
    modes = [m.strip().lower() for m in args.compression.split(",") if m.strip()]
    bad = [m for m in modes if m not in COMPRESSIONS]
    if bad or not modes:
        raise ValueError(f"--compression {args.compression!r}: unknown {bad}; choose from {COMPRESSIONS}.")
    return ["flat", *dict.fromkeys(modes)]


def run(args: argparse.Namespace) -> int:
    modes = _validate(args)
    out = args.json or os.path.join("bench-results", datetime.datetime.now().strftime("allreduce-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multidc-bench-") as tmp:
        plan = {"modes": modes, "size_mb": args.size_mb, "repeats": args.repeats, "warmup": args.warmup,
                "chunk_mb": args.chunk_mb, "streams": args.streams, "out": os.path.join(tmp, "records.json")}
        argv = [sys.executable, "-m", "multidc.hierarchical.tools._bench_worker"]
        job = SiteJob(argv, sites=args.sites, ranks_per_site=args.ranks_per_site, wan_rate=args.wan_rate,
                      loopback=args.loopback, env={"OMP_NUM_THREADS": "1"})
        if job.reason:
            print(f"[multidc bench] {job.reason}: running on loopback WITHOUT bandwidth shaping; the figures show "
                  f"the algorithms' CPU cost, not a WAN. Run as root on Linux for the lab WAN.", flush=True)
        plan["iface"] = None if job.reason else SITE_IFACE
        job.argv.append(json.dumps(plan))
        with job:
            codes = job.wait(args.timeout_s)
        if any(codes):
            raise RuntimeError(f"bench ranks exited with codes {codes} (see their output above); "
                               f"a code of -9 means killed after --timeout-s {args.timeout_s} or a peer's failure.")
        with open(plan["out"]) as f:
            records = json.load(f)
    shaped = not job.reason
    summary = summarize(records, modes, args, shaped=shaped)
    print_table(summary, args, shaped=shaped)
    config = vars(args) | {"modes": modes, "shaped": shaped}
    with open(out, "w") as f:
        json.dump({"config": config, "summary": summary, "records": records}, f, indent=1, default=str)
    if args.plot:
        plot(summary, config, args.plot)
        print(f"[multidc bench] plot written to {args.plot}")
    print(json.dumps({"bench": "allreduce", "summary": summary}))
    print(f"[multidc bench] results written to {out}")
    return 0


def summarize(records: list[dict], modes: list[str], args, shaped: bool) -> list[dict]:
    """Per mode: median/min/max seconds, WAN bytes per site (busiest), throughput and share of line rate."""
    rate_bytes = parse_rate(args.wan_rate) / 8
    rows = []
    for mode in modes:
        timed = [r for r in records if r["mode"] == mode and "seconds" in r]
        reps = sorted({r["rep"] for r in timed})
        per_rep = [max(r["seconds"] for r in timed if r["rep"] == rep) for rep in reps]
        wan = [max(_site_sum(timed, rep, "iface_tx_bytes" if shaped else "payload_bytes").values()) for rep in reps]
        errors = [r["max_rel_error_vs_flat"] for r in records if r["mode"] == mode and "max_rel_error_vs_flat" in r]
        median, wan_bytes = statistics.median(per_rep), statistics.median(wan)
        rows.append({
            "mode": "flat" if mode == "flat" else f"hier+{mode}" if mode != "none" else "hier",
            "median_s": median, "min_s": min(per_rep), "max_s": max(per_rep),
            "wan_bytes_per_site": wan_bytes if (shaped or mode != "flat") else None,
            "wan_MBps": wan_bytes / median / 1e6 if (shaped or mode != "flat") else None,
            "bound_s": wan_bytes / rate_bytes if shaped else None,
            "line_rate_share": wan_bytes / rate_bytes / median if shaped else None,
            "max_rel_error_vs_flat": max(errors) if errors else 0.0,
        })
    flat = rows[0]["median_s"]
    for row in rows:
        row["speedup_vs_flat"] = flat / row["median_s"]
    return rows


def _site_sum(records: list[dict], rep: int, key: str) -> dict[int, int]:
    sums: dict[int, int] = {}
    for r in records:
        if r["rep"] == rep:
            sums[r["site"]] = sums.get(r["site"], 0) + r[key]
    return sums


def print_table(rows: list[dict], args, shaped: bool) -> None:
    where = f"lab WAN {args.wan_rate} per direction (tc tbf)" if shaped else "loopback, unshaped"
    print(f"\nall-reduce of {args.size_mb:g} MiB fp32, {args.sites} sites x {args.ranks_per_site} ranks, {where}, "
          f"{args.repeats} repeats (+{args.warmup} warmup), chunk {args.chunk_mb:g} MiB, {args.streams} streams")
    source = "interface tx" if shaped else "payload counted"
    header = (f"{'mode':<11}{'median s':>9}{'min s':>8}{'max s':>8}{'x flat':>8}  {'WAN MB/site':>12}"
              f"{'WAN MB/s':>9}{'S/B s':>7}{'of line':>8}{'rel err':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        mb = r["wan_bytes_per_site"] / 1e6 if r["wan_bytes_per_site"] is not None else None
        share = 100 * r["line_rate_share"] if r["line_rate_share"] is not None else None
        print(f"{r['mode']:<11}{r['median_s']:>9.3f}{r['min_s']:>8.3f}{r['max_s']:>8.3f}{r['speedup_vs_flat']:>7.2f}x"
              f"  {_cell(mb, 12, 1)}{_cell(r['wan_MBps'], 9, 1)}{_cell(r['bound_s'], 7, 2)}{_cell(share, 7, 0)}%"
              f"{r['max_rel_error_vs_flat']:>9.1e}")
    print(f"WAN MB/site: bytes the busiest site sent to other sites ({source}); S/B: those bytes at line rate; "
          f"of line: S/B over the median time.")


def _cell(value: float | None, width: int, decimals: int) -> str:
    return f"{value:>{width}.{decimals}f}" if value is not None else f"{'n/a':>{width}}"


def plot(rows: list[dict], config: dict, path: str) -> None:
    """Draw ``summarize``'s rows to a PNG at ``path``: per mode the median seconds (min-max whiskers) beside the
    bound (the WAN bytes at line rate, lab runs only), and the WAN bytes per site beside the fewest any all-reduce
    can send, ``2(k-1)/k * S`` (uncompressed). ``config``: the JSON's ``config`` (sizes, rate, ``shaped``)."""
    plt = _figures.pyplot()
    fig, (times, wire) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = range(len(rows))
    names = [r["mode"] for r in rows]
    medians = [r["median_s"] for r in rows]
    whiskers = [[r["median_s"] - r["min_s"] for r in rows], [r["max_s"] - r["median_s"] for r in rows]]
    bounded = [(i, r["bound_s"]) for i, r in zip(x, rows) if r["bound_s"] is not None]
    times.bar([i - 0.2 for i in x], medians, 0.4, yerr=whiskers, capsize=3, color="tab:blue",
              label="measured (median, min-max)")
    if bounded:
        times.bar([i + 0.2 for i, _ in bounded], [b for _, b in bounded], 0.4, color="tab:gray",
                  label="bound: WAN bytes / line rate")
    for i, r in zip(x, rows):
        times.annotate(f"{r['speedup_vs_flat']:.2f}x", (i - 0.2, r["max_s"]), ha="center", va="bottom", fontsize=8)
    where = f"{config['wan_rate']} per direction" if config["shaped"] else "loopback, unshaped"
    times.set(xticks=list(x), xticklabels=names, ylabel="seconds per all-reduce",
              title=f"{config['size_mb']:g} MiB fp32, {config['sites']} sites x {config['ranks_per_site']} ranks, "
                    f"{where}")
    times.title.set_fontsize(9)
    times.legend(fontsize=8)
    sent = [(i, r["wan_bytes_per_site"] / 1e6) for i, r in zip(x, rows) if r["wan_bytes_per_site"] is not None]
    wire.bar([i for i, _ in sent], [mb for _, mb in sent], 0.5, color="tab:blue")
    k = config["sites"]
    least = 2 * (k - 1) / k * config["size_mb"] * (1 << 20) / 1e6
    wire.axhline(least, color="tab:red", linestyle="--", label=f"2(k-1)/k * S = {least:.1f} MB (uncompressed)")
    source = "interface tx" if config["shaped"] else "payload"
    wire.set(xticks=list(x), xticklabels=names, ylabel="MB", title=f"WAN bytes the busiest site sent ({source})")
    wire.title.set_fontsize(9)
    wire.legend(fontsize=8)
    fig.tight_layout()
    _figures.save(fig, path)
