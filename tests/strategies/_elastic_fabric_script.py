"""One site of an elastic Fabric job, run by tests/strategies/test_elastic_fabric.py (one ``torchrun`` per site,
``Fabric(strategy=HierarchicalDDPFabricStrategy(elastic=True))`` over that site's ranks).

    torchrun --nproc-per-node K --master-port P tests/strategies/_elastic_fabric_script.py --site site1 \\
        --sites 2 --steps 30 --out DIR

An ordinary Fabric loop, as the strategy's docstring tells: ``fabric.setup(model, optimizer)``, the LR scheduler in
``strategy.elastic_state``, then per step: read ``strategy.job_step``, forward, ``fabric.backward``,
``optimizer.step()``, ``scheduler.step()`` if the step committed, ``optimizer.zero_grad()``. The rows of each step
are ``rows(site, rank, job_step)``. Every committed step is logged with the sites that took part; each rank writes
DIR/<site>_rank<r>.pt at the end and DIR/<site>.progress as it goes. The job ends once it committed ``--steps``
steps and the last one had every site.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from lightning.fabric import Fabric  # noqa: E402

from multidc.hierarchical import WanConfig  # noqa: E402
from multidc.strategies import HierarchicalDDPFabricStrategy  # noqa: E402
from tests.hierarchical.elastic_reference import LR, MAX_SITES, lr_factor, model, rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    index = int(args.site.removeprefix("site"))
    strategy = HierarchicalDDPFabricStrategy(elastic=True, site=args.site, num_sites=args.sites,
                                             wan=WanConfig(timeout_s=args.timeout_s))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]))
    fabric.launch()
    net = model()
    net, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # per committed step
    strategy.elastic_state["scheduler"] = scheduler
    joined_at = strategy.job_step  # the site joins the job here
    initial = {n: p.detach().clone() for n, p in net.module.named_parameters()}
    log, discarded, last, last_step = [], 0, [], -1
    site = strategy.elastic_sync.site
    while True:
        step = strategy.job_step  # the step's quorum
        if (step >= args.steps and last_step == step - 1 and len(last) == args.sites) or step >= args.max_steps:
            break
        present = torch.zeros(MAX_SITES)
        present[index] = 1.0 / site.topology.site_size  # summed over the step's ranks: 1 per site present
        site.all_reduce(present, op="sum")
        sites = [s for s in range(MAX_SITES) if present[s] > 0.5]
        x, y = rows(index, fabric.global_rank, step)
        fabric.backward(torch.nn.functional.mse_loss(net(x), y))
        optimizer.step()
        if strategy.elastic_committed:
            scheduler.step()
            log.append({"step": step, "sites": sites})
            last, last_step = sites, step
        else:
            discarded += 1
        optimizer.zero_grad()
        if fabric.global_rank == 0:
            with open(os.path.join(args.out, f"{args.site}.progress"), "w") as f:
                f.write(str(strategy.elastic_sync.job_step))
        time.sleep(args.sleep)
    params = {n: p.detach().clone() for n, p in net.module.named_parameters()}
    torch.save({"site": index, "params": params, "log": log, "discarded": discarded, "joined_at": joined_at,
                "initial": initial, "final_step": strategy.elastic_sync.job_step, "num_sites": site.num_sites,
                "lr": optimizer.param_groups[0]["lr"]},
               os.path.join(args.out, f"{args.site}_rank{fabric.global_rank}.pt"))
    if index == 0:  # as documented; site1 leaves the job at interpreter exit instead (multidc's atexit close)
        strategy.teardown()


if __name__ == "__main__":
    main()
