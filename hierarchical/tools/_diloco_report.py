"""Figures of ``multidc bench diloco`` from the ranks' records: summaries, the issue's targets, table, PNG."""

from __future__ import annotations

from multidc.hierarchical.tools import _figures
from multidc.hierarchical.tools.lab import parse_rate

_DDP, _STREAM, _ALONE = "hierarchical_ddp", "streaming_diloco", "sites_alone"
UTILIZATION_TARGET, DDP_AT_MOST, BYTES_FACTOR, LOSS_WITHIN = 0.95, 0.30, 100.0, 0.03


def _methods(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in records))


def speed(records: list[dict], args, *, shaped: bool) -> dict[str, dict]:
    """Per method: step rate (slowest rank's window), tokens/s, WAN bytes per inner step (busiest site),
    utilization against the sites training alone, and the bound the link puts on it."""
    tokens_per_step = args.sites * args.ranks_per_site * args.batch * args.seq
    rows = {}
    for method in _methods(records):
        ends = [r for r in records if r["method"] == method and "timed_steps" in r]
        steps, seconds = ends[0]["timed_steps"], max(r["seconds"] for r in ends)
        key = "iface_tx_bytes" if shaped else "payload_bytes"
        per_site: dict[int, int] = {}
        for r in ends:
            per_site[r["site"]] = per_site.get(r["site"], 0) + r[key]
        stats = [r["stats"] for r in ends if r["stats"]]
        rows[method] = {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds,
                        "tokens_per_s": tokens_per_step * steps / seconds,
                        "wan_bytes_per_step": max(per_site.values()) / steps,
                        "exposed_s": max((s["exposed_s"] for s in stats), default=0.0),
                        "outer_syncs": max((s["outer_syncs"] for s in stats), default=0),
                        "overlaps": ends[0].get("overlaps", True)}
    alone = rows[_ALONE]["steps_per_s"]
    for row in rows.values():
        row["utilization"] = row["steps_per_s"] / alone
    return rows


def link_bound(rows: dict, rate: str) -> dict[str, float]:
    """The highest utilization the link allows each method: its WAN bytes at line rate overlapped with the alone
    step (DDP's hook, streaming DiLoCo) or added to it (blocking DiLoCo)."""
    line = parse_rate(rate) / 8
    compute = 1 / rows[_ALONE]["steps_per_s"]
    bound = {}
    for method, row in rows.items():
        wire = row["wan_bytes_per_step"] / line
        bound[method] = compute / (max(compute, wire) if row["overlaps"] else compute + wire)
    return bound


def quality(records: list[dict], args) -> dict[str, dict]:
    """Per method: validation loss against tokens seen (mean over sites of each site's model), and the last."""
    tokens_per_step = args.sites * args.ranks_per_site * args.batch * args.seq
    out = {}
    for method in _methods(records):
        by_step: dict[int, list[float]] = {}
        for r in records:
            if r["method"] == method and "val_loss" in r and r["local"] == 0:
                by_step.setdefault(r["step"], []).append(r["val_loss"])
        curve = [[step * tokens_per_step, sum(v) / len(v)] for step, v in sorted(by_step.items())]
        out[method] = {"tokens": curve[-1][0], "val_loss": curve[-1][1], "curve": curve}
    return out


def targets(results: dict, rates: list[str]) -> dict:
    """The issue's three targets, measured (``met`` None when this run cannot judge one)."""
    speed, out = results["speed"], {}
    rates = [rate for rate in rates if rate in speed]
    if rates:
        out.update(_speed_targets(speed, rates))
    q = results["quality"]
    if q:
        ddp, stream, alone = (q[m]["val_loss"] for m in (_DDP, _STREAM, _ALONE))
        out["loss"] = {"ddp": ddp, "streaming": stream, "alone": alone, "gap_vs_ddp": stream / ddp - 1,
                       "met": stream / ddp - 1 <= LOSS_WITHIN and stream < alone,
                       "rule": f"validation loss within {LOSS_WITHIN:.0%} of hierarchical DDP and below sites alone"}
    return out


