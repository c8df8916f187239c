"""Region-local checkpoints vs one URL over a lab WAN: 2 sites x 2 ranks, one SeaweedFS per site, in one run.

As root: a ``Lab`` of 2 network namespaces joined by a ``tbf``-shaped link (``--wan-rate``, 100 mbit), one
SeaweedFS S3 server started inside each site's namespace and bound to its address (the site's region), and 4 gloo
ranks (``SiteJob`` in that lab) holding a replicated model of ``--size-mb`` MiB. Each repeat measures:

* ``single URL``: ``Checkpointer(<site 0's store>, topology=...)``: save (the model striped over the 4 replicas,
  so site 1's half crosses the WAN) and load (site 1 reads all of it across the WAN);
* ``region-local``: ``Checkpointer({site: <that site's store>}, topology=...)``: save (striped over each site's
  own ranks, stored once per region) and load (each site from its own region);
* the bounds per region, as ``bench_checkpoint.py`` measures them, for both regions at once: ``raw PUT`` (every
  rank PUTs its share of the model, ``size / ranks per site``, to its own region's store) and the ``GET + exchange``
  floor (every rank GETs its share of the shard it saved and sends it to the other rank of its site, one after the
  other or overlapped: the faster of the two).

Seconds are per site (from a common start to the last of the site's ranks returning). WAN bytes are measured, not
estimated: each site's ``wan0`` interface counters (``/sys/class/net/wan0/statistics``, headers included) before and
after the operation, read inside the site's namespace; the barriers around the operation are counted too (a few
KiB). A load's "checkpoint bytes from other regions" is what the library itself reports (``regional.log_crossing``).
Also per operation: botocore's own retries of S3 requests (each resends the request, e.g. a whole part) and the
TCP segments the site's namespace retransmitted, which is where WAN bytes beyond the data come from.
A region-local operation and its bound take turns going first (``--repeats`` even), each on a settled server.

Prints median and spread (min-max) per figure, PASS / FAIL per target (``checkpoint_regions_report.TARGETS``), a
JSON line, and with ``--plot`` a PNG. Exit status 1 when a target fails. Usage::

    sudo python benchmarks/bench_checkpoint_regions.py [--size-mb 256] [--repeats 4] [--plot out.png]
    sudo python benchmarks/bench_checkpoint_regions.py --size-mb 8 --repeats 2 --allow-small    # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_checkpoint as _flat  # noqa: E402  (after the path fix)
from benchmarks.checkpoint_regions_report import plot, report  # noqa: E402

SITES, RANKS_PER_SITE = 2, 2
KEYS = ("BENCHKEY", "bench-secret-not-printed")
MIN_STATE_BYTES = _flat.MIN_STATE_BYTES
SETTLE_S = _flat.SETTLE_S
_CROSSING = "site %r: this load reads"  # the library's line: bytes a site's load reads from other regions


def _tcp_retransmits() -> int:
    """TCP segments this namespace has retransmitted (``/proc/net/snmp``, per network namespace)."""
    with open("/proc/net/snmp") as f:
        names, values = [line.split() for line in f if line.startswith("Tcp:")][:2]
    return int(values[names.index("RetransSegs")])


def _wan_counters() -> tuple[int, int]:
    """(tx, rx) bytes of this namespace's WAN interface (the lab's ``wan0``)."""
    from multidc.hierarchical.tools.lab import SITE_IFACE

    def read(name: str) -> int:
        with open(f"/sys/class/net/{SITE_IFACE}/statistics/{name}") as f:
            return int(f.read())

    return read("tx_bytes"), read("rx_bytes")


class _Crossing:
    """A logging handler keeping the bytes the library says this site's last load read from other regions."""

    def __init__(self):
        import logging

        self.bytes, handler = None, logging.Handler()
        handler.emit = self._emit
        logger = logging.getLogger("multidc.plugins.checkpoint")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)  # a load that read nothing from other regions says so at INFO

    def _emit(self, record) -> None:
        if record.msg.startswith(_CROSSING):
            self.bytes = int(record.args[1]) if len(record.args) > 1 else 0


class _Retries:
    """A logging handler counting botocore's own retries of S3 requests ("Retry needed"), which resend a request
    (a whole part) without the library's ``RetryPolicy`` seeing them: what WAN bytes beyond the data come from."""

    def __init__(self):
        import logging

        self.count, handler = 0, logging.Handler()
        handler.emit = self._emit
        for name in ("botocore.retryhandler", "botocore.retries.standard"):
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.DEBUG)

    def _emit(self, record) -> None:
        self.count += str(record.msg).startswith("Retry needed")


