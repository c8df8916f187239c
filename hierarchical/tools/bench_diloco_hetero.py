"""``multidc bench diloco --heterogeneous``: DiLoCo across unequal sites, on the lab WAN.

Two jobs, each in the lab (network namespaces, ``tc tbf`` per direction at ``--wan-rate``; loopback when not root,
which it says), the model and non-IID data of ``multidc bench diloco`` (``_bench_model``: site ``s`` draws
``--own-share`` of its sequences from its own topics), plain DiLoCo (one fragment, blocking syncs):

* **slow**: 2 sites x 1 rank, site ``--slow-site`` slowed ``--slowdown`` times (it sleeps after each step
  ``slowdown - 1`` times that step's work). *fixed*: both sites sync every ``--sync-every`` steps for ``--steps``
  steps. *time*: rounds by time (``DiLoCoConfig(sync_every_s=...)``, ``weighting="samples"``) with the fixed run's
  measured round length (``--round-s`` to set it), a first round of ``--first-round`` steps; the slow site ends
  after ``--steps`` steps, so both runs take about the same wall time; the fast site runs what fits.
* **sizes**: 2 sites of ``--big-site-ranks`` + 1 ranks, both syncing every ``--sync-every`` steps for ``--steps``
  steps: equal weights vs token weights (``weighting="samples"``, the tokens reported with ``DiLoCo.count``).

Reported per run and site: idle share of wall time at syncs (``DiLoCo.step`` holding the loop), steps per round,
tokens; validation loss of the global parameters at equal wall time and at equal tokens (linear interpolation
between merged syncs), on every topic alike ("uniform") and on the job's pooled training mix ("pooled": the sites'
data weighted by their ranks). Checks the issue's targets, prints a table, writes JSON and a PNG (per-site
timelines: compute vs idle; losses). Example::

    multidc bench diloco --heterogeneous                 # make bench-diloco-hetero
    multidc bench diloco --heterogeneous --quick         # a tiny model, a few rounds: checks the wiring
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import tempfile

from multidc.hierarchical.tools.bench_diloco import add_model_arguments, run_job
from multidc.hierarchical.tools.lab import parse_rate

PARTS = ("slow", "sizes")
QUICK = {"dim": 32, "layers": 2, "batch": 2, "seq": 16, "steps": 24, "sync_every": 4, "first_round": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heterogeneous", action="store_true", required=True,
                        help="this benchmark (unequal sites); without it: multidc bench diloco's own")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--wan-rate", default="1gbit", help="per-direction WAN rate (default 1gbit)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="how many times slower the slow site runs "
                        "(default 2)")
    parser.add_argument("--slow-site", type=int, default=1, choices=(0, 1), help="the slowed site (default 1)")
    parser.add_argument("--big-site-ranks", type=int, default=3, help="ranks of site 0 in 'sizes' (default 3; "
                        "site 1 has 1)")
    parser.add_argument("--steps", type=int, default=256, help="inner steps: of both sites in 'fixed' and "
                           "'sizes', of the slow site in 'time' (default 256)")
    parser.add_argument("--sync-every", type=int, default=32, help="H of the fixed rounds (default 32)")
    parser.add_argument("--first-round", type=int, default=4, help="steps of the first time round, before any "
                        "step is measured (default 4)")
    parser.add_argument("--round-s", type=float, default=None, help="sync_every_s of the time run (default: the "
                        "fixed run's measured round length)")
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=2e-3, help="inner AdamW lr after a warm-up (default 2e-3)")
    parser.add_argument("--own-share", type=float, default=0.8,
                        help="share of a site's sequences from its own topics (default 0.8: non-IID)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and a few rounds (tests, wiring); overrides the size and step flags")
    parser.add_argument("--loopback", action="store_true", help="skip the lab WAN even as root")
    parser.add_argument("--json", default=None, help="results file (default bench-results/diloco-hetero-<time>.json)")
    parser.add_argument("--plot", default=None, help="plot file (default: the JSON path with .png)")
    parser.add_argument("--rejudge", default=None, metavar="JSON",
                        help="train nothing: recompute the targets, table and plot of a results file of this "
                             "benchmark (rewritten in place; the plot beside it unless --plot)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a job after this many seconds "
                        "(default 1800)")


def validate(args: argparse.Namespace) -> list[str]:
    """The parts to run; ValueError naming the flag and the fix for a bad argument."""
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"--parts {args.parts!r}: choose from {','.join(PARTS)} (comma-separated).")
    parse_rate(args.wan_rate)
    if not (math.isfinite(args.slowdown) and args.slowdown >= 1):
        raise ValueError(f"--slowdown {args.slowdown}: must be a number >= 1 (2: the slow site runs at half speed).")
    if args.big_site_ranks < 1:
        raise ValueError(f"--big-site-ranks {args.big_site_ranks}: site 0 needs at least 1 rank (3: sites 3+1).")
    if min(args.steps, args.sync_every, args.first_round, args.dim, args.layers, args.batch, args.seq) < 1:
        raise ValueError("--steps, --sync-every, --first-round, --dim, --layers, --batch and --seq must be >= 1.")
    if args.steps < 2 * args.sync_every or args.steps % args.sync_every:
        raise ValueError(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}, at least two "
                         f"rounds (the fixed runs end at a sync).")
    if args.round_s is not None and not (math.isfinite(args.round_s) and args.round_s > 0):
        raise ValueError(f"--round-s {args.round_s}: a positive number of seconds, or leave it out (measured).")
    if not 0 <= args.own_share <= 1:
        raise ValueError(f"--own-share {args.own_share} must be a fraction between 0 and 1.")
    return [p for p in PARTS if p in parts]


def _quick(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | QUICK)) if args.quick else args


def runs(args: argparse.Namespace, part: str) -> list[dict]:
    """The runs of one part, in order (the time run takes the fixed run's measured round length)."""
    h, n = args.sync_every, args.steps
    if part == "sizes":
        return [{"name": f"sizes_{w}", "diloco": {"sync_every": h, "weighting": w}, "finish": [n, n],
                 "slowdown": [1.0, 1.0]} for w in ("equal", "samples")]
    slowdown = [args.slowdown if s == args.slow_site else 1.0 for s in (0, 1)]
    ends = [n if s == args.slow_site else None for s in (0, 1)]
    timed = {"sync_every": args.first_round, "sync_every_s": args.round_s or "measured", "weighting": "samples"}
    return [{"name": "fixed", "diloco": {"sync_every": h, "weighting": "samples"}, "finish": [n, n],
             "slowdown": slowdown},
            {"name": "time", "diloco": timed, "finish": ends, "slowdown": slowdown}]


def plan(args: argparse.Namespace, part: str) -> dict:
    ranks = [args.big_site_ranks, 1] if part == "sizes" else [1, 1]
    return {"runs": runs(args, part), "ranks": ranks, "seed": 0, "batch": args.batch, "lr": args.lr, "streams": 2,
            "topics": 8, "warmup": max(1, args.steps // 20), "val_sequences": 64, "own_share": args.own_share,
            "model": {"vocab": 128, "dim": args.dim, "layers": args.layers, "heads": 4, "seq": args.seq},
            "pool_steps": math.ceil((args.slowdown + 1) * args.steps)}


def _job(args, part: str, tmp: str) -> tuple[dict, list[dict], bool]:
    """Run one part's job; (plan, records, shaped)."""
    job_plan = {**plan(args, part), "out": os.path.join(tmp, f"{part}.json")}
    label = f"[multidc bench diloco --heterogeneous] {part}: sites of {job_plan['ranks']} ranks"
    records, shaped = run_job("multidc.hierarchical.tools._hetero_worker", job_plan, sites=2,
                              ranks_per_site=job_plan["ranks"], rate=args.wan_rate, loopback=args.loopback,
                              timeout_s=args.timeout_s, label=label)
    return job_plan, records, shaped


def rejudge(args: argparse.Namespace) -> int:
    """``--rejudge``: the targets, table and plot of an earlier run, from its results file."""
    from multidc.hierarchical.tools import _hetero_report as report

    results = report.load(args.rejudge)
    saved = argparse.Namespace(**results["config"])
    results["targets"] = report.targets(results["runs"], saved.slow_site)
    report.print_tables(results, saved)
    with open(args.rejudge, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(report.plot(results, args.plot or os.path.splitext(args.rejudge)[0] + ".png"))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.rejudge:
        return rejudge(args)
    args = _quick(args)  # --quick sets the sizes first, so what runs is what was validated
    parts = validate(args)
    out = args.json or os.path.join("bench-results",
                                    datetime.datetime.now().strftime("diloco-hetero-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from multidc.hierarchical.tools import _hetero_report as report

    results: dict = {"config": vars(args), "load_before": os.getloadavg(), "runs": {}, "shaped": True}
    with tempfile.TemporaryDirectory(prefix="multidc-bench-hetero-") as tmp:
        for part in parts:
            job_plan, records, shaped = _job(args, part, tmp)
            results["runs"].update(report.summarize(records, job_plan))
            results["shaped"] &= shaped
    results["load_after"] = os.getloadavg()
    results["targets"] = report.targets(results["runs"], args.slow_site)
    report.print_tables(results, args)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(report.plot(results, args.plot or os.path.splitext(out)[0] + ".png"))
    print(json.dumps({"bench": "diloco_hetero", "targets": results["targets"]}))
    print(f"[multidc bench diloco --heterogeneous] results written to {out}")
    return 0
