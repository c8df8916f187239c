"""Elastic jobs for the tests: a torchft lighthouse in this process, one ``torchrun`` (or ``accelerate launch``) per
site as a ``ProcessTree``, and the runs and checks that several test modules share (a site killed and restarted, a
site that differs, a second member of a live site)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from multidc.hierarchical.elastic import start_lighthouse
from multidc.hierarchical.elastic.lighthouse import heard_replicas
from multidc.hierarchical.tools.launch import free_port
from multidc.hierarchical.tools.processes import ProcessTree

ROOT = Path(__file__).resolve().parents[1]


SCRIPT = str(ROOT / "tests" / "hierarchical" / "_elastic_script.py")


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


STEPS, KILL_AT, TIMEOUT_S = 30, 8, 240


class Lighthouse:
    """A torchft lighthouse in this process, on a free loopback port; ``restart`` brings it back on the same port."""

    def __init__(self) -> None:
        self.server = self._start(f"127.0.0.1:{free_port()}")  # restart() binds it again: not a port-0 one
        self.address = f"127.0.0.1:{self.server.address().rsplit(':', 1)[1]}"

    @staticmethod
    def _start(bind: str):
        return start_lighthouse(bind, min_sites=1, heartbeat_timeout_ms=2000, join_timeout_ms=1000)

    def restart(self, down_s: float) -> None:
        self.server.shutdown()
        time.sleep(down_s)
        self.server = self._start(self.address)


def start_site(name: str, per_site: int, sites: int, lighthouse: str, out: Path, *extra: str,
               script: str = SCRIPT, lab=None, accelerate: list[str] | None = None,
               env: dict[str, str] | None = None) -> ProcessTree:
    """One site's ``torchrun`` (its own rendezvous) running ``script`` (default: the plain torch.distributed loop);
    with ``lab``, inside site ``name``'s namespace, advertising its WAN address; with ``accelerate`` (the
    ``accelerate launch --config_file ...`` command), that instead of torchrun; ``env``: more variables."""
    skip = ("MULTIDC_", "TORCHFT_", "ACCELERATE_", "RUST_LOG")
    base = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env = base | {"MULTIDC_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | (env or {})
    host = "127.0.0.1"
    if lab is not None:
        host = lab.site_ip(int(name.removeprefix("site")))
        env |= {"MULTIDC_ELASTIC_HOST": host, "GLOO_SOCKET_IFNAME": "wan0"}
    launcher = [TORCHRUN, "--nproc-per-node", str(per_site), "--master-addr", host, "--master-port",
                str(free_port())]
    if accelerate is not None:
        env["HF_HOME"] = str(out / "hf")  # no accelerate config of this machine leaks in
        launcher = [*accelerate, "--num_processes", str(per_site), "--main_process_ip", host, "--main_process_port",
                    str(free_port())]
    argv = [*launcher, script, "--site", name, "--sites", str(sites), "--out", str(out), *extra]
    if script == SCRIPT:
        argv += ["--steps", str(STEPS)] if "--steps" not in extra else []
    if lab is not None:
        argv = lab.wrap(int(name.removeprefix("site")), argv)
    log = open(out / f"{name}.{len(list(out.glob(f'{name}.*.log')))}.log", "w")  # the tree owns it until it ends
    return ProcessTree(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def progress(out: Path, name: str) -> int:
    try:
        return int((out / f"{name}.progress").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def run_with_a_kill(tmp_path: Path, lighthouse: str, sites: int, per_site: int, victim: int, *extra: str,
                     script: str = SCRIPT, kill_at: int = KILL_AT, accelerate: list[str] | None = None,
                     hold: bool = False) -> dict:
    """Start the sites, SIGKILL ``victim`` once it committed ``kill_at`` steps, restart it with the same command
    once the lighthouse dropped it and the others committed a step after that (20 s at most); every site must end
    cleanly. Returns
    each rank's results and whether the others went on meanwhile. ``hold`` (a script with ``--hold-until``): the
    sites wait before their last step until the restarted victim's manager heartbeats to the lighthouse, so the job
    cannot end before it is back, however slowly it starts."""
    names = [f"site{i}" for i in range(sites)]
    if hold:
        extra = (*extra, "--hold-until", str(tmp_path / "victim-back"))
    launch = {"script": script, "accelerate": accelerate}
    trees = {name: start_site(name, per_site, sites, lighthouse, tmp_path, *extra, **launch) for name in names}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_steps(tmp_path, trees, kill_at, deadline, [names[victim]])
        trees[names[victim]].kill()  # every process of the site: torchrun and its ranks
        killed_at = progress(tmp_path, names[victim])
        # down until the lighthouse dropped it (its heartbeat timeout, 2 s) and the others then committed a step (a
        # round), which a quorum without it decided
        while any(r.alive and r.site == names[victim] for r in heard_replicas(lighthouse)):
            assert time.monotonic() < deadline, f"the lighthouse never dropped the killed {names[victim]}"
            time.sleep(0.1)
        before = {n: progress(tmp_path, n) for n in names if n != names[victim]}
        went_on = time.monotonic() + 20
        while not (survivors_went_on := all(progress(tmp_path, n) > before[n] for n in before)):
            if time.monotonic() > went_on:
                break
            time.sleep(0.1)
        (tmp_path / f"{names[victim]}.progress").unlink()
        before_restart = {r.replica_id for r in heard_replicas(lighthouse)}
        trees[names[victim]] = start_site(names[victim], per_site, sites, lighthouse, tmp_path, *extra,
                                     **launch)  # the same command
        if hold:
            while not any(r.alive and r.site == names[victim] and r.replica_id not in before_restart
                          for r in heard_replicas(lighthouse)):
                assert time.monotonic() < deadline, f"{names[victim]} never came back to the lighthouse"
                assert trees[names[victim]].process.poll() is None, site_logs(tmp_path, names[victim])
                time.sleep(0.1)
            (tmp_path / "victim-back").touch()
        finish_all(trees, tmp_path, deadline - time.monotonic())
    finally:
        for tree in trees.values():
            tree.kill()
    ranks = {(name, r): torch.load(tmp_path / f"{name}_rank{r}.pt") for name in names for r in range(per_site)}
    return {"ranks": ranks, "killed_at": killed_at, "survivors_went_on": survivors_went_on, "victim": victim}


def run_alone(out: Path, lighthouse: str, *extra: str, script: str, accelerate: list[str] | None = None) -> dict:
    """One run of site0 alone (one rank) in ``out`` (e.g. resuming from a checkpoint); it must end cleanly.
    Returns its rank's results."""
    out.mkdir()
    tree = start_site("site0", 1, 1, lighthouse, out, *extra, script=script, accelerate=accelerate)
    try:
        code, _ = tree.wait(TIMEOUT_S)
    finally:
        tree.kill()
    assert code == 0, site_logs(out, "site0")
    return torch.load(out / "site0_rank0.pt")