class _Runner:
    """One rank's measurements: ``run(name, fn)`` times ``fn`` per site and reads the WAN counters around it."""

    def __init__(self, topo):
        import torch.distributed as dist

        self.topo, self.rank, self.dist = topo, dist.get_rank(), dist
        self.crossing, self.retries = _Crossing(), _Retries()
        self.records: list[dict] = []  # rank 0: every rank's record of every run

    def run(self, name: str, fn, rep: int):
        dist = self.dist
        if self.rank == 0:
            os.sync()  # what earlier steps wrote is on disk: no measurement pays for another's writeback
        dist.barrier()
        time.sleep(SETTLE_S)
        first = self.topo.local_rank_in_site == 0
        before = (*_wan_counters(), _tcp_retransmits()) if first else None
        self.crossing.bytes, retries = None, self.retries.count
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        dist.barrier()
        after = (*_wan_counters(), _tcp_retransmits()) if first else None
        delta = [a - b for a, b in zip(after, before)] if first else [None] * 3
        mine = {"name": name, "rep": rep, "site": self.topo.site, "rank": self.rank, "seconds": seconds,
                "wan_tx": delta[0], "wan_rx": delta[1], "tcp_retrans": delta[2],
                "http_retries": self.retries.count - retries, "remote_read": self.crossing.bytes}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if rep > 0:
            self.records += every if self.rank == 0 else []
        return out


