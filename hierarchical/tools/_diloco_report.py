"""Figures of ``multidc bench diloco`` from the ranks' records: summaries, the issue's targets, table, PNG."""

from __future__ import annotations

from multidc.hierarchical.tools import _figures
from multidc.hierarchical.tools.lab import parse_rate

_DDP, _STREAM, _SPARSE, _ALONE = "hierarchical_ddp", "streaming_diloco", "sparse_streaming_diloco", "sites_alone"
UTILIZATION_TARGET, DDP_AT_MOST, BYTES_FACTOR, LOSS_WITHIN = 0.95, 0.30, 100.0, 0.03
SPARSE_BYTES_FACTOR, SPARSE_RATE, SPARSE_OVER_INT8 = 1000.0, "1mbit", 0.01
INT8_FROM = 10e6  # bit/s: int8 streaming's utilization target is judged from here up (below, its bytes fill the link)


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
    """The issues' targets, measured in this run (``met`` None when this run cannot judge one); a target whose
    methods this run did not measure is left out."""
    speed, out = results["speed"], {}
    rates = [rate for rate in rates if rate in speed]
    if rates:
        out.update(_speed_targets(speed, rates))
    q = results["quality"] or {}
    if all(m in q for m in (_DDP, _STREAM, _ALONE)):
        ddp, stream, alone = (q[m]["val_loss"] for m in (_DDP, _STREAM, _ALONE))
        out["loss"] = {"ddp": ddp, "streaming": stream, "alone": alone, "gap_vs_ddp": stream / ddp - 1,
                       "met": stream / ddp - 1 <= LOSS_WITHIN and stream < alone,
                       "rule": f"validation loss within {LOSS_WITHIN:.0%} of hierarchical DDP and below sites alone"}
    if all(m in q for m in (_DDP, _STREAM, _SPARSE)):
        ddp, stream, sparse = (q[m]["val_loss"] for m in (_DDP, _STREAM, _SPARSE))
        out["sparse_loss"] = {
            "ddp": ddp, "int8_streaming": stream, "sparse": sparse, "gap_vs_ddp": sparse / ddp - 1,
            "gap_vs_int8": sparse / stream - 1,
            "met": sparse / ddp - 1 <= LOSS_WITHIN and sparse / stream - 1 <= SPARSE_OVER_INT8,
            "rule": f"sparse streaming DiLoCo's validation loss within {LOSS_WITHIN:.0%} of hierarchical DDP and "
                    f"<= {SPARSE_OVER_INT8:.0%} above int8 streaming DiLoCo"}
    return out


def _speed_targets(speed: dict, rates: list[str]) -> dict:
    out, has = {}, set(speed[rates[0]])
    if {_DDP, _STREAM} <= has:
        low = next((rate for rate in rates if parse_rate(rate) >= INT8_FROM
                    and speed[rate][_DDP]["utilization"] <= DDP_AT_MOST), None)
        out["utilization"] = {
            "rate": low, "ddp": speed[low][_DDP]["utilization"] if low else None,
            "streaming": speed[low][_STREAM]["utilization"] if low else None,
            "met": speed[low][_STREAM]["utilization"] >= UTILIZATION_TARGET if low else None,
            "rule": f"at the lowest rate >= {INT8_FROM / 1e6:g} mbit where hierarchical DDP <= {DDP_AT_MOST:.0%}, "
                    f"int8 streaming DiLoCo >= {UTILIZATION_TARGET:.0%}"}
        out["bytes"] = _fewer(speed, rates, _STREAM, BYTES_FACTOR, "int8 streaming DiLoCo")
    if {_DDP, _SPARSE} <= has:
        out["sparse_bytes"] = _fewer(speed, rates, _SPARSE, SPARSE_BYTES_FACTOR, "sparse streaming DiLoCo")
    if _SPARSE in has:
        rate = SPARSE_RATE if SPARSE_RATE in rates else None
        util = speed[rate][_SPARSE]["utilization"] if rate else None
        out["sparse_utilization"] = {
            "rate": rate, "sparse": util, "met": util >= UTILIZATION_TARGET if rate else None,
            "rule": f"at {SPARSE_RATE}, sparse streaming DiLoCo >= {UTILIZATION_TARGET:.0%}"}
    return out


def _fewer(speed: dict, rates: list[str], method: str, factor: float, label: str) -> dict:
    """How many times fewer WAN bytes per inner step ``method`` sends than hierarchical DDP: the worst rate."""
    factors = [speed[r][_DDP]["wan_bytes_per_step"] / max(speed[r][method]["wan_bytes_per_step"], 1) for r in rates]
    return {"factor_min": min(factors), "met": min(factors) >= factor,
            "rule": f"{label}: WAN bytes per inner step >= {factor:g}x fewer than hierarchical DDP"}


