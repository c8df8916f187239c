"""Figures of ``multidc bench diloco --auto`` from the ranks' records: the rows (grid of H and the auto run), the
verdicts, the rate change, the table. Pure: no process group, no lab."""

from __future__ import annotations

from multidc.hierarchical.diloco.auto import REPLAN_FACTOR

ALONE, AUTO = "sites_alone", "auto"
UTILIZATION_SHARE = 0.95
"""Auto's utilization must reach this share of the grid's best."""
LOSS_TOLERANCE = 0.01
"""Auto's validation loss may exceed the reference loss by this fraction (run-to-run noise of the bench model)."""


def rows(records: list[dict], *, shaped: bool, tokens_per_step: int) -> dict[str, dict]:
    """Per row (``sites_alone``, ``h<H>`` of the grid, ``auto``): steps per second of its slowest rank's timed
    window, tokens/s, WAN bytes of the busiest site (interface counters under the lab, payload counters on
    loopback) in all and per inner step, validation loss of the global parameters at the end (mean over sites), the
    H of its rounds; utilization is its step rate over ``sites_alone``'s, as ``multidc bench diloco`` reports it."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["row"] for r in records if "seconds" in r):
        ends = [r for r in records if r["row"] == name and "seconds" in r]
        steps, seconds = ends[0]["timed_steps"], max(r["seconds"] for r in ends)
        per_site: dict[int, int] = {}
        for r in ends:
            per_site[r["site"]] = per_site.get(r["site"], 0) + r["iface_tx_bytes" if shaped else "payload_bytes"]
        losses = [r["val_loss"] for r in ends if r.get("val_loss") is not None]
        wan = max(per_site.values())
        settled = [r["settled"] for r in ends if r.get("settled")]
        out[name] = {"kind": ends[0]["kind"], "h": ends[0].get("h"), "plans": ends[0].get("plans", []),
                     "pipeline": ends[0].get("pipeline"), "steps": steps, "seconds": seconds,
                     "settled_steps_per_s": ((settled[0]["to_step"] - settled[0]["from_step"])
                                             / max(s["seconds"] for s in settled)) if settled else None,
                     "steps_per_s": steps / seconds, "tokens_per_s": tokens_per_step * steps / seconds,
                     "wan_bytes": wan, "wan_bytes_per_step": wan / steps,
                     "val_loss": sum(losses) / len(losses) if losses else None}
    alone = out[ALONE]["steps_per_s"] if ALONE in out else None
    for row in out.values():
        row["utilization"] = row["steps_per_s"] / alone if alone else None
        settled = row.pop("settled_steps_per_s")
        row["settled_utilization"] = settled / alone if alone and settled else None
    return out


def verdicts(table: dict[str, dict]) -> dict:
    """The issue's two targets at one rate, from ``rows``:

    * utilization: the auto-chosen settings' utilization (``settled_utilization``: the window from the round end that
      adopted the last decision to the last round end; the whole run's when there is none) >= ``UTILIZATION_SHARE``
      x the best utilization of the grid rows, each on its own settled window too (from its first round end to its
      last: its cold first sync left out as auto's are; the whole run's when it has none). The whole runs'
      (auto's warm-up rounds and earlier decisions included) are reported beside;
    * loss: the reference is the lowest validation loss among the grid rows at least as busy as the auto-chosen
      settings (settled utilization >= theirs; none: the grid row of the highest); met when auto's loss <=
      reference x (1 + ``LOSS_TOLERANCE``).

    ``met`` is None when a figure is missing (no grid row, no auto row, no sites_alone row)."""
    grid = {name: row for name, row in table.items() if row["kind"] == "grid" and row["utilization"] is not None}
    auto = table.get(AUTO)
    if not grid or auto is None or auto["utilization"] is None:
        return {"utilization": {"met": None}, "loss": {"met": None}}

    def util(row: dict) -> float:
        return row.get("settled_utilization") or row["utilization"]

    best = max(grid, key=lambda n: (util(grid[n]), n))
    chosen = util(auto)
    share = chosen / util(grid[best])
    busy = {n: r for n, r in grid.items() if util(r) >= chosen and r["val_loss"] is not None}
    pool = busy or {best: grid[best]}
    reference = min(pool, key=lambda n: (pool[n]["val_loss"] if pool[n]["val_loss"] is not None else float("inf"), n))
    ref_loss, auto_loss = pool[reference]["val_loss"], auto["val_loss"]
    loss_met = None if ref_loss is None or auto_loss is None else auto_loss <= ref_loss * (1 + LOSS_TOLERANCE)
    return {"utilization": {"best_row": best, "best": util(grid[best]), "auto": chosen,
                            "auto_whole_run": auto["utilization"], "share": share, "met": share >= UTILIZATION_SHARE},
            "loss": {"reference_row": reference, "reference": ref_loss, "auto": auto_loss,
                     "rows_at_least_as_busy": sorted(busy), "met": loss_met}}


def rate_change(records: list[dict]) -> dict:
    """The rate change's verdict from every rank's ``{"row": "rate_change", "change_step", "rounds_at_change",
    "decisions": [[step, rounds_ended, H, bandwidth_bps], ...]}`` (each decision the rank adopted, in order): the
    change is made right after a round end, so the round after it is the first whose sync runs at the new rate;
    ``rounds_late`` counts the round ends from the change to the re-plan (1: that round's end). Met when every rank
    re-planned at the same round end, 1 round late, on a measured rate that moved by more than ``REPLAN_FACTOR``
    (a re-plan for another reason, a capped decision's, does not show the change was seen)."""
    ranks = [r for r in records if r["row"] == "rate_change"]
    if not ranks or ranks[0]["change_step"] is None:
        return {"met": None, "why": "no rate change: the run ended before a round end from --change-after on"}
    at = ranks[0]["rounds_at_change"]
    replans = []
    for r in ranks:
        after = [d for d in r["decisions"] if d[1] > r["rounds_at_change"]]
        replans.append(None if not after else after[0][1])
    if all(p is None for p in replans) and all(r.get("rounds_at_end") == r["rounds_at_change"] for r in ranks):
        return {"met": None, "change_step": ranks[0]["change_step"],
                "why": "the run ended before a round end after the change (more steps: --change-steps)"}
    same = len(set(replans)) == 1 and replans[0] is not None
    late = replans[0] - at if same else None
    before = [d for d in ranks[0]["decisions"] if d[1] <= at]
    after = [d for d in ranks[0]["decisions"] if d[1] > at]
    return {"change_step": ranks[0]["change_step"], "round_at_change": at, "replan_round": replans,
            "rounds_late": late, "every_rank_alike": same,
            "h_before": before[-1][2] if before else None, "h_after": after[0][2] if after else None,
            "bandwidth_before_bps": before[-1][3] if before else None,
            "bandwidth_after_bps": after[0][3] if after else None,
            "met": same and late == 1 and bool(before) and after[0][3] * REPLAN_FACTOR < before[-1][3]}


def print_tables(results: dict) -> None:
    """The rows of every rate side by side with their verdicts, then the rate change."""
    for rate, part in results["rates"].items():
        print(f"\n== {rate} ==")
        print(f"{'row':<14}{'H':>12}{'util':>8}{'steps/s':>9}{'val loss':>10}{'WAN MB':>9}{'B/step':>11}")
        for name, row in part["rows"].items():
            h = "/".join(str(p[0]) for p in row["plans"][:6]) if row["kind"] == AUTO else str(row["h"] or "-")
            loss = f"{row['val_loss']:.4f}" if row["val_loss"] is not None else "-"
            print(f"{name:<14}{h:>12}{100 * row['utilization']:>7.1f}%{row['steps_per_s']:>9.2f}{loss:>10}"
                  f"{row['wan_bytes'] / 1e6:>9.2f}{row['wan_bytes_per_step']:>11.0f}")
        v = part["verdicts"]
        if v["utilization"]["met"] is not None:
            u = v["utilization"]
            print(f"utilization: auto's chosen settings {100 * u['auto']:.1f}% (whole run, warm-up included: "
                  f"{100 * u['auto_whole_run']:.1f}%) = {100 * u['share']:.1f}% of the grid's best ({u['best_row']})"
                  f" -> {'met' if u['met'] else 'NOT met'} (>= {100 * UTILIZATION_SHARE:.0f}%)")
        if v["loss"]["met"] is not None:
            print(f"loss: auto {v['loss']['auto']:.4f} vs {v['loss']['reference']:.4f} ({v['loss']['reference_row']}"
                  f", the best grid row at least as busy) -> {'met' if v['loss']['met'] else 'NOT met'}")
    change = results.get("rate_change")
    if change and change.get("met") is not None:
        print(f"\nrate change after step {change['change_step']} (round {change['round_at_change']}): re-planned at "
              f"round end {change['replan_round']} ({change['rounds_late']} round(s) later), H {change['h_before']} "
              f"-> {change['h_after']} -> {'met' if change['met'] else 'NOT met'} (target: 1 round)")
    elif change:
        print(f"\nrate change: not judged ({change.get('why', change)})")
