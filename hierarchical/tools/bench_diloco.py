"""``multidc bench diloco``: hierarchical DDP vs DiLoCo vs streaming DiLoCo (int8, sparse top-k) vs sites alone.

2 sites x 2 ranks (default) train a small GPT (``_bench_model.TinyGPT``, about 3M parameters) on generated
token sequences; each site holds different topics (see ``_bench_model.TopicData``). The sparse row is streaming
DiLoCo with a top-k codec (``--sparse-*``: by default 1/16 of each chunk at 2 bits, outer SGD lr 1 without
momentum, alpha 0). Two phases, every method in the same processes of each phase:

* **quality** (skipped with ``--quick``): every method trains ``--steps`` inner steps on the same batches over an
  unshaped link; validation loss every ``--eval-every`` steps. The numbers of the algorithms do not depend on the
  link rate, so loss at equal tokens is measured once.
* **speed**, one job per ``--rates`` entry (the lab WAN: network namespaces, ``tc tbf`` per direction; loopback
  when not root, which it says): a timed window per method after a warm-up. Throughput, **compute utilization**
  (the method's step rate over the step rate of the sites training alone, in the same job), and WAN bytes per
  inner step (interface counters under the lab, payload counters on loopback). DiLoCo's window spans exactly
  ``sync_every`` steps starting when no sync is in flight, so it holds one sync of every fragment. Below
  10 mbit hierarchical DDP times a single step without a warm-up (it sends ~13 MB per step: ~100 s at 1 mbit).

Prints a table, checks the issue's targets, writes JSON and (with matplotlib) a PNG. Example::

    multidc bench diloco --rates 1mbit,10mbit,50mbit,200mbit
    multidc bench diloco --quick --rates 10mbit        # speed only, one rate: make demo
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

from multidc.hierarchical.tools.lab import SITE_IFACE, parse_rate
from multidc.hierarchical.tools.launch import SiteJob

METHODS = ("hierarchical_ddp", "diloco", "streaming_diloco", "sparse_streaming_diloco", "sites_alone")
QUICK_METHODS = ("hierarchical_ddp", "streaming_diloco", "sites_alone")  # make demo: short, shows what it prints
SLOW_RATE = 10e6  # bit/s: below it hierarchical DDP times one step, without a warm-up


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", type=int, default=2, help="number of sites (default 2)")
    parser.add_argument("--ranks-per-site", type=int, default=2, help="ranks in each site (default 2)")
    parser.add_argument("--rates", default="1mbit,10mbit,50mbit,200mbit",
                        help="comma-separated per-direction WAN rates (default 1mbit,10mbit,50mbit,200mbit)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all; --quick: "
                             f"{','.join(QUICK_METHODS)}); the speed phase needs sites_alone")
    parser.add_argument("--sync-every", type=int, default=32, help="DiLoCo H, both DiLoCo methods (default 32)")
    parser.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo P (default 4)")
    parser.add_argument("--overlap-steps", type=int, default=5, help="streaming DiLoCo tau (default 5)")
    parser.add_argument("--compression", default="int8", help="streaming DiLoCo codec (default int8)")
    # The sparse row's defaults are SparseLoCo's outer settings with 1/16 of each chunk (measured best within 1000x
    # fewer bytes than DDP, docs/benchmarks.md): plain outer SGD, lr 1, the local parameters become the global ones.
    parser.add_argument("--sparse-compression", default="topk:0.0625:2",
                        help="sparse streaming DiLoCo codec, topk[:DENSITY[:BITS[:CHUNK]]] (default topk:0.0625:2)")
    parser.add_argument("--sparse-outer-lr", type=float, default=1.0, help="sparse streaming DiLoCo's outer lr "
                        "(default 1)")
    parser.add_argument("--sparse-outer-momentum", type=float, default=0.0,
                        help="sparse streaming DiLoCo's outer momentum, Nesterov when > 0 (default 0)")
    parser.add_argument("--sparse-alpha", type=float, default=0.0,
                        help="sparse streaming DiLoCo's merge weight of the local parameters (default 0: the local "
                             "parameters become the global ones; error feedback keeps what a sync did not send)")
    parser.add_argument("--steps", type=int, default=640, help="inner steps of the quality phase (default 640)")
    parser.add_argument("--eval-every", type=int, default=32, help="validation every N steps (default 32)")
    parser.add_argument("--ddp-steps", type=int, default=3, help="timed hierarchical DDP steps per rate (default 3)")
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak inner AdamW lr (warm-up, cosine; default 2e-3)")
    parser.add_argument("--own-share", type=float, default=0.8,
                        help="share of a site's sequences from its own topics; 1/sites: alike (default 0.8)")
    parser.add_argument("--no-speed", action="store_true", help="quality phase only")
    parser.add_argument("--no-quality", action="store_true", help="speed phase only, every method")
    parser.add_argument("--quick", action="store_true",
                        help="the demo: speed phase only (no losses), without blocking DiLoCo")
    parser.add_argument("--loopback", action="store_true", help="skip the lab WAN even as root")
    parser.add_argument("--json", default=None, help="results file (default bench-results/diloco-<time>.json)")
    parser.add_argument("--plot", default=None, help="plot file (default: the JSON path with .png)")
    parser.add_argument("--png", dest="plot", help=argparse.SUPPRESS)  # the flag's former name
    parser.add_argument("--heterogeneous", action="store_true",
                        help="the benchmark of unequal sites instead (slowed, unequally sized), with options of its "
                             "own: multidc bench diloco --heterogeneous --help")
    parser.add_argument("--auto", action="store_true",
                        help="the benchmark of 'auto' settings against a grid of H instead, with options of its own: "
                             "multidc bench diloco --auto --help")
    parser.add_argument("--timeout-s", type=float, default=3600.0,
                        help="give up on a job after this many seconds (default 3600: the quality phase trains 5 "
                             "methods x --steps; it ran past 1800 s on 2 busy cores)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench model's size flags, shared with ``multidc bench diloco --heterogeneous``."""
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")