def check_rejoined(run: dict, sites: int, min_final: int) -> tuple[dict, dict]:
    """The checks of a ``run_with_a_kill`` run (``step``: the job's steps, or rounds): the job ended with every
    site at the same step (>= ``min_final``), every rank bitwise identical; each survivor committed every step
    once; some step ran without the victim; the victim rejoined at the job's step and took part in every step
    after. Returns the first rank's and the first survivor's results."""
    ranks, victim = run["ranks"], run["victim"]
    assert run["survivors_went_on"], "the surviving sites stopped while the victim was down"
    first = next(iter(ranks.values()))
    final = first["final_step"]
    for key, rank in ranks.items():
        assert rank["final_step"] == final >= min_final and rank["num_sites"] == sites, key
        for name, value in rank["params"].items():
            assert torch.equal(value, first["params"][name]), (key, name)
    survivors = [rank for (name, _), rank in ranks.items() if name != f"site{victim}"]
    for rank in survivors:  # none lost, none twice
        assert [e["step"] for e in rank["log"]] == list(range(rank["joined_at"], final))
    degraded = [e for e in survivors[0]["log"] if victim not in e["sites"]]
    assert any(e["step"] >= run["killed_at"] for e in degraded), "no step ran without the killed site"
    restarted = ranks[(f"site{victim}", 0)]
    assert restarted["joined_at"] > run["killed_at"]  # it rejoined live, at the job's step, not from step 0
    assert all(victim in e["sites"] for e in restarted["log"])
    return first, survivors[0]


