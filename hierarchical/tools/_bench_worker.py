"""One rank of ``multidc bench allreduce``. Launched by ``bench.py`` (inside a lab namespace or on loopback).

Reads its rank, site and rendezvous from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``MULTIDC_SITE``) and its plan from a JSON argument; rank 0 writes the results file.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from multidc.hierarchical.all_reduce import all_reduce
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.topology import Topology


def _tx_bytes(iface: str | None) -> int:
    if iface is None:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def _timed(op, topo: Topology, iface: str | None) -> tuple[float, int, dict]:
    """Run ``op`` once between barriers; (seconds on the slowest rank, WAN tx bytes of this site, payload)."""
    reads_counter = iface is not None and topo.local_rank_in_site == 0
    dist.barrier()
    before = _tx_bytes(iface) if reads_counter else 0
    stats_before = topo.wan_stats.snapshot()
    start = time.perf_counter()
    op()
    elapsed = time.perf_counter() - start
    dist.barrier()
    tx = (_tx_bytes(iface) - before) if reads_counter else 0
    sent = topo.wan_stats.snapshot()["bytes_sent"] - stats_before["bytes_sent"]
    return elapsed, tx, sent


def _mode_op(mode: str, tensor: torch.Tensor, topo: Topology, chunk_mb: float, streams: int):
    if mode == "flat":
        return lambda: dist.all_reduce(tensor)
    wan = WanConfig(compression=mode, chunk_mb=chunk_mb, streams=streams)
    return lambda: all_reduce(tensor, topo, wan=wan)


def main(plan: dict) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topo = Topology.build(wan=WanConfig(streams=plan["streams"]))
    numel = int(plan["size_mb"] * 2**20) // 4
    source = torch.randn(numel, generator=torch.Generator().manual_seed(1234 + rank))
    tensor = torch.empty_like(source)
    records, reference = [], None
    for mode in plan["modes"]:
        op = _mode_op(mode, tensor, topo, plan["chunk_mb"], plan["streams"])
        for rep in range(plan["warmup"] + plan["repeats"]):
            tensor.copy_(source)
            elapsed, tx, sent = _timed(op, topo, plan["iface"])
            if rep < plan["warmup"]:
                continue
            records.append({"mode": mode, "rep": rep, "rank": rank, "site": topo.site, "seconds": elapsed,
                            "iface_tx_bytes": tx, "payload_bytes": sent})
        if mode == "flat":
            reference = tensor.clone()
        elif reference is not None:
            scale = reference.abs().max().item()
            records.append({"mode": mode, "rank": rank, "max_rel_error_vs_flat":
                            (tensor - reference).abs().max().item() / scale})
    finish(records, plan["out"], topo)


def finish(records: list[dict], out: str, topo: Topology) -> None:
    """Gather every rank's records to rank 0, which writes them as one JSON list to ``out``; then close the
    topology and the process group (every rank)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump([r for per_rank in gathered for r in per_rank], f)
    topo.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(json.loads(sys.argv[1]))