def _methods(args, *, quality: bool, rate: str | None = None) -> list[dict]:
    """The methods with their step windows (see the module docstring)."""
    h, tau = args.sync_every, args.overlap_steps
    plain = {"sync_every": h}
    streaming = {"sync_every": h, "fragments": args.fragments, "overlap_steps": tau, "compression": args.compression}
    windows = {  # (warm-up, timed) steps in the speed phase; DiLoCo's window holds one sync (at step h)
        "hierarchical_ddp": (0, 1) if rate and parse_rate(rate) < SLOW_RATE else (1, args.ddp_steps),
        "diloco": (h // 2, h), "streaming_diloco": (h + tau, h), "sparse_streaming_diloco": (h + tau, h),
        "sites_alone": (5, h),
    }
    kinds = {"hierarchical_ddp": {"kind": "ddp"}, "diloco": {"kind": "diloco", "diloco": plain},
             "streaming_diloco": {"kind": "diloco", "diloco": streaming},
             "sparse_streaming_diloco": {"kind": "diloco", "diloco": {**streaming, **_sparse(args)}},
             "sites_alone": {"kind": "site"}}
    out = []
    for name in _selected(args):
        warmup, timed = (0, args.steps) if quality else windows[name]
        out.append({"name": name, **kinds[name], "warmup": warmup, "steps": warmup + timed,
                    "overlaps": name != "diloco"})  # DDP's hook and streaming overlap compute; DiLoCo blocks
    return out


def _sparse(args) -> dict:
    """The sparse row's DiLoCoConfig fields beside the streaming ones."""
    return {"compression": args.sparse_compression, "outer_lr": args.sparse_outer_lr, "alpha": args.sparse_alpha,
            "outer_momentum": args.sparse_outer_momentum, "nesterov": args.sparse_outer_momentum > 0}


def _selected(args) -> list[str]:
    if args.methods is None:
        return list(QUICK_METHODS if args.quick else METHODS)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods {args.methods!r}: {unknown or 'none given'} not among {', '.join(METHODS)}.")
    if "sites_alone" not in names and not args.no_speed:
        raise ValueError(f"--methods {args.methods!r} needs sites_alone for the speed phase's utilization (or "
                         f"pass --no-speed).")
    return [m for m in METHODS if m in names]


def sites_and_rates(args, example: str) -> list[str]:
    """``--sites`` / ``--ranks-per-site`` checked and ``--rates`` parsed (shared with ``--auto``); ValueError naming
    the flag, ``example`` the rates to suggest."""
    if args.sites < 2 or args.ranks_per_site < 1:
        raise ValueError(f"--sites {args.sites} must be >= 2 (DiLoCo syncs between sites) and --ranks-per-site >= 1.")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not rates:
        raise ValueError(f"--rates needs at least one rate, e.g. {example}.")
    for rate in rates:
        parse_rate(rate)
    return rates


def _validate(args) -> list[str]:
    rates = sites_and_rates(args, "10mbit,50mbit,200mbit")
    if min(args.steps, args.ddp_steps, args.sync_every, args.dim, args.layers, args.batch, args.seq) < 1:
        raise ValueError("--steps, --ddp-steps, --sync-every, --dim, --layers, --batch and --seq must be >= 1.")
    if args.eval_every < 1:
        raise ValueError("--eval-every must be >= 1.")
    if not 0 <= args.own_share <= 1:
        raise ValueError(f"--own-share {args.own_share} must be a fraction between 0 and 1.")
    if args.no_speed and (args.quick or args.no_quality):
        raise ValueError("--no-speed (quality only) cannot be combined with --quick or --no-quality (speed only).")
    from multidc.hierarchical.diloco import DiLoCoConfig  # the settings' own checks, with their messages

    _selected(args)
    if not args.sparse_compression.startswith("topk"):
        raise ValueError(f"--sparse-compression {args.sparse_compression!r} must be a top-k codec: topk or "
                         f"topk:DENSITY[:BITS[:CHUNK]], e.g. topk:0.03125:2.")
    for codec in ({"compression": args.compression}, _sparse(args)):
        DiLoCoConfig(sync_every=args.sync_every, fragments=args.fragments, overlap_steps=args.overlap_steps, **codec)
    return sorted(rates, key=parse_rate)


def _plan(args, methods: list[dict], *, quality: bool) -> dict:
    return {"methods": methods, "seed": 0, "batch": args.batch, "lr": args.lr, "streams": 2, "topics": 8,
            "model": {"vocab": 128, "dim": args.dim, "layers": args.layers, "heads": 4, "seq": args.seq},
            "eval_every": args.eval_every if quality else 0, "val_sequences": 64, "own_share": args.own_share}


def _job(args, plan: dict, rate: str | None, tmp: str, tag: str) -> tuple[list[dict], bool]:
    """Run one job of ranks on the lab WAN at ``rate`` (None: unshaped); (records, shaped)."""
    label = f"[multidc bench diloco] {tag}: {args.sites} sites x {args.ranks_per_site} ranks"
    return run_job("multidc.hierarchical.tools._diloco_worker", {**plan, "out": os.path.join(tmp, f"{tag}.json")},
                   sites=args.sites, ranks_per_site=args.ranks_per_site, rate=rate, loopback=args.loopback,
                   timeout_s=args.timeout_s, label=label)


def run_job(worker: str, plan: dict, *, sites: int, ranks_per_site, rate: str | None, loopback: bool,
            timeout_s: float, label: str) -> tuple[list[dict], bool]:
    """Run ``python -m worker PLAN_JSON`` as ``sites`` sites on the lab WAN at ``rate`` (None: unshaped; loopback
    without the lab); the ranks write their records to ``plan["out"]``. Returns (records, shaped); raises
    RuntimeError when a rank fails. ``plan`` gains ``iface`` (the lab's WAN interface, or None)."""
    job = SiteJob([sys.executable, "-m", worker], sites=sites, ranks_per_site=ranks_per_site, wan_rate=rate,
                  loopback=loopback, env={"OMP_NUM_THREADS": "1"})
    plan["iface"] = None if job.reason else SITE_IFACE
    job.argv.append(json.dumps(plan))
    where = f"lab WAN {rate or 'unshaped'}" if not job.reason else f"loopback ({job.reason}), unshaped"
    print(f"{label}, {where}", flush=True)
    with job:
        codes = job.wait(timeout_s)
    if any(codes):
        raise RuntimeError(f"bench ranks exited with codes {codes} (see their output above); a code of -9 means "
                           f"killed after --timeout-s {timeout_s} or after a peer's failure.")
    with open(plan["out"]) as f:
        return json.load(f), not job.reason


def run(args: argparse.Namespace) -> int:
    rates = _validate(args)
    out = args.json or os.path.join("bench-results", datetime.datetime.now().strftime("diloco-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    from multidc.hierarchical.tools import _diloco_report as report

    results: dict = {"config": vars(args) | {"rates": rates}, "speed": {}, "quality": None}
    with tempfile.TemporaryDirectory(prefix="multidc-bench-diloco-") as tmp:
        if not (args.quick or args.no_quality):
            records, _ = _job(args, _plan(args, _methods(args, quality=True), quality=True), None, tmp, "quality")
            results["quality"] = report.quality(records, args)
        for rate in [] if args.no_speed else rates:
            records, shaped = _job(args, _plan(args, _methods(args, quality=False, rate=rate), quality=False),
                                   rate, tmp, f"speed-{rate}")
            results["speed"][rate] = report.speed(records, args, shaped=shaped)
            results["shaped"] = shaped
    results["targets"] = report.targets(results, rates)
    report.print_tables(results, args, rates)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(report.plot(results, rates, args.plot or os.path.splitext(out)[0] + ".png"))
    print(json.dumps({"bench": "diloco", "speed": results["speed"], "targets": results["targets"]}))
    print(f"[multidc bench diloco] results written to {out}")
    return 0
