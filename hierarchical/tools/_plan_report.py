"""``multidc plan``'s reports: the plan table, the paper table, the check against a ``bench diloco`` result, and the
plot. Each prints its table and returns what ``--json`` writes."""

from __future__ import annotations

import math

from multidc.hierarchical.planning import paper as paper_model
from multidc.hierarchical.planning.model import (
    SYNC_EVERY,
    WAN_PIPELINES,
    Job,
    Link,
    Setting,
    bandwidth_for,
    candidates,
    cheapest,
    predict,
)

CHECK_PP = 10.0  # the tolerance: predicted utilization within 10 percentage points of the measured one


def _gbps(rate_bps: float) -> str:
    return "unreachable" if math.isinf(rate_bps) else f"{rate_bps / 1e9:.4g}"


def plan(job: Job, link: Link, settings: list[Setting], *, target: float) -> dict:
    """Print and return each setting's prediction on ``link`` and the rate it needs for ``target``."""
    print(f"job: {job.params:,} parameters, {job.step_s:g} s per inner step, {job.sites} sites x "
          f"{job.ranks_per_site} ranks; link {link.bandwidth_bps / 1e9:.4g} Gbit/s per direction, rtt "
          f"{link.rtt_s:g} s, payload share {link.efficiency:g}")
    print(f"{'setting':<34} {'WAN MB/step':>12} {'step s':>9} {'exposed s':>10} {'util':>6} "
          f"{f'Gbit/s for {target:.0%}':>16}")
    rows = []
    for setting in settings:
        pred = predict(setting, job, link)
        need = bandwidth_for(target, setting, job, rtt_s=link.rtt_s, efficiency=link.efficiency)
        print(f"{setting.label:<34} {pred.wan_bytes_per_step / 1e6:>12.4g} {pred.step_s:>9.4g} "
              f"{pred.exposed_s:>10.4g} {pred.utilization:>6.1%} {_gbps(need):>16}")
        rows.append({"setting": setting.label, **_setting_dict(setting),
                     "wan_bytes_per_step": pred.wan_bytes_per_step, "step_s": pred.step_s,
                     "exposed_s": pred.exposed_s, "utilization": pred.utilization,
                     "needs_gbps": None if math.isinf(need) else need / 1e9})
    best = cheapest(target, job, link, candidates(chunk_mb=settings[0].chunk_mb, streams=settings[0].streams))
    if best is None:
        print(f"no setting reaches {target:.0%} on this link (up to H={SYNC_EVERY[-1]}, chunk_mb="
              f"{WAN_PIPELINES[-1][0]:g}, streams={WAN_PIPELINES[-1][1]}): a faster link or a shorter step time")
    else:
        print(f"cheapest setting reaching {target:.0%}: {best.setting.label}, chunk_mb={best.setting.chunk_mb:g} "
              f"streams={best.setting.streams} (utilization {best.utilization:.1%}, "
              f"{best.wan_bytes_per_step / 1e6:.4g} MB per inner step)")
    return {"job": {f: getattr(job, f) for f in ("params", "step_s", "sites", "ranks_per_site", "ddp_overlap")},
            "link": {"bandwidth_bps": link.bandwidth_bps, "rtt_s": link.rtt_s, "efficiency": link.efficiency},
            "target": target, "rows": rows,
            "cheapest": None if best is None else {"setting": best.setting.label, **_setting_dict(best.setting),
                                                   "utilization": best.utilization}}


def _setting_dict(setting: Setting) -> dict:
    return {"method": setting.method, "compression": setting.compression, "sync_every": setting.sync_every,
            "fragments": setting.fragments, "overlap_steps": setting.overlap_steps, "chunk_mb": setting.chunk_mb,
            "streams": setting.streams}


def paper(target: float) -> dict:
    """Print and return the paper's cells with ours, then multidc's methods at 1B/10B/100B x 1/10/100 Gbit/s."""
    cells = paper_model.paper_check()
    print(f"Streaming DiLoCo paper (arXiv 2501.18512), Gbit/s for {paper_model.TARGET:.0%} utilization:")
    print(f"{'size':<5} {'method':<18} {'paper':>7} {'ours':>8} {'ours/paper':>10}  within 15%")
    for c in cells:
        print(f"{c['size']:<5} {c['method']:<18} {c['paper_gbps']:>7.4g} {c['ours_gbps']:>8.4g} "
              f"{c['ratio']:>10.3f}  {'yes' if c['within_15pct'] else 'NO'}")
    table = paper_model.scale_table(target)
    rates = [f"{r}" for r in paper_model.RATES_GBPS]
    print(f"\nmultidc's methods (2 sites x 8 ranks, float32 gradients): utilization at "
          f"{', '.join(rates)} Gbit/s; Gbit/s for {target:.0%}")
    print(f"{'size':<5} {'setting':<34} " + " ".join(f"{r + ' Gb/s':>9}" for r in rates) + f" {'needs':>11}")
    for row in table:
        utils = " ".join(f"{row['utilization'][r]:>9.1%}" for r in rates)
        print(f"{row['size']:<5} {row['setting']:<34} {utils} {_gbps(row['needs_gbps'] * 1e9):>11}")
    return {"cells": cells, "scale": [{**r, "needs_gbps": None if math.isinf(r["needs_gbps"]) else r["needs_gbps"]}
                                      for r in table]}


