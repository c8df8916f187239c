"""``multidc plan``: which cross-site method keeps the compute busy on a given WAN, predicted, not measured.

For hierarchical DDP (each codec), DiLoCo, streaming DiLoCo (int8, int4) and sparse streaming DiLoCo (top-k):
WAN bytes per inner step, predicted step time, exposed communication, compute utilization, the rate each needs
for ``--target``, and the first setting (least departure from plain DDP) that reaches it. The model:
docs/guides/plan.md. ``--paper`` checks it against the Streaming DiLoCo paper's bandwidth table; ``--check``
against the rows of a ``multidc bench diloco`` result. Examples::

    multidc plan --params 1e9 --step-time 0.1 --sites 2 --ranks-per-site 8 --bandwidth 10gbit --rtt 0.05
    multidc plan --model torchvision.models.resnet50 --step-time 0.3 --doctor doctor.json --json plan.json
    multidc plan --paper
    multidc plan --check docs/bench_diloco.json
"""

from __future__ import annotations

import argparse
import json
import math

from multidc.hierarchical.planning.model import Job, Link, Setting
from multidc.hierarchical.tools import _plan_report as report
from multidc.hierarchical.tools.lab import parse_rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--params", default=None, help="trainable parameters: 350e6, 1e9, or 350M, 7B")
    size.add_argument("--model", default=None,
                      help="dotted path of a callable that builds an nn.Module (module.attr or module:attr); its "
                           "trainable parameters are counted")
    parser.add_argument("--step-time", type=float, default=None, help="seconds of compute per inner step")
    parser.add_argument("--sites", type=int, default=2, help="number of sites (default 2)")
    parser.add_argument("--ranks-per-site", type=int, default=1, help="ranks in each site: WAN rails (default 1)")
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--bandwidth", default=None, help="per-direction WAN rate per site: 10gbit, 400mbit")
    link.add_argument("--doctor", default=None, help="a `multidc doctor --json` file: sites, ranks and the slowest "
                                                     "site's measured inter-site rate")
    parser.add_argument("--rtt", type=float, default=0.0, help="WAN round-trip time in seconds (default 0)")
    parser.add_argument("--efficiency", type=float, default=0.95,
                        help="share of the rate that carries payload, after TCP/IP headers (default 0.95)")
    parser.add_argument("--ddp-overlap", type=float, default=1.0,
                        help="share of backward DDP's all-reduce hides (default 1: GPUs; 0: CPU ranks)")
    parser.add_argument("--target", type=float, default=0.95, help="target compute utilization (default 0.95)")
    parser.add_argument("--sync-every", type=int, default=100, help="DiLoCo H of the table's rows (default 100)")
    parser.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo P (default 4)")
    parser.add_argument("--overlap-steps", type=int, default=5, help="streaming DiLoCo tau (default 5)")
    parser.add_argument("--chunk-mb", type=float, default=32.0, help="WanConfig.chunk_mb (default 32)")
    parser.add_argument("--streams", type=int, default=2, help="WanConfig.streams (default 2)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="write utilization against bandwidth per method to this PNG")
    parser.add_argument("--paper", action="store_true", help="print the Streaming DiLoCo paper's table, with ours")
    parser.add_argument("--check", default=None, metavar="BENCH_JSON",
                        help="predicted vs measured utilization for every row of a `multidc bench diloco` result")


def run(args: argparse.Namespace) -> int:
    out: dict = {}
    if args.paper:
        out["paper"] = report.paper(args.target)
    if args.check:
        out["check"] = report.check(_load_json(args.check, "--check"), efficiency=args.efficiency)
    if args.params is not None or args.model is not None or not (args.paper or args.check):
        job, link = _job_and_link(args)
        out["plan"] = report.plan(job, link, _settings(args), target=args.target)
        if args.plot:
            report.plot(job, link, _settings(args), args.plot, target=args.target)
            print(f"plot: {args.plot}")
    elif args.plot:
        raise ValueError("--plot draws a plan: give --params or --model with --step-time and a link too.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"json: {args.json}")
    return 0


def _settings(args) -> list[Setting]:
    wan = {"chunk_mb": args.chunk_mb, "streams": args.streams}
    h, p, tau = args.sync_every, args.fragments, args.overlap_steps
    rows = [Setting(method="hierarchical_ddp", compression=c, **wan) for c in ("none", "bf16", "int8")]
    rows.append(Setting(method="diloco", compression="none", sync_every=h, **wan))
    rows += [Setting(method="streaming_diloco", compression=c, sync_every=h, fragments=p, overlap_steps=tau, **wan)
             for c in ("int8", "int4", "topk")]
    return rows


def _job_and_link(args) -> tuple[Job, Link]:
    if args.params is None and args.model is None:
        raise ValueError("give the model's size: --params 1e9 (or 7B) or --model package.module.build_model.")
    if args.step_time is None:
        raise ValueError("give --step-time: seconds of compute per inner step (time a few steps on one site).")
    sites, ranks, rate = args.sites, args.ranks_per_site, None
    if args.doctor:
        sites, ranks, rate = _from_doctor(_load_json(args.doctor, "--doctor"), args.doctor)
    elif args.bandwidth is not None:
        rate = parse_rate(args.bandwidth)
    if rate is None:
        raise ValueError("give the WAN: --bandwidth 10gbit (per direction, per site) or --doctor doctor.json.")
    params = _count_model(args.model) if args.model else _parse_params(args.params)
    job = Job(params=params, step_s=args.step_time, sites=sites, ranks_per_site=ranks,
              ddp_overlap=args.ddp_overlap)
    return job, Link(bandwidth_bps=rate, rtt_s=args.rtt, efficiency=args.efficiency)


def _parse_params(text: str) -> int:
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    raw = text.strip().upper()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"--params {text!r} is not a parameter count; write 1e9, 1000000000, 350M or 7B.")
    return int(round(value))


def _count_model(path: str) -> int:
    import importlib

    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        build = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {path!r}: cannot import it ({exc}); give module.attr of a callable that builds "
                         f"an nn.Module, importable here (e.g. torchvision.models.resnet50).") from exc
    if not callable(build):
        raise ValueError(f"--model {path!r} is not a callable; give module.attr of a function or class that "
                         f"builds an nn.Module.")
    model = build()
    if not hasattr(model, "parameters"):
        raise ValueError(f"--model {path!r} built a {type(model).__name__}, not an nn.Module.")
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if count < 1:
        raise ValueError(f"--model {path!r} has no trainable parameter.")
    return count


def _from_doctor(doctor: dict, path: str) -> tuple[int, int, float]:
    """(sites, ranks per site, the slowest site's inter-site rate in bits/s) from a ``multidc doctor --json``."""
    try:
        sites = doctor["sites"]
        rates = [site["inter_MBps_site"] for site in sites]
        ranks = min(site["rails"] for site in sites)  # rails: the ranks that carry WAN traffic
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--doctor {path}: not a `multidc doctor --json` report (missing {exc}); write one with "
                         f"`multidc lab run ... multidc doctor --json FILE` or give --bandwidth.") from exc
    if len(sites) < 2 or any(rate is None or rate <= 0 for rate in rates):
        raise ValueError(f"--doctor {path}: the report has no measured inter-site rate for every site (one site, or "
                         f"a site without rails); give --bandwidth instead.")
    return len(sites), ranks, min(rates) * 8e6  # MB/s -> bit/s


def _load_json(path: str, flag: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror}).") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {path}: not JSON ({exc.msg} at line {exc.lineno}).") from exc
