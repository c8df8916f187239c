"""Fault script for elastic sites: kill whole sites, cut their WAN links and restart the lighthouse, at random,
while a small GPT trains, and measure what the surviving sites and the returning ones do.

Needs root (network namespaces; see ``multidc.hierarchical.tools.lab``) and torchft (``multidc[elastic]``).
``--sites`` sites x ``--ranks-per-site`` ranks, each site its own ``torchrun`` inside its namespace
(``benchmarks/fault_jobs/elastic_gpt.py``: DDP inside the site, ``ElasticSite`` across), the lighthouse
(``multidc lighthouse``) on the lab WAN's bridge. Every ``--gap-s`` seconds (random in the range) one fault:

* ``kill``: SIGKILL every process of one site; it is started again, with the same command, 10-30 s later;
* ``cut``: its WAN link goes down (peers and lighthouse unreachable) and comes back 10-30 s later; the site's
  processes keep running and must rejoin by themselves;
* ``lighthouse``: the lighthouse stops and starts again on the same address after ``--lighthouse-down-s``.

At most one site is down at a time. First an unbroken run of the same job gives the reference loss. Reports the
faults injected, steps lost or committed twice (each site's committed steps must be unique and increasing, and
every site that committed a step must have seen the same sites in it: no split quorum), the longest stall of the
sites that were up after a site fault (the largest gap between their committed steps; target <= ``timeout_s`` +
5 s; the stalls spanning a lighthouse restart, when no quorum can form, are reported apart), the time from a
site's return to its first step with the job, the final validation loss next to the unbroken run's, and the
replicas that diverged (every rank's parameter hash must match). Exits 1 when a target is missed. Usage::

    python benchmarks/fault_elastic.py [--faults 20] [--steps 200] [--json bench-results/fault_elastic.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from multidc.hierarchical.tools.lab import SITE_IFACE, Lab, lab_available  # noqa: E402
from multidc.hierarchical.tools.launch import free_port  # noqa: E402
from multidc.hierarchical.tools.processes import ProcessTree  # noqa: E402

KINDS = ("kill", "cut", "lighthouse")


class ElasticLabJob:
    """The lighthouse and the sites of one elastic job in ``lab``; every process is killed on exit."""

    def __init__(self, lab: Lab, args: argparse.Namespace, out: Path) -> None:
        self.lab, self.args, self.out = lab, args, out
        self.address = f"{lab.hub_ip}:{free_port()}"
        self.sites: dict[int, ProcessTree] = {}
        self.lighthouse: ProcessTree | None = None
        out.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> ElasticLabJob:
        self.start_lighthouse()
        for site in range(self.args.sites):
            self.start_site(site)
        return self

    def __exit__(self, *exc) -> None:
        for tree in [*self.sites.values(), self.lighthouse]:
            if tree is not None:
                tree.kill()

    def start_lighthouse(self) -> None:
        argv = [sys.executable, "-m", "multidc.hierarchical.tools.cli", "lighthouse", "--bind", self.address,
                "--heartbeat-timeout-ms", "2000", "--min-sites", str(self.args.min_sites),
                # above a step (timeout_s + compute + sleep): a quorum never forms without a live site that is
                # merely behind (it would commit a step that site already committed, with other gradients)
                "--join-timeout-ms", str(int(1000 * (3 * self.args.timeout_s + self.args.sleep + 10)))]
        log = self.out / "lighthouse.log"
        with open(log, "a") as f:
            f.write("--- start\n")
        self.lighthouse = ProcessTree(self.lab.wrap_hub(argv), stdout=open(log, "a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while log.read_text().rsplit("--- start", 1)[1].find("listening on") < 0:
            if self.lighthouse.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop_lighthouse(self) -> None:
        self.lighthouse.kill()

    def start_site(self, site: int) -> None:
        host = self.lab.site_ip(site)
        env = {"MULTIDC_LIGHTHOUSE": self.address, "MULTIDC_ELASTIC_HOST": host, "GLOO_SOCKET_IFNAME": SITE_IFACE,
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        argv = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(self.args.ranks_per_site),
                "--master-addr", host, "--master-port", str(free_port()), "-m", "benchmarks.fault_jobs.elastic_gpt",
                "--site", f"site{site}", "--sites", str(self.args.sites), "--steps", str(self.args.steps),
                "--timeout-s", str(self.args.timeout_s), "--sleep", str(self.args.sleep), "--out", str(self.out),
                "--min-sites", str(self.args.min_sites)]
        log = open(self.out / f"site{site}.log", "a")
        self.sites[site] = ProcessTree(self.lab.wrap(site, argv), env=os.environ | env, stdout=log,
                                       stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return any(tree.process.poll() is None for tree in self.sites.values())

    def events(self, site: int) -> list[dict]:
        path = self.out / f"site{site}.events"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]


def _run(lab: Lab, args: argparse.Namespace, out: Path, faults: int, rng: random.Random) -> dict:
    """One job; ``faults`` random faults (0: the unbroken reference). Returns the measurements."""
    injected, returns, outages, lighthouse_down, gave_up, stacks_dumped = [], [], [], [], [], set()
    deadline = time.monotonic() + args.max_run_s
    shutil.rmtree(out, ignore_errors=True)  # events of an earlier run in the same --out would count as this one's
    with ElasticLabJob(lab, args, out) as job:
        down = None  # (site, kind, back_at)
        next_fault = time.monotonic() + rng.uniform(*args.gap_s)
        while job.running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not finish within {args.max_run_s} s")
            now = time.monotonic()
            if down is not None and now >= down[2]:
                site, kind, _ = down
                if kind == "kill" or job.sites[site].process.poll() is not None:
                    if kind == "cut":  # a cut site that gave up (quorum_timeout_s) is started again too
                        gave_up.append({"site": site, "code": job.sites[site].process.returncode})
                    job.start_site(site)
                if kind == "cut":
                    lab.set_link(site, up=True)
                returns.append({"site": site, "kind": kind, "at": time.time()})
                down = None
            if len(injected) < faults and now >= next_fault:
                progress = max((e["step"] for site in range(args.sites) for e in job.events(site)), default=-1)
                kind = rng.choice(args.kinds)
                returned = returns[-1] if returns else None
                if (progress < 3 or progress >= args.steps - 5 or (kind != "lighthouse" and down is not None)
                        or (injected and progress <= injected[-1]["step"])
                        or (returned and down is None and not any(e["time"] > returned["at"]
                                                                  for e in job.events(returned["site"])))):
                    # not before every site trained, nor too late to matter; one site down at a time; each fault
                    # after the job committed a step since the previous one, and after a returned site's first
                    # step (faults do not pile up into one stall)
                    kind = None
                elif kind == "lighthouse":
                    stopped = time.time()
                    job.stop_lighthouse()
                    time.sleep(args.lighthouse_down_s)
                    job.start_lighthouse()
                    lighthouse_down.append((stopped, time.time()))
                else:
                    site = rng.randrange(args.sites)
                    if kind == "kill":
                        job.sites[site].kill()
                    else:
                        lab.set_link(site, up=False)
                    down = (site, kind, now + rng.uniform(*args.down_s))
                    outages.append({"site": site, "kind": kind, "at": time.time()})
                if kind is not None:
                    injected.append({"kind": kind, "at": time.time(), "step": progress})
                    print(f"  fault {len(injected)}: {kind} at step {progress}", flush=True)
                    next_fault = time.monotonic() + rng.uniform(*args.gap_s)
                else:
                    next_fault = time.monotonic() + 1.0
            _dump_stalled(job, down, stacks_dumped)
            time.sleep(0.1)
        codes = {site: tree.process.returncode for site, tree in job.sites.items()}
        events = {site: job.events(site) for site in range(args.sites)}
    finals = [json.loads(p.read_text()) for p in sorted(out.glob("site*_rank*.json"))]
    return {"injected": injected, "returns": returns, "outages": outages, "codes": codes, "events": events,
            "finals": finals, "lighthouse_down": lighthouse_down, "gave_up": gave_up}


def _measure(run: dict, args: argparse.Namespace) -> dict:
    """Steps lost / duplicated, the longest stall of the sites up, return times, divergence."""
    events, problems = run["events"], []
    final = max((f["final_step"] for f in run["finals"]), default=0)
    for site, log in events.items():
        steps = [e["step"] for e in log]
        if len(steps) != len(set(steps)):
            problems.append(f"site{site} committed a step twice")
        if steps != sorted(steps):
            problems.append(f"site{site} committed steps out of order")
    quorums: dict[int, set] = {}  # every site that committed a step must have seen the same sites in it
    for log in events.values():
        for e in log:
            quorums.setdefault(e["step"], set()).add(tuple(e["sites"]))
    split = sorted(step for step, seen in quorums.items() if len(seen) > 1)
    if split:
        problems.append(f"steps committed by different groups of sites (split quorum): {split[:10]}")
    union = sorted({e["step"] for log in events.values() for e in log})
    lost = [s for s in range(final) if s not in union]
    gaps = []  # (from, to) between a site's consecutive commits, except those spanning its own outage
    for site, log in events.items():
        starts = [o["at"] for o in run["outages"] if o["site"] == site]
        gaps += [(a["time"], b["time"]) for a, b in zip(log, log[1:])
                 if not any(a["time"] - 1 <= start <= b["time"] for start in starts)]
    downs = run["lighthouse_down"]
    stalls = [b - a for a, b in gaps]
    site_stalls = [b - a for a, b in gaps if not any(a <= up and down <= b for down, up in downs)]
    restarts = [max((b - a for a, b in gaps if a <= down and up <= b), default=0.0)  # the longest across each
                for down, up in downs]
    rejoin = []
    for back in run["returns"]:
        firsts = [e["time"] for e in events[back["site"]] if e["time"] > back["at"]]
        rejoin.append(min(firsts) - back["at"] if firsts else float("inf"))
    digests = {f["digest"] for f in run["finals"]}
    return {"final_step": final, "lost": lost, "problems": problems, "longest_stall_s": max(stalls, default=0.0),
            "longest_site_fault_stall_s": max(site_stalls, default=0.0), "lighthouse_stalls_s": restarts,
            "rejoin_s": rejoin, "divergent": len(digests) - 1 if digests else 0,
            "val_loss": sorted(f["val_loss"] for f in run["finals"]), "ranks": len(run["finals"])}


def _dump_stalled(job: ElasticLabJob, down, dumped: set) -> None:
    """A site that is up but committed nothing for 60 s: its ranks' Python stacks (py-spy, when installed) into
    <out>/site<k>.stacks, once per stall, to say where it waits."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return
    for site, tree in job.sites.items():
        events = job.events(site)
        if tree.process.poll() is not None or (down is not None and down[0] == site) or not events:
            continue
        last = events[-1]["time"]
        if time.time() - last < 60 or (site, last) in dumped:
            continue
        dumped.add((site, last))
        pids = subprocess.run(["pgrep", "-f", f"elastic_gpt.*--site site{site} "], capture_output=True,
                              text=True).stdout.split()
        with open(job.out / f"site{site}.stacks", "a") as f:
            f.write(f"--- {time.time():.1f}: no step for {time.time() - last:.0f} s\n")
            for pid in pids:
                f.write(subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True).stdout)
        print(f"  site{site}: no step for {time.time() - last:.0f} s; stacks in {job.out}/site{site}.stacks",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--ranks-per-site", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--min-sites", type=int, help="sites a quorum needs (default: a majority of --sites)")
    parser.add_argument("--sleep", type=float, default=2.0, help="pause per step: paces the run over the faults")
    parser.add_argument("--gap-s", type=float, nargs=2, default=(3.0, 8.0))
    parser.add_argument("--down-s", type=float, nargs=2, default=(10.0, 30.0))
    parser.add_argument("--lighthouse-down-s", type=float, default=2.0)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="faults to draw from (default: all)")
    parser.add_argument("--max-run-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/fault_elastic")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.min_sites = args.min_sites or args.sites // 2 + 1
    reason = lab_available()
    if reason:
        print(f"fault_elastic: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    rng = random.Random(args.seed)
    with Lab(args.sites, args.rate) as lab:
        print(f"unbroken run: {args.sites} sites x {args.ranks_per_site} ranks, {args.steps} steps", flush=True)
        unbroken = _measure(_run(lab, args, out / "unbroken", 0, rng), args)
        print(f"faulty run: {args.faults} faults", flush=True)
        faulty_run = _run(lab, args, out / "faulty", args.faults, rng)
    faulty = _measure(faulty_run, args)
    kinds = {k: sum(f["kind"] == k for f in faulty_run["injected"]) for k in KINDS}
    budget = args.timeout_s + 5.0
    print(f"faults injected          {len(faulty_run['injected'])} ({kinds})")
    print(f"exit codes               {faulty_run['codes']}")
    print(f"steps lost               {len(faulty['lost'])}; problems: {faulty['problems'] or 'none'}")
    print(f"longest stall (sites up) {faulty['longest_site_fault_stall_s']:.1f} s after a site fault (target <= "
          f"timeout_s + 5 = {budget:.0f} s); {faulty['longest_stall_s']:.1f} s counting the lighthouse's restarts "
          f"({args.lighthouse_down_s:.0f} s down + its start: no quorum can form meanwhile)")
    print(f"across each lighthouse restart: {', '.join(f'{g:.1f}' for g in faulty['lighthouse_stalls_s']) or '-'} s")
    print(f"cut sites that gave up   {faulty_run['gave_up'] or 'none'} (restarted with the same command)")
    rejoin = faulty["rejoin_s"]
    print(f"back in the quorum after {', '.join(f'{r:.1f}' for r in rejoin)} s (max {max(rejoin, default=0):.1f})")
    if not faulty["val_loss"] or not unbroken["val_loss"]:
        print(f"fault_elastic: a run did not finish (exit codes {faulty_run['codes']}); logs in {out}", file=sys.stderr)
        return 1
    print(f"validation loss          faulty {faulty['val_loss'][0]:.4f}, unbroken {unbroken['val_loss'][0]:.4f}")
    print(f"divergent replicas       {faulty['divergent']} (of {faulty['ranks']} ranks)")
    ok = (len(faulty_run["injected"]) >= args.faults and not faulty["lost"] and not faulty["problems"]
          and faulty["divergent"] == 0 and faulty["ranks"] == args.sites * args.ranks_per_site
          and all(c == 0 for c in faulty_run["codes"].values()) and faulty["longest_site_fault_stall_s"] <= budget)
    summary = {"faults": faulty_run["injected"], "kinds": kinds, "lost": faulty["lost"],
               "problems": faulty["problems"], "longest_stall_s": faulty["longest_stall_s"], "budget_s": budget,
               "longest_site_fault_stall_s": faulty["longest_site_fault_stall_s"], "min_sites": args.min_sites,
               "gave_up": faulty_run["gave_up"],
               "rejoin_s": rejoin, "val_loss": faulty["val_loss"][0], "unbroken_val_loss": unbroken["val_loss"][0],
               "divergent": faulty["divergent"], "ok": ok}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
