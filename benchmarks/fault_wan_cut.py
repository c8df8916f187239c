"""Fault script: cut the lab WAN link in the middle of a DDP job, again and again, and measure how it fails.

Needs root (network namespaces; see ``multidc.hierarchical.tools.lab``). Each repetition runs
``benchmarks/fault_jobs/train_job`` (DDP + ``register_ddp_hook``, a checkpoint every ``--every`` steps) as 2 sites
and cuts site 1's link:

* ``train``  sites [2, 2]; cut after a random step between two checkpoints. Every rank must fail within
  ``--timeout-s`` + ``--margin-s`` of the cut with an error naming the sites and the link, exit non-zero; then the
  link is restored, the same command is started again and must resume from the last commit with the losses of an
  unbroken run (computed in one process).
* ``offrail`` sites [2, 1]; the failed ranks stay alive (``--linger-s``), so rank 1, which never crosses the WAN,
  must give up on its intra-site wait by itself.
* ``save``   sites [2, 2]; cut when a checkpoint save starts (state padded with ``--ckpt-mb`` so it takes a while):
  the checkpoint's own collectives cross the WAN and must fail with a ``WanError`` naming the sites too
  (``Checkpointer(topology=...)``), within the Checkpointer's ``timeout_s`` (the job sets it to ``--timeout-s``).

Prints one line per repetition, a summary (time to fail after the cut per scenario: median and max over ranks and
repetitions, next to the budget) and a JSON line; exits 1 if any rank failed late, hung, exited zero, gave an
error that does not name the sites, or a resume lost a committed step or diverged. Usage::

    python benchmarks/fault_wan_cut.py [--repeats 3] [--scenarios train,offrail,save] [--timeout-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.fault_jobs.lab_job import LabJob, python_argv  # noqa: E402
from benchmarks.fault_jobs.train_job import reference_losses  # noqa: E402
from multidc.hierarchical.tools.lab import Lab, lab_available  # noqa: E402

LAYOUTS = {"train": [2, 2], "offrail": [2, 1], "save": [2, 2]}


def _argv(args, ckpt: Path, *extra: str) -> list[str]:
    return python_argv("benchmarks.fault_jobs.train_job", "--ckpt", str(ckpt), "--timeout-s", f"{args.timeout_s:g}",
                       "--steps", str(args.steps), "--every", str(args.every), *extra)


def _failures(job: LabJob, cut_wall: float) -> list[dict]:
    out = []
    for rank in job.ranks:
        failed = [e for e in rank.events() if e["event"] == "failed"]
        out.append({"rank": rank.rank, "after_cut_s": round(failed[-1]["t"] - cut_wall, 2) if failed else None,
                    "message": failed[-1]["message"] if failed else rank.stderr()[-300:]})
    return out


def _one(args, lab: Lab, scenario: str, rep: int, rng: random.Random, tmp: Path) -> dict:
    sizes, ckpt = LAYOUTS[scenario], tmp / f"{scenario}-{rep}" / "ckpt"
    extra = ["--linger-s", "60"] if scenario == "offrail" else ["--ckpt-mb", str(args.ckpt_mb)] if scenario == "save" \
        else []
    if scenario == "save":
        at = rng.choice(range(2 * args.every, args.steps - args.every + 1, args.every))
        wanted = lambda e: e["event"] == "saving" and e["step"] == at  # noqa: E731
    else:
        at = rng.choice([s for s in range(args.every + 1, args.steps - args.every) if s % args.every])
        wanted = lambda e: e["event"] == "step" and e["step"] == at  # noqa: E731
    record = {"scenario": scenario, "rep": rep, "cut_at_step": at, "sites": sizes}
    with LabJob(lab, _argv(args, ckpt, *extra), sizes, tmp / f"{scenario}-{rep}" / "cut") as job:
        job.wait_event(0, wanted, timeout=120)
        lab.set_link(1, up=False)
        cut, cut_wall = time.monotonic(), time.time()
        if scenario == "offrail":  # the ranks linger: wait for their reports, not their exits
            deadline = time.monotonic() + args.timeout_s + args.margin_s + 30
            while time.monotonic() < deadline and any(f["after_cut_s"] is None for f in _failures(job, cut_wall)):
                time.sleep(0.05)
            codes = [None] * len(job.ranks)
        else:
            codes = job.wait(args.timeout_s + args.margin_s + 30)
        record["exit_codes"] = codes
        record["exit_after_cut_s"] = [None if r.exit_time is None else round(r.exit_time - cut, 2) for r in job.ranks]
        record["failures"] = _failures(job, cut_wall)
        committed = [e["step"] for e in job.ranks[0].events() if e["event"] == "committed"]
        before = {e["step"]: e["loss"] for e in job.ranks[0].events() if e["event"] == "step"}
    lab.set_link(1, up=True)
    record["last_commit"] = committed[-1] if committed else None
    if scenario != "offrail":
        record.update(_resume(args, lab, ckpt, sizes, tmp / f"{scenario}-{rep}" / "resume", committed, before))
    return record


def _resume(args, lab, ckpt, sizes, logdir, committed, before) -> dict:
    with LabJob(lab, _argv(args, ckpt), sizes, logdir) as job:
        codes = job.wait(120)
        resumed = {next((e["step"] for e in r.events() if e["event"] == "resumed"), None) for r in job.ranks}
        after = {e["step"]: e["loss"] for e in job.ranks[0].events() if e["event"] == "step"}
    reference = reference_losses(sum(sizes), args.steps)
    losses = {**before, **after}
    worst = max(abs(loss - reference[s]) / max(abs(reference[s]), 1e-6) for s, loss in losses.items())
    checks = {"exit_0": codes == [0] * sum(sizes), "from_last_commit": resumed == {committed[-1]},
              "steps_continue": sorted(after) == list(range(committed[-1] + 1, args.steps + 1)),
              "losses_match": worst < 1e-4}
    return {"resume_exit_codes": codes, "resumed_from": sorted(resumed, key=str), "resume_checks": checks,
            "resume_ok": all(checks.values()), "max_rel_loss_error": worst, "resumed_steps": sorted(after)}


def _verdict(args, r: dict) -> list[str]:
    problems, budget = [], args.timeout_s + args.margin_s
    for f in r["failures"]:
        if f["after_cut_s"] is None or f["after_cut_s"] > budget:
            problems.append(f"rank {f['rank']} reported failure at {f['after_cut_s']} s (budget {budget:g} s)")
        elif "between site '0' and site '1'" not in f["message"]:
            problems.append(f"rank {f['rank']} error does not name the sites: {f['message'][:160]}")
    if r["scenario"] != "offrail":
        late = [t for t in r["exit_after_cut_s"] if t is None or t > budget]
        if late or any(c in (0, None) for c in r["exit_codes"]):
            problems.append(f"exit codes {r['exit_codes']} at {r['exit_after_cut_s']} s after the cut")
        if not r["resume_ok"]:
            failed = [name for name, ok in r["resume_checks"].items() if not ok]
            problems.append(f"resume failed {failed}: exit {r['resume_exit_codes']}, from {r['resumed_from']}, "
                            f"steps {r['resumed_steps'][:3]}..., loss error {r['max_rel_loss_error']:.2g}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default="train,offrail,save", help="any of train,offrail,save")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="WanConfig.timeout_s of the job")
    parser.add_argument("--margin-s", type=float, default=8.0, help="allowed on top of --timeout-s")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--ckpt-mb", type=float, default=64.0, help="state padding for the 'save' scenario")
    parser.add_argument("--rate", default="200mbit", help="lab WAN rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    scenarios = args.scenarios.split(",")
    if set(scenarios) - set(LAYOUTS) or args.repeats < 1:
        parser.error(f"--scenarios takes {sorted(LAYOUTS)}; --repeats must be >= 1")
    reason = lab_available()
    if reason:  # not a pass: nothing was measured
        print(f"fault_wan_cut: cannot run, {reason}. Run it as root on Linux (network namespaces).",
              file=sys.stderr)
        return 2
    rng, records = random.Random(args.seed), []
    with tempfile.TemporaryDirectory(prefix="mdc-wancut-") as tmp, Lab(2, args.rate) as lab:
        for scenario in scenarios:
            for rep in range(args.repeats):
                r = _one(args, lab, scenario, rep, rng, Path(tmp))
                r["problems"] = _verdict(args, r)
                records.append(r)
                fails = [f["after_cut_s"] for f in r["failures"]]
                print(f"{scenario:<8} rep {rep}: cut at step {r['cut_at_step']:>2}, fail after {fails} s, exit "
                      f"{r['exit_codes']}, resume {r.get('resume_ok', '-')}: {'; '.join(r['problems']) or 'ok'}",
                      flush=True)
                print(f"    rank 0: {r['failures'][0]['message'][:300]}", flush=True)
    print(f"\n{'scenario':<9}{'reps':>5}{'median s':>10}{'max s':>8}{'budget s':>10}{'problems':>10}")
    for scenario in scenarios:
        rs = [r for r in records if r["scenario"] == scenario]
        times = [f["after_cut_s"] for r in rs for f in r["failures"] if f["after_cut_s"] is not None]
        print(f"{scenario:<9}{len(rs):>5}{statistics.median(times) if times else float('nan'):>10.2f}"
              f"{max(times) if times else float('nan'):>8.2f}{args.timeout_s + args.margin_s:>10g}"
              f"{sum(len(r['problems']) for r in rs):>10}")
    line = json.dumps({"benchmark": "fault_wan_cut", "timeout_s": args.timeout_s, "records": records})
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 1 if any(r["problems"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