def wait_for_steps(out: Path, trees: dict[str, ProcessTree], steps: int, deadline: float,
                   sites: list[str] | None = None) -> None:
    """Wait until each site of ``sites`` (default: all of ``trees``) committed ``steps`` steps (its
    ``<name>.progress``); fail with the log of any site of ``trees`` that ended meanwhile, or at ``deadline``
    (``time.monotonic()``)."""
    while behind := [name for name in (sites or trees) if progress(out, name) < steps]:
        assert time.monotonic() < deadline, f"{behind} never committed {steps} steps"
        ended = [name for name, tree in trees.items() if tree.process.poll() is not None]
        assert not ended, site_logs(out, ended[0])
        time.sleep(0.05)


def finish_all(trees: dict, out: Path, timeout_s: float = TIMEOUT_S) -> None:
    """Wait for every site's tree to end with exit code 0 (else fail with its log); kill every process after."""
    try:
        deadline = time.monotonic() + timeout_s
        for name, tree in trees.items():
            code, _ = tree.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, f"{name}:\n{site_logs(out, name)}"
    finally:
        for tree in trees.values():
            tree.kill()


def site_logs(out: Path, name: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob(f"{name}.*.log")))


def check_odd_site_fails_alone(tmp_path: Path, lighthouse: str, live: list[str], per_site: int, odd: list[str],
                               messages: list[str], script: str = SCRIPT) -> None:
    """Two sites train (``live`` arguments; the job goes on until the odd site is done: the script's ``--until``); a
    third site with ``odd`` arguments and ``per_site`` ranks must fail alone, its log saying it cannot join and
    ``messages``, while the two go on, then finish (5 steps or rounds later) and end identical."""
    names, end = ["site0", "site1"], tmp_path / "end-at"
    trees = {name: start_site(name, 1, 2, lighthouse, tmp_path, *live, "--until", str(end), script=script)
             for name in names}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_steps(tmp_path, trees, KILL_AT, deadline)
        tree = start_site("site2", per_site, 3, lighthouse, tmp_path, *odd, script=script)
        code, _ = tree.wait(max(1.0, deadline - time.monotonic()))
        assert code != 0
        log = site_logs(tmp_path, "site2")
        assert "site 'site2' cannot join: it differs from site 'site" in log, log
        assert all(message in log for message in messages), log
        assert all(tree.process.poll() is None for tree in trees.values()), "the job ended before the odd site failed"
        (tmp_path / "end-at.tmp").write_text(str(max(progress(tmp_path, n) for n in names) + 5))
        (tmp_path / "end-at.tmp").rename(end)  # every site reads it before that step
        for name, tree in trees.items():  # the live sites went on without it and finished
            code, _ = tree.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, f"{name}:\n{site_logs(tmp_path, name)}"
    finally:
        for tree in trees.values():
            tree.kill()
    ranks = [torch.load(tmp_path / f"{name}_rank0.pt") for name in names]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def first_quorum_beside_an_idle_site(tmp_path: Path, idle: list[str], run: list[str], script: str = SCRIPT) -> dict:
    """site1 (``idle`` arguments) builds its site and then idles before its first step; once it has, site0, a job
    of one site (``run`` arguments), must run to its end with its first quorum formed at once (< 10 s; the
    lighthouse's join timeout is 30 s, its quorum timeout 120 s). Returns site0's results."""
    server = start_lighthouse("127.0.0.1:0", min_sites=1, heartbeat_timeout_ms=5_000, join_timeout_ms=30_000)
    address = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    trees = {"site1": start_site("site1", 1, 2, address, tmp_path, *idle, script=script)}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (tmp_path / "site1.built").exists():
            assert time.monotonic() < deadline and trees["site1"].process.poll() is None, site_logs(tmp_path, "site1")
            time.sleep(0.05)
        time.sleep(2)  # a heartbeat (every 100 ms) would have reached the lighthouse by now
        trees["site0"] = start_site("site0", 1, 1, address, tmp_path, *run, script=script)
        code, _ = trees["site0"].wait(TIMEOUT_S)
        assert code == 0, site_logs(tmp_path, "site0")
    finally:
        for tree in trees.values():
            tree.kill()
        server.shutdown()
    site0 = torch.load(tmp_path / "site0_rank0.pt")
    assert site0["first_quorum_s"] < 10, f"the first quorum waited {site0['first_quorum_s']:.1f} s for site1"
    return site0