def _speed_targets(speed: dict, rates: list[str]) -> dict:
    out = {}
    low = next((rate for rate in rates if speed[rate][_DDP]["utilization"] <= DDP_AT_MOST), None)
    out["utilization"] = {
        "rate": low, "ddp": speed[low][_DDP]["utilization"] if low else None,
        "streaming": speed[low][_STREAM]["utilization"] if low else None,
        "met": speed[low][_STREAM]["utilization"] >= UTILIZATION_TARGET if low else None,
        "rule": f"at the lowest rate where hierarchical DDP <= {DDP_AT_MOST:.0%}, streaming DiLoCo >= "
                f"{UTILIZATION_TARGET:.0%}"}
    factors = [speed[r][_DDP]["wan_bytes_per_step"] / max(speed[r][_STREAM]["wan_bytes_per_step"], 1) for r in rates]
    out["bytes"] = {"factor_min": min(factors), "met": min(factors) >= BYTES_FACTOR,
                    "rule": f"WAN bytes per inner step >= {BYTES_FACTOR:g}x fewer than hierarchical DDP"}
    return out


def print_tables(results: dict, args, rates: list[str]) -> None:
    where = "lab WAN (tc tbf per direction)" if results.get("shaped") else "loopback, UNSHAPED: rates not applied"
    rates = [rate for rate in rates if rate in results["speed"]]
    print(f"\nDiLoCo benchmark: {args.sites} sites x {args.ranks_per_site} ranks, TinyGPT dim {args.dim} x "
          f"{args.layers} layers, batch {args.batch} x {args.seq} tokens per rank; H={args.sync_every}, streaming "
          f"P={args.fragments} tau={args.overlap_steps} {args.compression}; {where}")
    header = (f"{'rate':>9} {'method':<17}{'steps/s':>8}{'tokens/s':>10}{'util':>7}{'bound':>7}"
              f"{'WAN KB/step':>13}{'x fewer':>9}{'exposed s':>10}")
    print(header)
    print("-" * len(header))
    for rate in rates:
        rows, bound = results["speed"][rate], link_bound(results["speed"][rate], rate)
        ddp_bytes = rows[_DDP]["wan_bytes_per_step"]
        for method, r in rows.items():
            fewer = ddp_bytes / r["wan_bytes_per_step"] if r["wan_bytes_per_step"] else float("inf")
            print(f"{rate:>9} {method:<17}{r['steps_per_s']:>8.2f}{r['tokens_per_s']:>10.0f}"
                  f"{100 * r['utilization']:>6.0f}%{100 * bound[method]:>6.0f}%{r['wan_bytes_per_step'] / 1e3:>13.1f}"
                  f"{fewer:>8.0f}x{r['exposed_s']:>10.2f}")
    print("util: step rate over the sites-alone step rate in the same job; bound: what the link allows at line rate "
          "(compute / max(compute, bytes / rate)); WAN KB/step: the busiest site's bytes to other sites per inner step")
    if results["quality"]:
        print(f"\nvalidation loss (nats, all sites' topics) after {args.steps} inner steps, equal tokens:")
        for method, q in results["quality"].items():
            print(f"  {method:<17}{q['val_loss']:>8.4f}   ({q['tokens']:,} tokens)")
    for name, t in results["targets"].items():
        verdict = "n/a" if t["met"] is None else "MET" if t["met"] else "NOT MET"
        detail = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items() if k not in ("met", "rule")}
        print(f"target {name}: {verdict}  ({t['rule']}; {detail})")


def plot(results: dict, rates: list[str], path: str) -> str:
    """Write the PNG (utilization against rate; validation loss against tokens); what was done, as a line."""
    try:
        plt = _figures.pyplot()
    except ImportError as exc:
        return f"[multidc bench diloco] PNG skipped: {exc}"
    rates = [rate for rate in rates if rate in results["speed"]]
    panels = [name for name, present in (("speed", rates), ("quality", results["quality"])) if present]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    if rates:
        ax = axes[0][0]
        mbit = [parse_rate(r) / 1e6 for r in rates]
        for method in results["speed"][rates[0]]:
            ax.plot(mbit, [100 * results["speed"][r][method]["utilization"] for r in rates], marker="o",
                    label=method)
        ax.set(xscale="log", xlabel="WAN rate per direction (Mbit/s)", ylabel="compute utilization (%)",
               ylim=(0, 110), title="Utilization against bandwidth")
        ax.legend()
    if results["quality"]:
        ax = axes[0][-1]
        for method, q in results["quality"].items():
            ax.plot([c[0] / 1e6 for c in q["curve"]], [c[1] for c in q["curve"]], label=method)
        ax.set(xlabel="tokens (millions)", ylabel="validation loss (nats)", title="Loss at equal tokens")
        ax.legend()
    fig.tight_layout()
    _figures.save(fig, path, dpi=110)
    return f"[multidc bench diloco] plot written to {path}"
