"""One rank of ``multidc bench diloco --auto``. Launched by ``bench_diloco_auto.py`` inside a lab namespace (or on
loopback), its plan a JSON argument; ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``MULTIDC_SITE``
from the environment.

Every row of the plan (``sites_alone``, one plain DiLoCo per grid H, the ``"auto"`` run) trains the model of
``multidc bench diloco`` afresh on the same batches for the same steps; its timed window starts after
``plan["warmup"]`` steps on every rank together (the auto run's warm-up rounds are inside it: they are its cost). At
the end each rank records its window's seconds and WAN bytes, the validation loss of the global parameters, the
rounds' H. With ``plan["change"]`` (the rate change) the auto run asks the driver, right after the first round end
from ``after_step`` on, to re-shape the lab's link (a request file; the driver writes an ack file when ``tc`` is
done) and records every decision it adopts. Rank 0 writes the records.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.tools._bench_model import TopicData
from multidc.hierarchical.tools._bench_worker import finish
from multidc.hierarchical.tools._diloco_worker import _Run, _step, _tx_bytes
from multidc.hierarchical.topology import Topology

_ACK_WAIT_S = 60.0  # the driver runs two tc commands per site


def main(plan: dict) -> None:
    dist.init_process_group("gloo")
    topo = Topology.build(wan=WanConfig(streams="auto"))  # prepares the streams the auto run may choose
    local = topo.local_rank_in_site
    data = TopicData(vocab=plan["model"]["vocab"], topics=plan["topics"], seed=plan["seed"])
    seq, batch, steps = plan["model"]["seq"], plan["batch"], plan["steps"]
    weights = data.site_weights(topo.site, topo.num_sites, plan["own_share"])
    most = max(steps, plan["change"]["steps"] if plan.get("change") else 0)  # the rate change's job may run longer
    train = data.sample(most * batch, seq + 1, weights, seed=10_000 * (topo.site + 1) + 100 * local)
    val = data.sample(plan["val_sequences"], seq + 1, data.mixed_weights(), seed=7)
    records = []
    for method in plan["methods"]:
        steps = plan["change"]["steps"] if method["row"] == "auto" and plan.get("change") else plan["steps"]
        method = {**method, "steps": steps}
        run = _Run(method, plan, topo)
        change = plan.get("change") if method["row"] == "auto" else None
        seen = {"decision": None, "decisions": [], "change_step": None}
        stamps = [0.0] * (steps + 1)  # after each step t: the settled window's seconds (auto)
        dist.barrier()
        for t in range(1, steps + 1):
            if t == plan["warmup"] + 1:
                dist.barrier()  # the timed window starts together on every rank
                tx0 = _tx_bytes(plan["iface"]) if local == 0 else 0
                sent0, start = topo.wan_stats.snapshot()["bytes_sent"], time.perf_counter()
            _step(run, train[(t - 1) * batch: t * batch])
            if run.diloco is not None and run.diloco._auto is not None:  # the bench reads the decision in force
                _note(run.diloco, t, seen)
                if change and seen["change_step"] is None and t >= change["after_step"] \
                        and run.diloco._rounds.start == t:  # a round ended at t: the same on every rank
                    _change_rate(change, t, seen, run.diloco._auto.rounds_ended)
            stamps[t] = time.perf_counter()
        elapsed = time.perf_counter() - start
        first = last = 0
        if run.diloco is not None and run.diloco._auto is not None and seen["decisions"]:
            # the decision in force at the end, from the round end that adopted it to the last round end: the
            # chosen settings' own window (no warm-up round, no earlier decision, no unsynced tail)
            first, last = seen["decisions"][-1][0], run.diloco._rounds.start
        elif method.get("h"):  # a grid row alike: from its first round end (its cold first sync left out)
            first, last = method["h"], steps // method["h"] * method["h"]
        settled = {"from_step": first, "to_step": last, "seconds": stamps[last] - stamps[first]} if last > first \
            else None
        loss = run.evaluate(val, batch) if local == 0 else None
        pipeline = [run.diloco.wan.chunk_mb, run.diloco.wan.streams] if run.diloco is not None else None
        plans = [list(p) for p in run.diloco.round_plans] if run.diloco is not None else []
        auto = run.diloco._auto if run.diloco is not None else None
        rounds_at_end = auto.rounds_ended if auto is not None else None
        run.close()  # waits for a sync still in flight: the window ends with all its bytes sent
        dist.barrier()
        records.append({"row": method["row"], "kind": method["kind_row"], "h": method.get("h"),
                        "rank": dist.get_rank(), "site": topo.site, "local": local, "seconds": elapsed,
                        "timed_steps": steps - plan["warmup"], "val_loss": loss, "plans": plans,
                        "pipeline": pipeline, "settled": settled,
                        "payload_bytes": topo.wan_stats.snapshot()["bytes_sent"] - sent0,
                        "iface_tx_bytes": (_tx_bytes(plan["iface"]) - tx0) if local == 0 and plan["iface"] else 0})
        if change:
            records.append({"row": "rate_change", "rank": dist.get_rank(), "change_step": seen["change_step"],
                            "rounds_at_change": seen.get("rounds_at_change"), "decisions": seen["decisions"],
                            "rounds_at_end": rounds_at_end})
    finish(records, plan["out"], topo)


def _note(diloco, t: int, seen: dict) -> None:
    """Record the decision in force when it changed: ``[step, rounds ended, H, measured bits/s]``."""
    decision = diloco._auto.decision
    if decision is not None and decision is not seen["decision"]:
        seen["decision"] = decision
        seen["decisions"].append([t, diloco._auto.rounds_ended, decision.sync_every,
                                  decision.measured.bandwidth_bps])


def _change_rate(change: dict, t: int, seen: dict, rounds_ended: int) -> None:
    """Rank 0 asks the driver to re-shape the link and waits for its ack; every rank then meets in a barrier, so the
    next round starts at the new rate everywhere."""
    if dist.get_rank() == 0:
        with open(change["request"], "w") as f:
            f.write(str(t))
        deadline = time.monotonic() + _ACK_WAIT_S
        while not os.path.exists(change["ack"]):  # the driver's tc commands: another process, no event to wait on
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bench driver did not change the lab's rate within {_ACK_WAIT_S} s")
            time.sleep(0.05)
    dist.barrier()
    seen["change_step"], seen["rounds_at_change"] = t, rounds_ended


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(json.loads(sys.argv[1]))