def print_tables(results: dict, args, rates: list[str]) -> None:
    where = ("no speed phase" if not results["speed"] else "lab WAN (tc tbf per direction)" if results.get("shaped")
             else "loopback, UNSHAPED: rates not applied")
    rates = [rate for rate in rates if rate in results["speed"]]
    print(f"\nDiLoCo benchmark: {args.sites} sites x {args.ranks_per_site} ranks, TinyGPT dim {args.dim} x "
          f"{args.layers} layers, batch {args.batch} x {args.seq} tokens per rank; H={args.sync_every}, streaming "
          f"P={args.fragments} tau={args.overlap_steps} {args.compression}, sparse {_sparse_label(args)}; {where}")
    header = (f"{'rate':>9} {'method':<24}{'steps/s':>8}{'tokens/s':>10}{'util':>7}{'bound':>7}"
              f"{'WAN KB/step':>13}{'x fewer':>9}{'exposed s':>10}")
    print(header)
    print("-" * len(header))
    for rate in rates:
        rows, bound = results["speed"][rate], link_bound(results["speed"][rate], rate)
        ddp_bytes = rows[_DDP]["wan_bytes_per_step"] if _DDP in rows else float("nan")
        for method, r in rows.items():
            fewer = ddp_bytes / r["wan_bytes_per_step"] if r["wan_bytes_per_step"] else float("inf")
            print(f"{rate:>9} {method:<24}{r['steps_per_s']:>8.2f}{r['tokens_per_s']:>10.0f}"
                  f"{100 * r['utilization']:>6.0f}%{100 * bound[method]:>6.0f}%{r['wan_bytes_per_step'] / 1e3:>13.1f}"
                  f"{fewer:>8.0f}x{r['exposed_s']:>10.2f}")
    print("util: step rate over the sites-alone step rate in the same job; bound: what the link allows at line rate "
          "(compute / max(compute, bytes / rate)); WAN KB/step: the busiest site's bytes to other sites per inner "
          "step; a row's 'steps' column in the JSON is its timed window (hierarchical DDP: one step below 10 mbit)")
    if results["quality"]:
        print(f"\nvalidation loss (nats, all sites' topics) after {args.steps} inner steps, equal tokens:")
        for method, q in results["quality"].items():
            print(f"  {method:<24}{q['val_loss']:>8.4f}   ({q['tokens']:,} tokens)")
    for name, t in results["targets"].items():
        verdict = "n/a" if t["met"] is None else "PASS" if t["met"] else "FAIL"
        detail = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items() if k not in ("met", "rule")}
        print(f"target {name}: {verdict}  ({t['rule']}; {detail})")


def _sparse_label(args) -> str:
    return (f"{args.sparse_compression} outer lr {args.sparse_outer_lr:g} momentum {args.sparse_outer_momentum:g} "
            f"alpha {args.sparse_alpha:g}")


def wan_bytes(results: dict, rates: list[str]) -> dict[str, float]:
    """Per method: WAN bytes per inner step, the median over the rates (they do not depend on the rate)."""
    rates = [rate for rate in rates if rate in results["speed"]]
    out = {}
    for method in results["speed"][rates[0]] if rates else ():
        values = sorted(results["speed"][r][method]["wan_bytes_per_step"] for r in rates)
        out[method] = values[len(values) // 2]
    return out


def plot(results: dict, rates: list[str], path: str) -> str:
    """Write the PNG (utilization against rate; validation loss against WAN bytes per inner step, one point per
    method; validation loss against tokens); what was done, as a line."""
    try:
        plt = _figures.pyplot()
    except ImportError as exc:
        return f"[multidc bench diloco] PNG skipped: {exc}"
    rates = [rate for rate in rates if rate in results["speed"]]
    quality = results["quality"] or {}
    by_bytes = {m: b for m, b in wan_bytes(results, rates).items() if m in quality}
    panels = [draw for draw, present in ((_utilization, rates), (_bytes_loss, by_bytes), (_curves, quality))
              if present]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
    for ax, draw in zip(axes[0], panels):
        draw(ax, results, rates, by_bytes)
    fig.tight_layout()
    _figures.save(fig, path, dpi=110)
    return f"[multidc bench diloco] plot written to {path}"


def _utilization(ax, results: dict, rates: list[str], _bytes: dict) -> None:
    mbit = [parse_rate(r) / 1e6 for r in rates]
    for method in results["speed"][rates[0]]:
        ax.plot(mbit, [100 * results["speed"][r][method]["utilization"] for r in rates], marker="o", label=method)
    ax.set(xscale="log", xlabel="WAN rate per direction (Mbit/s)", ylabel="compute utilization (%)",
           ylim=(0, 115), title="Utilization against bandwidth")
    ax.legend(fontsize=8)


def _bytes_loss(ax, results: dict, _rates: list[str], by_bytes: dict) -> None:
    for method, sent in by_bytes.items():
        kb = max(sent, 1.0) / 1e3  # the sites alone send only the harness' barriers
        ax.scatter([kb], [results["quality"][method]["val_loss"]], s=40, label=method)
        ax.annotate(f"{kb:,.1f} KB", (kb, results["quality"][method]["val_loss"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.set(xscale="log", xlabel="WAN KB per inner step (busiest site, log)", ylabel="final validation loss (nats)",
           title="Bytes against quality")
    ax.legend(fontsize=8)


def _curves(ax, results: dict, _rates: list[str], _bytes: dict) -> None:
    for method, q in results["quality"].items():
        ax.plot([c[0] / 1e6 for c in q["curve"]], [c[1] for c in q["curve"]], label=method)
    ax.set(xlabel="tokens (millions)", ylabel="validation loss (nats)", title="Loss at equal tokens")
    ax.legend(fontsize=8)