def _worker(config_path: str) -> None:
    import torch
    import torch.distributed as dist

    from multidc.hierarchical import Topology
    from multidc.plugins import Checkpointer, ObjectStore
    from multidc.plugins.checkpoint.format import checkpoint_name, shard_file
    from multidc.plugins.checkpoint.reader import ReadConfig
    from multidc.plugins.checkpoint.storage import byte_view

    with open(config_path) as f:
        cfg = json.load(f)
    dist.init_process_group("gloo")
    topo = Topology.build()
    rank, names = dist.get_rank(), list(topo.layout.site_names)
    site_groups = [dist.new_group(list(ranks), backend="gloo") for ranks in topo.layout.site_ranks]
    group, local = site_groups[topo.site], topo.local_rank_in_site
    urls = dict(zip(names, cfg["urls"]))
    options = dict(zip(names, cfg["options"]))
    mine = names[topo.site]
    sizes = {"part_size_mb": cfg["part_size_mb"], "max_concurrency": cfg["concurrency"]}
    single = Checkpointer(urls[names[0]] + "/single", storage_options=options[names[0]], topology=topo, **sizes)
    regional = Checkpointer({s: u + "/regional" for s, u in urls.items()}, storage_options=options, topology=topo,
                            **sizes)
    store = ObjectStore(urls[mine], storage_options=options[mine], **sizes)  # this site's region
    model = _flat._model(cfg["size_mb"])
    state = model.state_dict()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    raw = byte_view(torch.randint(0, 256, (state_bytes // topo.site_size,), dtype=torch.uint8))
    runner, pieces, conc = _Runner(topo), ReadConfig().piece_bytes, cfg["concurrency"]

    def load(ckpt, name: str, rep: int) -> None:
        """``ckpt.load`` timed into zeroed tensors allocated (resident) beforehand, then checked."""
        target = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
        runner.run(name, lambda: ckpt.load(target), rep)
        if not all(torch.equal(target["model"][k], v) for k, v in state.items()):
            raise AssertionError(f"rank {rank}: the model {name} loaded differs from the saved one")

    for rep in range(-1, cfg["repeats"]):  # rep -1 warms up connections, buckets and code paths; not recorded
        dist.barrier()
        if local == 0:
            for sub in ("single", "regional", "raw"):
                store.delete_tree(sub)
        rep += 1
        step = {"model": state}
        runner.run("single URL save", functools.partial(single.save, step, step=rep), rep)
        load(single, "single URL load", rep)
        put = ("raw PUT (bound)", functools.partial(store.put, f"raw/{rep}/rank{rank}", raw))
        saves = [put, ("region-local save", functools.partial(regional.save, step, step=rep))]
        for name, fn in _flat._in_turn(saves, rep):
            runner.run(name, fn, rep)
        shard = f"regional/{checkpoint_name(rep)}/{shard_file(rank)}"
        lengths = [None] * topo.site_size
        dist.all_gather_object(lengths, store.size(shard), group=group)
        parts = [torch.zeros(max(lengths), dtype=torch.uint8) for _ in range(topo.site_size)]
        floor_args = (store, shard, parts, local, pieces, conc, group)
        floors = [("raw GET, then exchange", functools.partial(_flat._raw_get_and_exchange, *floor_args)),
                  ("raw GET, exchange overlapped", functools.partial(_flat._raw_get_pipelined, *floor_args))]
        for name, fn in _flat._in_turn([*floors, ("region-local load", None)], rep):
            load(regional, name, rep) if fn is None else runner.run(name, fn, rep)
        parts = floor_args = floors = None  # free the receive buffers before the next repeat
    single.close()
    regional.close()
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"records": runner.records, "state_bytes": state_bytes, "sites": names}, f)
    dist.destroy_process_group()


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    from multidc.hierarchical.tools.lab import lab_available, parse_rate

    reason = lab_available()
    if reason:
        parser.error(f"this benchmark runs in the lab WAN, and {reason}: run it as root on Linux with iproute2.")
    try:
        parse_rate(args.wan_rate)
    except ValueError as exc:
        parser.error(f"--wan-rate: {exc}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be at least 1 (even: each region-local operation and its "
                     "bound go first equally often).")
    state = _flat.state_bytes_for(args.size_mb)
    if state < MIN_STATE_BYTES and not args.allow_small:
        parser.error(f"--size-mb {args.size_mb:g} gives {state / 1e6:.0f} MB of model state; the targets are for "
                     f"at least {MIN_STATE_BYTES / 1e6:.0f} MB. Use --size-mb 200 or more, or pass --allow-small for "
                     "a smoke run whose PASS/FAIL verdicts do not measure the targets.")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=256, help="model state per replica, MiB (>= 200)")
    parser.add_argument("--repeats", type=int, default=4, help="even: a bound and what it bounds go first as often")
    parser.add_argument("--wan-rate", default="100mbit", help="per-direction rate of each site's WAN link")
    parser.add_argument("--part-size-mb", type=float, default=16, help="multipart part size, MiB")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel requests per rank")
    parser.add_argument("--allow-small", action="store_true",
                        help="allow a state under 200 MB (a smoke run: the verdicts do not measure the targets)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="kill the ranks after this many seconds")
    parser.add_argument("--json", default=None, help="also write the JSON result to this file")
    parser.add_argument("--plot", default=None, help="also plot seconds and WAN bytes to this PNG")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from multidc.hierarchical.tools.lab import Lab
    from multidc.hierarchical.tools.launch import SiteJob
    from multidc.hierarchical.tools.seaweed import SeaweedS3

    with tempfile.TemporaryDirectory() as tmp, Lab(SITES, args.wan_rate) as lab:
        servers = []
        try:
            for site in range(SITES):
                servers.append(SeaweedS3.start(os.path.join(tmp, f"s3-{site}"), auth=KEYS, ip=lab.site_ip(site),
                                               netns=lab.netns(site)))
            config = {"urls": [s.make_bucket("bench") + "/ckpt" for s in servers],
                      "options": [s.storage_options() for s in servers], "size_mb": args.size_mb,
                      "repeats": args.repeats, "part_size_mb": args.part_size_mb, "concurrency": args.concurrency,
                      "out": os.path.join(tmp, "result.json")}
            config_path = os.path.join(tmp, "config.json")
            with open(config_path, "w") as f:
                json.dump(config, f)
            env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            with SiteJob([sys.executable, os.path.abspath(__file__), "--worker", config_path], sites=SITES,
                         ranks_per_site=RANKS_PER_SITE, lab=lab, env=env) as job:
                codes = job.wait(args.timeout_s)
            if any(codes):
                print(f"ranks failed with exit codes {codes}", file=sys.stderr)
                return 2
            with open(config["out"]) as f:
                out = json.load(f)
        finally:
            for server in servers:
                server.stop()
    record = report(out, wan_rate=args.wan_rate, ranks_per_site=RANKS_PER_SITE, repeats=args.repeats,
                    min_state_bytes=MIN_STATE_BYTES)
    return _flat.finish(record, args, plot)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2])
    else:
        sys.exit(main())
