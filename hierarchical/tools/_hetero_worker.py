"""One rank of ``multidc bench diloco --heterogeneous``. Launched by ``bench_diloco_hetero.py`` (lab or loopback).

Reads its rank and site from the environment (``SiteJob``) and its plan from a JSON argument. For every run of the
plan it builds ``_diloco_worker``'s model, DDP and DiLoCo afresh (the same seed everywhere), trains until
``DiLoCo.should_stop`` and records, per inner step, when it started and ended and how long ``DiLoCo.step()`` held
it at a sync. A slowed site (``slowdown`` > 1) sleeps after each step ``slowdown - 1`` times that step's own work
(forward, backward, optimizer), so it runs that many times slower whatever the machine's load. Rank 0 keeps the
global parameters after every merged sync and, once the run has ended, evaluates them (nothing is evaluated
inside the timed loop). Rank 0 writes the records.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.tools._bench_model import TopicData, next_token_loss
from multidc.hierarchical.tools._bench_worker import finish
from multidc.hierarchical.tools._diloco_worker import _Run
from multidc.hierarchical.topology import Topology

MAX_STEPS_FACTOR = 10  # a run past this many times its planned steps raises instead of looping on


def warmup_constant(warm: int):
    """Linear warm-up over ``warm`` steps, then constant: a site's step count is not known before a run by time."""
    return lambda step: min(1.0, (step + 1) / max(1, warm))


def _val_sets(data: TopicData, plan: dict) -> dict[str, torch.Tensor]:
    """Validation sequences: every topic alike, and the job's pooled training mix (sites weighted by their ranks)."""
    ranks, own = plan["ranks"], plan["own_share"]
    pooled = sum(n * data.site_weights(s, len(ranks), own) for s, n in enumerate(ranks)) / sum(ranks)
    return {"uniform": data.sample(plan["val_sequences"], plan["model"]["seq"] + 1, data.mixed_weights(), seed=7),
            "pooled": data.sample(plan["val_sequences"], plan["model"]["seq"] + 1, pooled, seed=8)}


def _train(run: _Run, spec: dict, train: torch.Tensor, plan: dict, topo: Topology) -> tuple[dict, list]:
    """Train one run until DiLoCo stops; (this rank's step record, rank 0's snapshots ``(seconds, params)``)."""
    batch, slowdown = plan["batch"], spec["slowdown"][topo.site]
    diloco, tokens = run.diloco, batch * plan["model"]["seq"]
    diloco.finish_at(spec["finish"][topo.site])
    starts, ends, idle, synced, snapshots = [], [], [], [], []
    cap = MAX_STEPS_FACTOR * max(n for n in spec["finish"] if n is not None)
    dist.barrier()
    t0 = time.perf_counter()
    if topo.rank == 0:
        snapshots.append((0.0, [p.detach().clone() for p in run.model.parameters()]))
    while not diloco.should_stop:
        if len(starts) >= cap:
            raise RuntimeError(f"run {spec['name']} passed {cap} inner steps without DiLoCo.should_stop")
        begin, exposed, syncs = time.perf_counter(), diloco.stats.exposed_s, diloco.stats.outer_syncs
        t = len(starts)
        rows = train[(t * batch) % len(train):][:batch]
        run.opt.zero_grad(set_to_none=True)
        next_token_loss(run.ddp(rows[:, :-1]), rows).backward()
        diloco.count(tokens)
        run.opt.step()  # DiLoCo's step (and its sync, when due) runs in the optimizer's post-hook
        run.schedule.step()
        held = diloco.stats.exposed_s - exposed
        if slowdown > 1:  # outside DiLoCo.step(): the round timer counts it as this site's step time
            time.sleep((slowdown - 1) * max(0.0, time.perf_counter() - begin - held))
        starts.append(begin - t0)
        ends.append(time.perf_counter() - t0)
        idle.append(held)
        synced.append(diloco.stats.outer_syncs > syncs)
        if synced[-1] and topo.rank == 0:
            with diloco.global_parameters():
                snapshots.append((time.perf_counter() - t0, [p.detach().clone() for p in run.model.parameters()]))
    record = {"run": spec["name"], "rank": topo.rank, "site": topo.site, "local": topo.local_rank_in_site,
              "starts": starts, "ends": ends, "idle": idle, "synced": synced,
              "round_plans": [list(p) for p in diloco.round_plans], "sync_every_s": diloco.config.sync_every_s}
    return record, snapshots


@torch.no_grad()
def _evaluate(run: _Run, snapshots: list, val: dict[str, torch.Tensor], batch: int) -> list[dict]:
    """Validation losses of every snapshot (rank 0, after the run)."""
    out = []
    for seconds, params in snapshots:
        for p, saved in zip(run.model.parameters(), params):
            p.copy_(saved)
        row = {"seconds": seconds}
        for name, seqs in val.items():
            losses = [run.model.loss(seqs[i: i + batch]).item() for i in range(0, len(seqs), batch)]
            row[name] = sum(losses) / len(losses)
        out.append(row)
    return out


def _round_s(record: dict, topo: Topology) -> float:
    """The longest mean round (wall seconds per sync) of any rank in a run: one value on every rank."""
    syncs = max(1, sum(record["synced"]))
    value = torch.tensor([record["ends"][-1] / syncs if record["ends"] else 0.0], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def main(plan: dict) -> None:
    dist.init_process_group("gloo")
    topo = Topology.build(wan=WanConfig(streams=plan["streams"]))
    data = TopicData(vocab=plan["model"]["vocab"], topics=plan["topics"], seed=plan["seed"])
    weights = data.site_weights(topo.site, topo.num_sites, plan["own_share"])
    pool = plan["pool_steps"] * plan["batch"]
    train = data.sample(pool, plan["model"]["seq"] + 1, weights, seed=10_000 * (topo.site + 1) +
                        100 * topo.local_rank_in_site)
    val = _val_sets(data, plan) if topo.rank == 0 else {}
    records, measured_round_s = [], None
    for spec in plan["runs"]:
        config = dict(spec["diloco"])
        if config.get("sync_every_s") == "measured":  # the previous run's round length, agreed by every rank
            config["sync_every_s"] = measured_round_s
        method = {"kind": "diloco", "diloco": config, "steps": 0}
        run = _Run(method, plan, topo, schedule=warmup_constant(plan["warmup"]))
        record, snapshots = _train(run, spec, train, plan, topo)
        measured_round_s = _round_s(record, topo)
        run.close()
        if topo.rank == 0:
            record["curve"] = _evaluate(run, snapshots, val, plan["batch"])
        dist.barrier()
        records.append(record)
    finish(records, plan["out"], topo)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(json.loads(sys.argv[1]))
