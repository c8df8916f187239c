"""One site of an elastic job, run by tests/hierarchical/test_elastic.py (one ``torchrun`` per site).

    torchrun --nproc-per-node K --master-port P tests/hierarchical/_elastic_script.py --site site1 \\
        --steps 30 --sites 3 --out DIR

Each rank trains ``model()`` with SGD on its rows (``rows(site, local rank, step)``), averaging gradients over
the sites present through ``ElasticSite``. The job ends once ``--steps`` steps are committed and all ``--sites``
sites took part in the last one (or at ``--max-steps``). Every committed step is logged with the sites that took
part (and those present twice: two members of one site); multidc's INFO log lines go to stderr; each rank writes
DIR/<site>_rank<r>.pt at the end and DIR/<site>.progress (the committed step count) as it goes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.hierarchical import WanConfig  # noqa: E402
from multidc.hierarchical.elastic.site import ElasticSite  # noqa: E402
from tests.hierarchical.elastic_reference import LR, MAX_SITES, job_end, model, rows, wait_for_file  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel over the site's ranks")
    parser.add_argument("--hidden", type=int, default=16, help="another value: a site with another model")
    parser.add_argument("--seed-per-site", action="store_true", help="each site starts from other weights")
    parser.add_argument("--max-failed-steps", type=int, default=10)
    parser.add_argument("--quorum-timeout-s", type=float, default=120.0)
    parser.add_argument("--stall-s", type=float, default=0.0, help="sleep inside every step (a site too slow)")
    parser.add_argument("--discard-at", type=int, default=-1, help="this site discards that step (a local error)")
    parser.add_argument("--hold-s", type=float, default=0.0, help="wait this long between building the site and "
                        "its first step (a framework's setup); rank 0 writes DIR/<site>.built before")
    parser.add_argument("--until", help="the job ends at the step this file holds, once a test wrote it (a step "
                        "ahead of every site); until then it goes on, to --max-steps at most")
    parser.add_argument("--hold-until", help="before ending, wait until this file exists (at most 120 s)")
    parser.add_argument("--start-after", help="built, write FILE.ready, then wait until FILE exists (at most 120 s) "
                        "before the first step: a restart that looks at once, however slowly its processes started")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # multidc's INFO lines
    dist.init_process_group("gloo")
    rank, index = dist.get_rank(), int(args.site.removeprefix("site"))
    net = model(args.hidden, seed=index if args.seed_per_site else 0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(state: dict) -> None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    trained = net
    if args.ddp:
        trained = torch.nn.parallel.DistributedDataParallel(net)  # the site's group: this torchrun's ranks
    site = ElasticSite(state_dict=state_dict, load_state_dict=load_state_dict, site=args.site,
                       wan=WanConfig(timeout_s=args.timeout_s, compression=args.compression),
                       sites=args.sites, max_failed_steps=args.max_failed_steps,
                       quorum_timeout_s=args.quorum_timeout_s)
    if rank == 0:
        open(os.path.join(args.out, f"{args.site}.built"), "w").close()
    time.sleep(args.hold_s)
    if args.start_after:
        if rank == 0:
            open(f"{args.start_after}.ready", "w").close()
        wait_for_file(args.start_after)
    log, discarded, joined_at, last, last_step, first_quorum_s = [], 0, None, [], -1, None
    # the job steps whose state this site would save: after which event (is_leader), or through save_once
    leads = {"quorum": [], "commit": [], "once": []}
    while True:
        started = time.monotonic()
        site.start_step()
        first_quorum_s = time.monotonic() - started if first_quorum_s is None else first_quorum_s
        step = site.step
        if site.is_leader:
            leads["quorum"].append(step)
        # the end: every site took part in the last committed step (a site that just received the state included)
        last_step_of_job = args.steps if not args.until else job_end(args.until, args.max_steps)
        if (step >= last_step_of_job and last_step == step - 1 and len(last) == args.sites) or step >= args.max_steps:
            if args.hold_until:
                wait_for_file(args.hold_until)
            break
        if joined_at is None:  # the state this rank starts from (a site joining late receives it in start_step)
            joined_at, initial = step, {n: p.detach().clone() for n, p in net.named_parameters()}
        time.sleep(args.stall_s)
        x, y = rows(index, rank, step)
        torch.nn.functional.mse_loss(trained(x), y).backward()  # under DDP: averaged inside the site
        site.sync_gradients(trained)
        present = torch.zeros(MAX_SITES)
        present[index] = 1.0 / dist.get_world_size()  # summed over the site's ranks: 1 per member of the site
        site.all_reduce(present, op="sum")
        if step == args.discard_at:
            site.manager.report_error(RuntimeError(f"test: {args.site} discards step {step}"))
        if site.commit():
            opt.step()
            last, last_step = [s for s in range(MAX_SITES) if present[s] > 0.5], step
            log.append({"step": step, "sites": last, "twice": [s for s in range(MAX_SITES) if present[s] > 1.5]})
        else:
            discarded += 1
        if site.is_leader:
            leads["commit"].append(site.step)
        site.save_once(lambda step=site.step: leads["once"].append(step))  # now, at the next quorum, or never
        opt.zero_grad()
        if rank == 0:
            with open(os.path.join(args.out, f"{args.site}.progress"), "w") as f:
                f.write(str(site.step))
        time.sleep(args.sleep)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save({"site": index, "params": params, "log": log, "discarded": discarded, "joined_at": joined_at,
                "initial": initial, "leads": leads, "first_quorum_s": first_quorum_s,
                "final_step": site.step, "num_sites": site.num_sites},
               os.path.join(args.out, f"{args.site}_rank{rank}.pt"))
    site.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
