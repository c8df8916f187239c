"""Launch one command as the ranks of several lab sites, each rank's output captured, for fault tests.

Unlike ``multidc lab run`` (equal sites, output to the terminal), sites may have different sizes (``[2, 1]``:
site 0's second rank is off the WAN rail) and every rank's stdout / stderr go to files that the test reads
while the job runs (JSON event lines, see ``train_job.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from multidc.hierarchical.tools.lab import SITE_IFACE, Lab
from multidc.hierarchical.tools.launch import free_port


@dataclass
class Rank:
    rank: int
    site: int
    proc: subprocess.Popen
    out: Path
    err: Path
    exit_time: float | None = None

    def events(self) -> list[dict]:
        lines = self.out.read_text(errors="replace").splitlines() if self.out.exists() else []
        return [json.loads(line) for line in lines if line.startswith("{")]

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""


@dataclass
class LabJob:
    """``argv`` run by ``sum(site_sizes)`` ranks; rank ``r`` of site ``s`` inside ``lab``'s namespace ``s``.

    Args:
        lab: an entered :class:`Lab` (``None``: loopback, no namespaces).
        argv: the command each rank runs.
        site_sizes: ranks per site, in rank order (site 0's ranks first).
        logdir: where ``rank<r>.out`` / ``rank<r>.err`` go.
        env: extra environment for every rank.
    """

    lab: Lab | None
    argv: list[str]
    site_sizes: list[int]
    logdir: Path
    env: dict = field(default_factory=dict)
    ranks: list[Rank] = field(default_factory=list)

    def __enter__(self) -> LabJob:
        self.logdir.mkdir(parents=True, exist_ok=True)
        port, world = str(free_port()), sum(self.site_sizes)
        sites = [s for s, size in enumerate(self.site_sizes) for _ in range(size)]
        for rank, site in enumerate(sites):
            env = os.environ | {
                "MASTER_ADDR": self.lab.site_ip(0) if self.lab else "127.0.0.1", "MASTER_PORT": port,
                "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(sites[:rank].count(site)),
                "LOCAL_WORLD_SIZE": str(self.site_sizes[site]), "MULTIDC_SITE": str(site),
                "GLOO_SOCKET_IFNAME": SITE_IFACE if self.lab else "lo", "OMP_NUM_THREADS": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1",
            } | self.env
            out, err = self.logdir / f"rank{rank}.out", self.logdir / f"rank{rank}.err"
            argv = self.lab.wrap(site, self.argv) if self.lab else self.argv
            with open(out, "wb") as fout, open(err, "wb") as ferr:
                proc = subprocess.Popen(argv, env=env, stdout=fout, stderr=ferr)
            self.ranks.append(Rank(rank, site, proc, out, err))
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.kill()
        for r in self.ranks:
            r.proc.wait()

    def poll(self) -> None:
        now = time.monotonic()
        for r in self.ranks:
            if r.exit_time is None and r.proc.poll() is not None:
                r.exit_time = now

    def wait_event(self, rank: int, predicate, timeout: float) -> dict:
        """The first event of ``rank`` for which ``predicate(event)`` holds; TimeoutError if none in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            for event in self.ranks[rank].events():
                if predicate(event):
                    return event
            if self.ranks[rank].exit_time is not None:
                break
            time.sleep(0.02)
        raise TimeoutError(f"rank {rank}: no matching event within {timeout}s; {self.describe()}")

    def wait(self, timeout: float) -> list[int | None]:
        """Wait up to ``timeout`` s for every rank to exit; exit codes (``None``: still running, then killed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(r.exit_time is None for r in self.ranks):
            self.poll()
            time.sleep(0.02)
        codes = [r.proc.returncode if r.exit_time is not None else None for r in self.ranks]
        self.kill()
        return codes

    def describe(self) -> str:
        parts = []
        for r in self.ranks:
            tail = r.stderr()[-1500:]
            parts.append(f"\n--- rank {r.rank} (site {r.site}) exit {r.proc.poll()}\n{tail}")
        return "".join(parts)


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