def check_second_member_refused(tmp_path: Path, lighthouse: str, live: list[str], script: str = SCRIPT) -> dict:
    """site0 and site1 train (``live``: the script's arguments; the sites hold before their last step until the
    second process is done); a second process of site1 (the same command) must fail, its log naming the site and the
    live member's manager, while both go on and finish as if it had not come: no step discarded, every step
    committed once, no quorum with a site twice, both identical. Returns each site's rank-0 results."""
    names, hold = ["site0", "site1"], tmp_path / "second-done"
    trees = {name: start_site(name, 1, 2, lighthouse, tmp_path, *live, "--hold-until", str(hold), script=script)
             for name in names}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        wait_for_steps(tmp_path, trees, KILL_AT, deadline)
        second = start_site("site1", 1, 2, lighthouse, tmp_path, *live, script=script)
        code, _ = second.wait(max(1.0, deadline - time.monotonic()))
        log = (tmp_path / "site1.1.log").read_text()
        assert code != 0, log[-3000:]
        assert re.search(r"site 'site1' is already in the job: its member site1:\S+ \(its torchft manager at "
                         r"http://\S+:\d+\) still heartbeats", log), log[-3000:]
        assert all(tree.process.poll() is None for tree in trees.values()), "the job ended before the refusal"
        hold.touch()
        finish_all(trees, tmp_path, deadline - time.monotonic())
    finally:
        for tree in trees.values():
            tree.kill()
    ranks = {name: torch.load(tmp_path / f"{name}_rank0.pt") for name in names}
    for name in names:  # torchft at its default level (warnings); multidc's one line per change of the quorum
        log = (tmp_path / f"{name}.0.log").read_text()
        assert "[INFO] [torchft" not in log, log[-3000:]
        changes = [line for line in log.splitlines() if f"site '{name}', step " in line and "the quorum has" in line]
        assert 1 <= len(changes) <= 4 or script != SCRIPT, changes  # once per change, not per step (its INFO log)
    for name, rank in ranks.items():
        assert rank["discarded"] == 0, name
        assert [e["step"] for e in rank["log"]] == list(range(rank["joined_at"], rank["final_step"])), name
        assert not [e for e in rank["log"] if e["twice"]], name  # the quorums never held site1 twice
    for key, value in ranks["site0"]["params"].items():
        assert torch.equal(value, ranks["site1"]["params"][key]), key
    return ranks


def check_diloco_rejoined(run: dict, per_site: int, fragments: int, overlap: int) -> None:
    """The checks of an elastic DiLoCo ``run_with_a_kill`` run of 2 sites (victim site1) by a script that logs
    ``syncs``, ``first_t`` and the ``local`` parameters: ``check_rejoined``, then the global parameters and each
    site's own equal to the one-process replay with the victim healed from site0 at its first inner step."""
    from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY
    from tests.hierarchical.elastic_reference import diloco_reference

    _, survivor = check_rejoined(run, 2, 8)  # the global parameters bitwise identical on every rank
    restarted = run["ranks"][("site1", 0)]
    heals = [{"site": 1, "source": 0, "t0": restarted["first_t"]}]
    expected, local = diloco_reference(survivor["syncs"], per_site, survivor["initial"], sync_every=SYNC_EVERY,
                                       outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, scheduled=True,
                                       fragments=fragments, overlap=overlap, heals=heals, with_local=True)
    for name, value in survivor["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)
    for rank in (survivor, restarted):  # each site's own parameters (streaming: apart between syncs)
        for name, value in rank["local"].items():
            torch.testing.assert_close(value, local[rank["site"]][name], rtol=0, atol=1e-5)