def check(bench: dict, *, efficiency: float) -> dict:
    """Predicted vs measured utilization for every row of a ``multidc bench diloco`` result (``speed`` part).

    The job is the benchmark's: its model's parameters (built as the benchmark builds it), its sites and ranks, and
    as step time that of the sites training alone at the same rate; DDP hides nothing behind backward (CPU ranks:
    compute and gloo share the cores). The rate is the row's ``tc`` rate, no round trip (the lab has no delay).
    """
    from multidc.hierarchical.tools.lab import parse_rate

    try:
        config, speed = bench["config"], bench["speed"]
        params = _bench_params(config)
        settings = _bench_settings(config)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"--check: not a `multidc bench diloco` JSON result (missing {exc}); give the file its "
                         f"--json wrote, e.g. docs/bench_diloco.json.") from exc
    rows = []
    print(f"predicted vs measured compute utilization ({params:,} parameters, {config['sites']} sites x "
          f"{config['ranks_per_site']} ranks, payload share {efficiency:g}):")
    print(f"{'rate':<9} {'method':<24} {'predicted':>9} {'measured':>9} {'diff pp':>8}")
    for rate, methods in speed.items():
        alone = methods.get("sites_alone")
        if not alone:
            continue
        job = Job(params=params, step_s=1 / alone["steps_per_s"], sites=config["sites"],
                  ranks_per_site=config["ranks_per_site"], ddp_overlap=0.0)
        link = Link(bandwidth_bps=parse_rate(rate), efficiency=efficiency)
        for name, measured in methods.items():
            if name not in settings:
                continue
            predicted = predict(settings[name], job, link).utilization
            diff = 100 * (predicted - measured["utilization"])
            rows.append({"rate": rate, "method": name, "predicted": predicted,
                         "measured": measured["utilization"], "diff_pp": diff, "within": abs(diff) <= CHECK_PP})
            print(f"{rate:<9} {name:<24} {predicted:>9.1%} {measured['utilization']:>9.1%} {diff:>+8.1f}")
    within = sum(r["within"] for r in rows)
    print(f"{within} of {len(rows)} rows within {CHECK_PP:g} percentage points")
    return {"params": params, "rows": rows, "within": within, "total": len(rows)}


def _bench_params(config: dict) -> int:
    from multidc.hierarchical.tools._bench_model import TinyGPT

    # the benchmark's model (bench_diloco.py builds it with vocab 128, 4 heads)
    model = TinyGPT(vocab=128, dim=config["dim"], layers=config["layers"], heads=4, seq=config["seq"])
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _bench_settings(config: dict) -> dict[str, Setting]:
    h, p, tau = config["sync_every"], config["fragments"], config["overlap_steps"]
    streaming = {"sync_every": h, "fragments": p, "overlap_steps": tau}
    return {
        "hierarchical_ddp": Setting(method="hierarchical_ddp"),
        "diloco": Setting(method="diloco", sync_every=h),
        "streaming_diloco": Setting(method="streaming_diloco", compression=config["compression"], **streaming),
        "sparse_streaming_diloco": Setting(method="streaming_diloco", compression=config["sparse_compression"],
                                           **streaming),
    }


def plot(job: Job, link: Link, settings: list[Setting], path: str, *, target: float) -> None:
    """Utilization against link rate per setting (log rate), the target and the job's own rate marked."""
    from multidc.hierarchical.tools import _figures

    plt = _figures.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    rates = [10 ** (6 + i / 20) for i in range(0, 121)]  # 1 Mbit/s .. 1 Tbit/s
    for setting in settings:
        utils = [predict(setting, job, Link(bandwidth_bps=r, rtt_s=link.rtt_s, efficiency=link.efficiency))
                 .utilization for r in rates]
        ax.plot([r / 1e9 for r in rates], utils, label=setting.label)
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.0%}")
    ax.axvline(link.bandwidth_bps / 1e9, color="black", linestyle="--", label="this link")
    ax.set_xscale("log")
    ax.set_xlabel("WAN rate per site, per direction (Gbit/s)")
    ax.set_ylabel("compute utilization")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{job.params / 1e9:.3g}B parameters, {job.step_s:g} s/step, {job.sites} sites x "
                 f"{job.ranks_per_site} ranks")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _figures.save(fig, path)
