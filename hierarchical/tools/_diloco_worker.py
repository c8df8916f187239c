"""One rank of ``multidc bench diloco``. Launched by ``bench_diloco.py`` inside a lab namespace (or on loopback).

Reads its rank and site from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``MULTIDC_SITE``) and its plan from a JSON argument. For every method in the plan it builds the model afresh
(the same seed everywhere), trains it the way a user would (``DistributedDataParallel`` with
``register_ddp_hook`` for hierarchical DDP; with ``register_site_ddp_hook`` for DiLoCo, whose ``DiLoCo`` hooks
the inner optimizer, and for the sites training alone) and records per-step times, WAN bytes and, in the
quality phase, losses. Rank 0 writes the records.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.ddp_hook import register_ddp_hook, register_site_ddp_hook
from multidc.hierarchical.diloco import DiLoCo, DiLoCoConfig
from multidc.hierarchical.tools._bench_model import TinyGPT, TopicData, next_token_loss
from multidc.hierarchical.tools._bench_worker import finish
from multidc.hierarchical.topology import Topology


def _tx_bytes(iface: str | None) -> int:
    if iface is None:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


class _Run:
    """One method's model, optimizer and (for DiLoCo) outer loop on this rank."""

    def __init__(self, method: dict, plan: dict, topo: Topology, schedule=None) -> None:
        torch.manual_seed(plan["seed"])
        self.model = TinyGPT(**plan["model"])
        # Same seed on every rank: equal start without DDP's start-up broadcast, which would cross the WAN once
        # per method (DiLoCo's start finds the sites equal by their digests and copies nothing).
        self.ddp = DistributedDataParallel(self.model, init_sync=False)
        if method["kind"] == "ddp":
            register_ddp_hook(self.ddp, topo, wan=WanConfig(compression=method.get("compression", "none"),
                                                            streams=plan["streams"]))
        else:
            register_site_ddp_hook(self.ddp, topo)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=plan["lr"], weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule or _warmup_cosine(method["steps"]))
        self.diloco = None
        if method["kind"] == "diloco":
            self.diloco = DiLoCo(self.ddp, self.opt, topo, DiLoCoConfig(**method["diloco"]),
                                 wan=WanConfig(**method.get("wan", {"streams": plan["streams"]})))

    @torch.no_grad()
    def evaluate(self, val: torch.Tensor, batch: int) -> float:
        """Validation loss of what the method trains: the model, or DiLoCo's global parameters (each site's own
        drift towards its data between syncs)."""
        with self.diloco.global_parameters() if self.diloco is not None else contextlib.nullcontext():
            losses = [self.model.loss(val[i: i + batch]).item() for i in range(0, len(val), batch)]
        return sum(losses) / len(losses)

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()


def main(plan: dict) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topo = Topology.build(wan=WanConfig(streams=plan["streams"]))
    sites, local = topo.num_sites, topo.local_rank_in_site
    data = TopicData(vocab=plan["model"]["vocab"], topics=plan["topics"], seed=plan["seed"])
    seq, batch = plan["model"]["seq"], plan["batch"]
    steps = max(m["steps"] for m in plan["methods"])
    weights = data.site_weights(topo.site, sites, plan["own_share"])
    # Every method sees the same batches: rank r of site s draws from its site's topics with its own seed.
    train = data.sample(steps * batch, seq + 1, weights, seed=10_000 * (topo.site + 1) + 100 * local)
    every = plan["eval_every"]
    val = data.sample(plan["val_sequences"], seq + 1, data.mixed_weights(), seed=7) if every else None
    records = []
    for method in plan["methods"]:
        run = _Run(method, plan, topo)
        dist.barrier()
        steps, start, timed_from = method["steps"], None, None
        for t in range(1, steps + 1):
            if t == method["warmup"] + 1:
                dist.barrier()  # the timed window starts together on every rank
                tx0 = _tx_bytes(plan["iface"]) if local == 0 else 0
                sent0, start, timed_from = topo.wan_stats.snapshot()["bytes_sent"], time.perf_counter(), t
                stats0 = dict(vars(run.diloco.stats)) if run.diloco is not None else None
            loss = _step(run, train[(t - 1) * batch: t * batch])
            record = {"method": method["name"], "rank": rank, "site": topo.site, "local": local, "step": t,
                      "loss": loss}
            if val is not None and (t % every == 0 or t == steps):
                record["val_loss"] = run.evaluate(val, batch)
            records.append(record)
        elapsed = time.perf_counter() - start if start is not None else None
        run.close()  # waits for a sync still in flight: the window ends with all its bytes sent
        dist.barrier()
        records.append({"method": method["name"], "rank": rank, "site": topo.site, "local": local,
                        "overlaps": method["overlaps"], "seconds": elapsed,
                        "timed_steps": steps - timed_from + 1 if timed_from else 0,
                        "payload_bytes": topo.wan_stats.snapshot()["bytes_sent"] - sent0,
                        "iface_tx_bytes": (_tx_bytes(plan["iface"]) - tx0) if local == 0 and plan["iface"] else 0,
                        "stats": _window(run, stats0)})
    finish(records, plan["out"], topo)


def _warmup_cosine(steps: int):
    """Linear warm-up over 5% of the steps, then cosine decay to a tenth: the same schedule for every method."""
    warm = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))

    return factor


def _window(run: _Run, before: dict | None) -> dict | None:
    """DiLoCo's counters over the timed window (``None`` without DiLoCo)."""
    if run.diloco is None:
        return None
    now = vars(run.diloco.stats)
    return {k: now[k] - (before or {}).get(k, 0) for k in now}


def _step(run: _Run, batch: torch.Tensor) -> float:
    run.opt.zero_grad(set_to_none=True)
    loss = next_token_loss(run.ddp(batch[:, :-1]), batch)  # through DDP: its hooks reduce the gradients
    loss.backward()
    run.opt.step()  # DiLoCo's step runs in the optimizer's post-hook
    run.schedule.step()
    return loss.item()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(json.loads(sys.argv[1]))
