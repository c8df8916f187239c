"""``multidc doctor``: check a multi-site layout before a long run.

Run it exactly as the training job will run, one copy per rank, with the same launcher and environment::

    torchrun --nnodes 2 --node-rank $SITE --nproc-per-node 4 --rdzv-backend static \\
        --master-addr $HOST0 --master-port 29500 --no-python multidc doctor        # MULTIDC_SITE=$SITE set
    multidc lab run --sites 2 --ranks-per-site 2 --wan-rate 400mbit -- multidc doctor

Every rank builds the ``Topology`` from the ``MULTIDC_*`` environment, reports its host, the address and the TCP
ports its process group listens on, then times a short all-reduce inside each site and across sites over each
rail. Rank 0 prints the detected sites, the addresses and ports that must be reachable between sites, and the
measured bandwidths; ``--json`` also writes them to a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_IFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=float, default=16.0, help="all-reduce size for the timings (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--backend", default="auto", help="gloo, nccl, or auto (nccl when CUDA is available)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="rendezvous and collective timeout (s)")
    parser.add_argument("--json", default=None, help="rank 0 also writes the report to this file")
    parser.add_argument("--lighthouse", default=None,
                        help="elastic sites: check every rank reaches this torchft lighthouse (host:port; default "
                             "MULTIDC_LIGHTHOUSE when set)")


def run(args: argparse.Namespace) -> int:
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"multidc doctor runs once per rank under a launcher, like the training job; {', '.join(missing)} "
            f"not set. Examples: `torchrun --nnodes 2 --node-rank <site> --nproc-per-node <n> --master-addr <host> "
            f"--master-port 29500 --no-python multidc doctor` on each site (with MULTIDC_SITE=<site>), or "
            f"`multidc lab run --sites 2 --ranks-per-site 2 -- multidc doctor` on one machine."
        )
    if args.size_mb <= 0 or args.repeats < 1 or args.timeout_s <= 0:
        raise ValueError("--size-mb and --timeout-s must be > 0 and --repeats >= 1.")
    import torch
    import torch.distributed as dist

    from multidc.hierarchical import _env
    from multidc.hierarchical.config import WanConfig
    from multidc.hierarchical.topology import Topology

    wan = WanConfig()  # validates MULTIDC_WAN_* before anyone connects
    lighthouse = args.lighthouse or _env.read(_env.LIGHTHOUSE)
    if lighthouse:
        from multidc.hierarchical.elastic import lighthouse_url

        lighthouse = lighthouse_url(lighthouse)  # a malformed address fails here, on every rank
    backend = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        topo = Topology.build(wan=wan)
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        info = {**_rank_info(topo), "lighthouse_error": _reach(lighthouse, args.timeout_s)}
        timings = _measure(topo, int(args.size_mb * 2**20) // 4, args.repeats, device)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {**info, **timings})
        report = _report(gathered, topo, wan, backend, args.size_mb, lighthouse)
        if dist.get_rank() == 0:
            print(_format(report), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
        topo.close()
    finally:
        dist.destroy_process_group()
    return 1 if report["lighthouse"] and report["lighthouse"]["unreachable_from"] else 0


def _reach(lighthouse: str | None, timeout_s: float) -> str | None:
    """Why this rank cannot reach the lighthouse, or None (also when none is configured)."""
    if not lighthouse:
        return None
    from multidc.hierarchical.elastic import LighthouseUnreachable, check_lighthouse

    try:
        check_lighthouse(lighthouse, timeout_s=min(timeout_s, 10.0))
    except (LighthouseUnreachable, ImportError) as exc:
        return str(exc)
    return None


def _rank_info(topo) -> dict:
    iface = next((os.environ[v] for v in _IFACE_VARS if os.environ.get(v)), None)
    return {
        "rank": topo.rank, "host": socket.gethostname(), "site": topo.site, "site_name": topo.site_name,
        "local_rank_in_site": topo.local_rank_in_site, "rail": topo.rail, "iface": iface,
        "address": _route_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "listen_ports": _listening_ports(),
    }


def _route_address(host: str, port: int) -> str | None:
    """The local address this host uses to reach ``host`` (a UDP connect sends nothing)."""
    try:
        family = socket.getaddrinfo(host, port)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def _listening_ports() -> list[int]:
    """TCP ports this process listens on (the rendezvous store on rank 0, the backend's pair listeners).

    Read from /proc (Linux); empty elsewhere.
    """
    inodes = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (e.g. the listdir's own descriptor)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            if row[3] == "0A" and row[9] in inodes:  # state LISTEN, owned by this process
                ports.add(int(row[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _measure(topo, numel: int, repeats: int, device) -> dict:
    """Median seconds of an all-reduce inside this site and over this rank's rail (``None`` off-rail).

    The rails of a site share its WAN link and run at once. Each rank's rail time lasts until every rail of its
    site is done (a barrier inside the site), so the site's slowest time spans from the earliest rail's start to
    the last rail's end: a rail that leaves the start barrier late, and finds the link half free, cannot make the
    link look faster than it is.
    """
    import torch
    import torch.distributed as dist

    tensor = torch.ones(numel, device=device)

    def timed(group, until_done=None) -> float:
        times = []
        for _ in range(repeats + 1):  # the first call sets up connections
            dist.barrier()
            start = time.perf_counter()
            if group is not None:
                dist.all_reduce(tensor, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if until_done is not None:
                    dist.barrier(group=until_done)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    intra = timed(topo.intra_group if topo.site_size > 1 else None)
    rail = timed(topo.rail_groups[0] if topo.rail_groups and topo.num_sites > 1 else None,
                 topo.intra_group if topo.site_size > 1 else None)
    return {"intra_s": intra if topo.site_size > 1 else None, "rail_s": rail if topo.rail_groups else None}


def _bus_mbps(nbytes: float, members: int, seconds: float | None) -> float | None:
    """All-reduce bus bandwidth, MB/s: the bytes each member sends in a ring, 2(m-1)/m * S, over the time."""
    if seconds is None or members < 2 or seconds <= 0:
        return None
    return 2 * (members - 1) / members * nbytes / seconds / 1e6


def _report(ranks: list[dict], topo, wan, backend: str, size_mb: float, lighthouse: str | None = None) -> dict:
    nbytes = size_mb * 2**20
    sites = []
    for site, members in enumerate(topo.layout.site_ranks):
        rows = [ranks[r] for r in members]
        intra = max((r["intra_s"] for r in rows if r["intra_s"] is not None), default=None)
        rail = max((r["rail_s"] for r in rows if r["rail_s"] is not None), default=None)
        sites.append({
            "site": site, "name": topo.layout.site_names[site], "ranks": list(members),
            "hosts": sorted({r["host"] for r in rows}), "addresses": sorted({str(r["address"]) for r in rows}),
            "intra_MBps": _bus_mbps(nbytes, len(members), intra),
            "inter_MBps_per_rail": _bus_mbps(nbytes, topo.num_sites, rail),
            "rails": topo.num_rails,
        })
        per_rail = sites[-1]["inter_MBps_per_rail"]
        sites[-1]["inter_MBps_site"] = per_rail * topo.num_rails if per_rail is not None else None
    return {
        "backend": backend, "world_size": len(ranks), "num_sites": topo.num_sites, "size_mb": size_mb,
        "rendezvous": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "wan": {k: v for k, v in vars(wan).items() if not k.startswith("_")},
        "ephemeral_ports": _ephemeral_range(), "sites": sites, "ranks": ranks, "warnings": _warnings(sites),
        "lighthouse": {"url": lighthouse, "unreachable_from": [r["rank"] for r in ranks if r["lighthouse_error"]],
                       "error": next((r["lighthouse_error"] for r in ranks if r["lighthouse_error"]), None)}
        if lighthouse else None,
    }


def _ephemeral_range() -> str | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return f"{low}-{high}"
    except OSError:
        return None


def _warnings(sites: list[dict]) -> list[str]:
    out = []
    for s in sites:
        inter, intra = s["inter_MBps_per_rail"], s["intra_MBps"]
        if inter is not None and intra is not None and inter > intra:
            out.append(f"site {s['name']}: inter-site bandwidth ({inter:.0f} MB/s) exceeds intra-site "
                       f"({intra:.0f} MB/s); check that MULTIDC_SITE / MULTIDC_NUM_SITES match the real sites.")
    return out


def _format(report: dict) -> str:
    fmt = lambda v: f"{v:9.1f}" if v is not None else "        -"  # noqa: E731
    lines = [
        f"multidc doctor: {report['world_size']} ranks, {report['num_sites']} sites, backend {report['backend']}, "
        f"{report['size_mb']:g} MiB all-reduce",
        f"rendezvous (MASTER_ADDR:MASTER_PORT, TCP, must be reachable from every site): {report['rendezvous']}",
        f"WAN settings: {report['wan']}",
        "",
        "site  name          ranks                hosts / addresses                 intra MB/s  "
        "inter MB/s per rail x rails = site",
    ]
    for s in report["sites"]:
        where = ",".join(s["hosts"]) + " / " + ",".join(s["addresses"])
        ranks = ",".join(map(str, s["ranks"]))
        lines.append(f"{s['site']:4d}  {s['name'][:12]:12s}  {ranks[:19]:19s}  {where[:32]:32s}  "
                     f"{fmt(s['intra_MBps'])}   {fmt(s['inter_MBps_per_rail'])} x {s['rails']} = "
                     f"{fmt(s['inter_MBps_site'])}")
    lines += ["", "rank  site  rail  iface     address          listening TCP ports"]
    for r in report["ranks"]:
        rail = "-" if r["rail"] is None else str(r["rail"])
        lines.append(f"{r['rank']:4d}  {r['site']:4d}  {rail:>4s}  {str(r['iface'] or '-'):8s}  "
                     f"{str(r['address']):15s}  {' '.join(map(str, r['listen_ports'])) or '-'}")
    lighthouse = report["lighthouse"]
    if lighthouse is not None:
        bad = lighthouse["unreachable_from"]
        lines += ["", f"torchft lighthouse {lighthouse['url']}: "
                  + ("reached from every rank" if not bad else
                     f"UNREACHABLE from ranks {','.join(map(str, bad))}: {lighthouse['error']}")]
    lines += [
        "",
        f"Between sites, every rank must reach every other rank's address on its listening ports (the backend "
        f"listens on ephemeral ports, range {report['ephemeral_ports'] or 'see your OS'}; set GLOO_SOCKET_IFNAME / "
        f"NCCL_SOCKET_IFNAME to choose the interface) and rank 0's rendezvous port. The transport is "
        f"unauthenticated, unencrypted TCP: use a private interconnect or VPN.",
    ]
    lines += [f"WARNING: {w}" for w in report["warnings"]]
    return "\n".join(lines)
