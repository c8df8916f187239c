"""``multidc bench allreduce``: flat ``torch.distributed.all_reduce`` vs the hierarchical one, side by side.

As root on Linux the ranks run inside a lab WAN (``lab.Lab``: one network namespace per site, links shaped
with ``tc tbf`` in both directions); otherwise on loopback without shaping, which it says. Every mode runs in
the same processes in the same run, ``--warmup`` untimed and ``--repeats`` timed repetitions each; a
repetition's time is the slowest rank's. Prints a table and writes the raw records plus the summary as JSON.

Example::

    multidc bench allreduce --sites 2 --ranks-per-site 2 --size-mb 64 --wan-rate 400mbit \\
        --compression none,bf16,int8
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
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up after this many seconds")


def _validate(args: argparse.Namespace) -> list[str]:
    if args.sites < 1 or args.ranks_per_site < 1 or args.sites * args.ranks_per_site < 2:
        raise ValueError(f"--sites {args.sites} x --ranks-per-site {args.ranks_per_site} needs at least 2 ranks "
                         f"and at least 1 of each.")
    if args.size_mb <= 0 or args.repeats < 1 or args.warmup < 0:
        raise ValueError("--size-mb must be > 0, --repeats >= 1 and --warmup >= 0.")
    parse_rate(args.wan_rate)
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
    with open(out, "w") as f:
        json.dump({"config": vars(args) | {"modes": modes, "shaped": shaped}, "summary": summary,
                   "records": records}, f, indent=1, default=str)
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
