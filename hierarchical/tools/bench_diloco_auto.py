"""``multidc bench diloco --auto``: ``"auto"`` settings against a grid over the settings they choose among, on the lab
WAN (network namespaces, ``tc tbf`` per direction; loopback when not root, which it says).

The model, data and sites of ``multidc bench diloco`` (``_bench_model``), plain DiLoCo (one fragment, blocking
syncs, ``--compression``). One job per ``--rates`` entry; in it, on the same batches for ``--steps`` inner steps each:
``sites_alone`` (no syncs: the step rate utilization is measured against), one row per ``--grid`` H (``sync_every=H``,
4 MiB chunks, 2 streams), and ``auto`` (``sync_every="auto"`` with ``--target``, ``chunk_mb="auto"``,
``streams="auto"``). Per row: utilization (its step rate over ``sites_alone``'s, after ``--warmup`` steps; auto's
warm-up rounds count), validation loss of the global parameters at the end, WAN bytes. Verdicts per rate
(``_auto_report.verdicts``): auto's utilization >= 95% of the grid's best; auto's loss no worse than the best loss
among the grid rows at least as busy (1% tolerance).

Then the rate change (skipped on loopback): one more job, auto only, at the first rate; right after the first round
end from step ``--change-after`` on, the lab's link is re-shaped to the rate divided by ``--cut`` (``Lab.set_rate``)
while the ranks wait; reported: the round end at which every rank re-planned (target: the first one after the change,
whose sync runs at the new rate). A decision re-plans when the measured rate moves by more than 1.5x
(``REPLAN_FACTOR``), so a cut of 2 re-plans even where the syncs measured the link below its line rate.

Prints a table per rate, writes JSON. Example::

    multidc bench diloco --auto                               # make bench-diloco-auto
    multidc bench diloco --auto --quick --rates 50mbit        # a tiny model, a few rounds: checks the wiring
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading

from multidc.hierarchical.diloco.auto import REPLAN_FACTOR
from multidc.hierarchical.tools.bench_diloco import add_model_arguments, sites_and_rates
from multidc.hierarchical.tools.lab import SITE_IFACE, parse_rate
from multidc.hierarchical.tools.launch import SiteJob

QUICK = {"dim": 32, "layers": 2, "batch": 2, "seq": 16, "steps": 48, "grid": "4,8", "change_after": 16,
         "change_steps": 64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auto", action="store_true", required=True,
                        help="this benchmark ('auto' settings vs a grid); without it: multidc bench diloco's own")
    parser.add_argument("--sites", type=int, default=2, help="number of sites (default 2)")
    parser.add_argument("--ranks-per-site", type=int, default=2, help="ranks in each site (default 2)")
    parser.add_argument("--rates", default="50mbit,200mbit", help="two (or more) per-direction WAN rates "
                        "(default 50mbit,200mbit)")
    parser.add_argument("--grid", default="8,16,32,64,128", help="the grid's H values (default 8,16,32,64,128)")
    parser.add_argument("--steps", type=int, default=384, help="inner steps of every row (default 384)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before every row's timed window (default 2)")
    parser.add_argument("--target", type=float, default=0.95, help="auto's target_utilization (default 0.95)")
    parser.add_argument("--compression", default="int8", help="the syncs' codec, every row (default int8)")
    parser.add_argument("--cut", type=float, default=2.0, help="the rate change divides the first rate by this "
                        "(default 2: halved)")
    parser.add_argument("--change-after", type=int, default=128, help="the rate changes at the first round end "
                        "from this step on (default 128)")
    parser.add_argument("--change-steps", type=int, default=384, help="inner steps of the rate change's job (default "
                        "384: the rounds after the change must end within it)")
    parser.add_argument("--no-change", action="store_true", help="skip the rate change")
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak inner AdamW lr (warm-up, cosine; default 2e-3)")
    parser.add_argument("--own-share", type=float, default=0.8, help="share of a site's sequences from its own "
                        "topics (default 0.8)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few rounds: checks the wiring")
    parser.add_argument("--loopback", action="store_true", help="skip the lab WAN even as root")
    parser.add_argument("--json", default=None, help="results file (default bench-results/diloco-auto-<time>.json)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="give up on a job after this many seconds "
                        "(default 3600)")


def _validate(args) -> tuple[list[str], list[int]]:
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    rates = sites_and_rates(args, "50mbit,200mbit")
    try:
        grid = sorted({int(h) for h in args.grid.split(",") if h.strip()})
    except ValueError:
        raise ValueError(f"--grid {args.grid!r} must be comma-separated integers, e.g. 8,16,32,64.") from None
    if not grid or grid[0] < 1:
        raise ValueError(f"--grid {args.grid!r} needs H values >= 1.")
    if args.steps <= args.warmup or args.warmup < 0:
        raise ValueError(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0).")
    if not args.no_change and args.change_steps <= args.change_after:
        raise ValueError(f"--change-steps {args.change_steps} must exceed --change-after {args.change_after}: the "
                         f"rounds after the rate change must end within the job.")
    if args.cut <= 1:
        raise ValueError(f"--cut {args.cut} must be > 1 (the new rate is the first rate divided by it).")
    from multidc.hierarchical.diloco import DiLoCoConfig  # the settings' own checks, with their messages

    DiLoCoConfig(sync_every="auto", target_utilization=args.target, compression=args.compression)
    return rates, grid


def _plan(args, grid: list[int], *, rows: str = "all") -> dict:
    codec = {"compression": args.compression}
    auto = {"row": "auto", "kind": "diloco", "kind_row": "auto", "wan": {"chunk_mb": "auto", "streams": "auto"},
            "diloco": {"sync_every": "auto", "target_utilization": args.target, **codec}}
    methods = [auto] if rows == "auto" else [
        {"row": "sites_alone", "kind": "site", "kind_row": "alone"},
        *({"row": f"h{h}", "kind": "diloco", "kind_row": "grid", "h": h, "diloco": {"sync_every": h, **codec}}
          for h in grid), auto]
    return {"methods": methods, "seed": 0, "batch": args.batch, "lr": args.lr, "streams": 2, "topics": 8,
            "model": {"vocab": 128, "dim": args.dim, "layers": args.layers, "heads": 4, "seq": args.seq},
            "steps": args.steps, "warmup": args.warmup, "val_sequences": 64, "own_share": args.own_share}


def _job(args, plan: dict, rate: str, tag: str, tmp: str, new_rate: str | None = None) -> tuple[list[dict], bool]:
    """Run the ranks at ``rate``; with ``new_rate``, re-shape the link when the ranks ask (see ``_auto_worker``)."""
    plan["out"] = os.path.join(tmp, f"{tag}.json")
    if new_rate is not None:
        plan["change"] = {"after_step": args.change_after, "steps": args.change_steps,
                          "request": os.path.join(tmp, f"{tag}.request"),
                          "ack": os.path.join(tmp, f"{tag}.ack")}
    job = SiteJob([sys.executable, "-m", "multidc.hierarchical.tools._auto_worker"], sites=args.sites,
                  ranks_per_site=args.ranks_per_site, wan_rate=rate, loopback=args.loopback,
                  env={"OMP_NUM_THREADS": "1"})
    plan["iface"] = None if job.reason else SITE_IFACE
    job.argv.append(json.dumps(plan))
    print(f"[multidc bench diloco --auto] {tag}: {args.sites} sites x {args.ranks_per_site} ranks, "
          f"{f'lab WAN {rate}' if not job.reason else f'loopback ({job.reason}), unshaped'}", flush=True)
    done = threading.Event()
    with job:
        if new_rate is not None:
            threading.Thread(target=_serve_change, args=(job, plan["change"], new_rate, done), daemon=True).start()
        codes = job.wait(args.timeout_s)
        done.set()
    if any(codes):
        raise RuntimeError(f"bench ranks exited with codes {codes} (see their output above); a code of -9 means "
                           f"killed after --timeout-s {args.timeout_s} or after a peer's failure.")
    with open(plan["out"]) as f:
        return json.load(f), not job.reason


def _serve_change(job: SiteJob, change: dict, rate: str, done: threading.Event) -> None:
    """Wait for the ranks' request file, re-shape the lab's link to ``rate``, write the ack file."""
    while not os.path.exists(change["request"]):
        if done.wait(0.05):  # the job ended without asking
            return
    job.lab.set_rate(rate)
    print(f"[multidc bench diloco --auto] the lab's link re-shaped to {rate} after step "
          f"{open(change['request']).read()}", flush=True)
    with open(change["ack"], "w") as f:
        f.write(rate)


def run(args: argparse.Namespace) -> int:
    rates, grid = _validate(args)
    out = args.json or os.path.join("bench-results",
                                    datetime.datetime.now().strftime("diloco-auto-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from multidc.hierarchical.tools import _auto_report as report

    tokens = args.sites * args.ranks_per_site * args.batch * args.seq
    results: dict = {"config": vars(args) | {"rates": rates, "grid": grid}, "rates": {}, "rate_change": None}
    with tempfile.TemporaryDirectory(prefix="multidc-bench-diloco-auto-") as tmp:
        for rate in rates:
            records, shaped = _job(args, _plan(args, grid), rate, f"grid-{rate}", tmp)
            table = report.rows(records, shaped=shaped, tokens_per_step=tokens)
            results["rates"][rate] = {"shaped": shaped, "rows": table, "verdicts": report.verdicts(table)}
        if not args.no_change and results["rates"][rates[0]]["shaped"]:
            new_rate = f"{parse_rate(rates[0]) / args.cut:.0f}bit"
            if args.cut <= REPLAN_FACTOR:
                print(f"[multidc bench diloco --auto] note: --cut {args.cut:g} is within the re-plan threshold (a "
                      f"measured rate more than {REPLAN_FACTOR:g}x away re-plans): whether it re-plans depends on "
                      f"how close to line rate each rate is measured", flush=True)
            records, _ = _job(args, _plan(args, grid, rows="auto"), rates[0], f"change-{rates[0]}", tmp, new_rate)
            results["rate_change"] = report.rate_change(records) | {"from": rates[0], "to": new_rate}
        elif not args.no_change:
            print("[multidc bench diloco --auto] rate change skipped: the link is not shaped (loopback)")
    report.print_tables(results)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(json.dumps({"bench": "diloco-auto", "verdicts": {r: p["verdicts"] for r, p in results["rates"].items()},
                      "rate_change": results["rate_change"]}))
    print(f"[multidc bench diloco --auto] results written to {out}")
    return 0
