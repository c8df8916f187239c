"""Run a training command as several sites on one machine: ``multidc lab run`` and ``SiteJob``.

Each rank gets the environment ``torchrun`` / ``accelerate launch`` / Lightning read (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) with one
"node" per site, plus ``MULTIDC_SITE`` and ``GLOO_SOCKET_IFNAME``. As root the ranks of site ``i`` run inside the
lab namespace of site ``i`` (see ``lab.Lab``), so every inter-site byte crosses a shaped link; otherwise they
run on loopback, unshaped, and the job says so.

Example::

    multidc lab run --sites 2 --ranks-per-site 2 --wan-rate 400mbit -- python train.py
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack

from multidc.hierarchical.tools.lab import SITE_IFACE, Lab, lab_available, parse_rate

_handed_out: set[int] = set()
_random = random.SystemRandom()  # not the seeded global one: two test workers seeded alike would pick alike


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_band() -> range:
    """Ports no port-0 bind gets: below the ephemeral range (capped at Linux's default start, which a lab
    namespace keeps), else above it."""
    low, high = _ephemeral_range()
    below = range(max(1024, min(low, 32768) - 16384), min(low, 32768))
    return below if len(below) >= 1024 else range(high + 1, 65536)


def free_port() -> int:
    """A TCP port free on loopback now, for a process started next to bind (a rendezvous, a store); the lab
    namespaces have their own, all free, port spaces.

    Taken outside the kernel's ephemeral range, so that no socket bound to port 0 meanwhile (a TCPStore, a gloo
    pair, a torchft manager of another site) can take it before that process binds it; never the same one twice in
    this process. (A port that the kernel gave to a port-0 probe could: that race failed a site's torchrun with
    EADDRINUSE.)

    Raises:
        RuntimeError: no port of that band is free.
    """
    band = _port_band()
    start = _random.randrange(len(band)) if len(band) else 0
    for port in (*band[start:], *band[:start]):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {band.start}-{band.stop - 1} on loopback: free some, or widen "
                       f"the gap below net.ipv4.ip_local_port_range.")


class SiteJob:
    """``argv`` started as ``sites x ranks_per_site`` ranks; a context manager that always cleans up.

    Args:
        argv: the command every rank runs.
        sites: number of sites (>= 1; the lab needs >= 2, one site runs on loopback).
        ranks_per_site: ranks in each site, or one count per site (e.g. ``[3, 1]``: unequal sites; ranks are
            numbered site by site).
        wan_rate: per-direction WAN rate such as ``"400mbit"``, or ``None`` for an unshaped lab link.
        loopback: run on loopback even when the lab is available.
        env: extra environment for every rank.
        lab: run in this lab, already built (e.g. with servers in its namespaces), instead of building one; the job
            leaves it up. Its ``num_sites`` must equal ``sites``; ``wan_rate`` and ``loopback`` do not apply.
    """

    def __init__(self, argv: list[str], *, sites: int, ranks_per_site: int | Sequence[int],
                 wan_rate: str | None = None, loopback: bool = False, env: dict[str, str] | None = None,
                 lab: Lab | None = None) -> None:
        counts = [ranks_per_site] * max(sites, 0) if isinstance(ranks_per_site, int) else list(ranks_per_site)
        if sites < 1 or len(counts) != sites or min(counts) < 1:
            raise ValueError(f"sites={sites} and ranks_per_site={ranks_per_site} must both be at least 1 (a list: one "
                             f"count >= 1 per site, {sites} in all).")
        self._site_of = [site for site, n in enumerate(counts) for _ in range(n)]
        self._counts = counts
        if wan_rate is not None:
            parse_rate(wan_rate)
        self.argv, self.sites, self.ranks_per_site = list(argv), sites, ranks_per_site
        self.wan_rate, self.extra_env = wan_rate, dict(env or {})
        if lab is not None and (lab.num_sites != sites or loopback):
            raise ValueError(f"lab= has {lab.num_sites} sites for a job of sites={sites}"
                             f"{' with loopback=True' if loopback else ''}: give a lab of {sites} sites and no "
                             "loopback, or leave lab= out.")
        self.reason = "--loopback was given" if loopback else "one site has no WAN" if sites < 2 else lab_available()
        self._given_lab, self.lab = lab, None
        self.procs: list[subprocess.Popen] = []
        self._stack = ExitStack()

    @property
    def shaped(self) -> bool:
        return self.lab is not None

    def __enter__(self) -> SiteJob:
        try:
            if self._given_lab is not None:
                self.lab = self._given_lab
            elif self.reason is None:
                self.lab = self._stack.enter_context(Lab(self.sites, self.wan_rate))
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self._stack.close()

    def rank_env(self, rank: int) -> dict[str, str]:
        site = self._site_of[rank]
        local = rank - self._site_of.index(site)
        return {
            "MASTER_ADDR": self.lab.site_ip(0) if self.lab else "127.0.0.1", "MASTER_PORT": self._port,
            "WORLD_SIZE": str(len(self._site_of)), "RANK": str(rank),
            "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(self._counts[site]),
            "NODE_RANK": str(site), "GROUP_RANK": str(site), "MULTIDC_SITE": str(site),
            "GLOO_SOCKET_IFNAME": SITE_IFACE if self.lab else "lo",
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
        }

    def _start(self) -> None:
        self._port = str(free_port())
        for rank, site in enumerate(self._site_of):
            env = os.environ | self.extra_env | self.rank_env(rank)
            argv = self.lab.wrap(site, self.argv) if self.lab else self.argv
            self.procs.append(subprocess.Popen(argv, env=env))

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """Wait for every rank; return their exit codes. On the first failure the other ranks get
        ``timeout_s`` (default 30 s) to exit on their own (a WAN error reaches them all), then are killed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.procs):
            if any(p.returncode not in (None, 0) for p in self.procs):
                grace = time.monotonic() + 30
                deadline = grace if deadline is None else min(deadline, grace)
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return [p.returncode for p in self.procs]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", type=int, default=2, help="number of sites (default 2)")
    parser.add_argument("--ranks-per-site", type=int, default=2, help="ranks in each site (default 2)")
    parser.add_argument("--wan-rate", default="400mbit", help="per-direction WAN rate (default 400mbit)")
    parser.add_argument("--loopback", action="store_true", help="skip the lab WAN even as root")
    parser.add_argument("--timeout-s", type=float, default=None, help="kill the job after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("give the command to run after --, e.g. `multidc lab run -- python train.py`.")
    with SiteJob(command, sites=args.sites, ranks_per_site=args.ranks_per_site, wan_rate=args.wan_rate,
                 loopback=args.loopback) as job:
        where = (f"lab WAN, {args.wan_rate} per direction between {args.sites} network namespaces"
                 if job.shaped else f"loopback WITHOUT bandwidth shaping ({job.reason})")
        print(f"[multidc lab] {args.sites} sites x {args.ranks_per_site} ranks on {where}", flush=True)
        codes = job.wait(args.timeout_s)
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    if failed:
        print(f"[multidc lab] ranks failed with exit codes {failed}", file=sys.stderr)
        return 1
    return 0
