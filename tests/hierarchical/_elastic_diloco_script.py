"""One site of an elastic DiLoCo job, run by tests/hierarchical/test_elastic_diloco.py (one ``torchrun`` per site).

    torchrun --nproc-per-node K --master-port P tests/hierarchical/_elastic_diloco_script.py --site site1 \\
        --rounds 8 --sites 3 --out DIR

Each rank trains ``model()`` (under DDP over its site's ranks) with inner SGD on its rows (``rows(site, local rank,
inner step)``); ``ElasticDiLoCo`` averages the pseudo-gradients over the sites of each round (``--fragments 2``:
streaming, one of two fragments every ``SYNC_EVERY / 2`` steps). The job ends once ``--rounds`` syncs are committed
and all ``--sites`` sites took part in the last one. Every committed round is logged with its sites and first inner
step, every sync with its outcome, every state received from a peer (heal) with its source and inner step; each
rank writes DIR/<site>_rank<r>.pt at the end and DIR/<site>.progress (committed syncs) as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.hierarchical import DiLoCoConfig, WanConfig  # noqa: E402
from multidc.hierarchical.elastic import ElasticDiLoCo  # noqa: E402
from tests.hierarchical.elastic_reference import LR, MAX_SITES, job_end, model, rows  # noqa: E402

SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM = 4, 0.7, 0.9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--max-rounds", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--sync-every", type=int, default=SYNC_EVERY)
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR)
    parser.add_argument("--fragments", type=int, default=1, help="streaming DiLoCo: the model's two Linear layers")
    parser.add_argument("--overlap", type=int, default=0, help="overlap_steps: the sync runs while training goes on")
    parser.add_argument("--seed-per-site", action="store_true", help="each site starts from other weights")
    parser.add_argument("--until", help="the job ends at the round this file holds, once a test wrote it (a round "
                        "ahead of every site); until then it goes on, to --max-rounds at most")
    parser.add_argument("--fail-first-flight", action="store_true", help="--overlap: report an error while the "
                        "first sync is in flight, taking the DiLoCo state before and after")
    parser.add_argument("--compression", default="none", help="DiLoCoConfig.compression; top-k codecs also record "
                        "whether each discarded round left the residuals as they were and each heal zeroed them")
    parser.add_argument("--vote-down", type=int, action="append", default=[], help="the site votes down its N-th "
                        "sync (counted from 0) after its transfer completed, recording its residuals then")
    parser.add_argument("--count-by-site", action="store_true", help="each rank reports site index + 1 samples per "
                        "inner step (DiLoCo.count): the sites weigh differently")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, index = dist.get_rank(), int(args.site.removeprefix("site"))
    net = model(seed=index if args.seed_per_site else 0)
    trained = torch.nn.parallel.DistributedDataParallel(net) if dist.get_world_size() > 1 else net
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    config = DiLoCoConfig(sync_every=args.sync_every, outer_lr=args.outer_lr, outer_momentum=OUTER_MOMENTUM,
                          fragments=args.fragments, overlap_steps=args.overlap, compression=args.compression)
    heals, live, kept = [], {}, []

    def healed(state: dict) -> None:  # the live state's sender, and the job's inner step it resumes at
        zeroed = all(r is None or not r.any() for r in residuals()) if live else True
        had = any(r is not None and r.any() for r in kept)  # before the heal: a zero check that can fail
        if live:
            kept[:] = residuals()  # a healed site's round starts from zero residuals
        heals.append({"source": state["site"], "t0": state["t0"], "residuals_zero": zeroed, "had_residuals": had})

    def residuals() -> list:
        return [None if f.residual is None else f.residual.clone() for f in live["diloco"]._fragments]

    diloco = ElasticDiLoCo(trained, opt, config, site=args.site, wan=WanConfig(timeout_s=args.timeout_s),
                           sites=args.sites, blocks=[net[0], net[2]],
                           state_dict=lambda: {"site": index, "t0": live["diloco"].inner_steps if live else 0},
                           load_state_dict=healed)
    live["diloco"] = diloco
    voted_down, commit = [], diloco.site.commit

    def commit_or_vote_down() -> bool:  # the sync's transfer is done (residuals updated), its vote is next
        if len(syncs) in args.vote_down:
            voted_down.append({"sync": len(syncs), "kept": kept[:], "after_transfer": residuals()})
            diloco.site.manager.report_error(RuntimeError("test: this site votes the round down"))
        return commit()

    diloco.site.commit = commit_or_vote_down

    def round_start() -> tuple[list[int], int, int]:
        present = torch.zeros(MAX_SITES)
        present[index] = 1.0 / dist.get_world_size()  # summed over the site's ranks: 1 per site present
        diloco.site.all_reduce(present, op="sum")  # inside the round: a failure discards the round
        return [s for s in range(MAX_SITES) if present[s] > 0.5], diloco.inner_steps, diloco.outer_steps

    joined_at, initial = diloco.outer_steps, {n: p.detach().clone() for n, p in net.named_parameters()}
    log, syncs, discarded, last, last_step = [], [], 0, [], -1
    kept[:], discards_kept = residuals(), []  # residuals as a round starts; per discarded round: left as they were?
    sites, t0, step = round_start()
    flight_check = None
    while True:
        x, y = rows(index, rank, diloco.inner_steps)
        torch.nn.functional.mse_loss(trained(x), y).backward()  # DDP: averaged inside the site
        if args.count_by_site:
            diloco.count(index + 1)
        opt.step()  # the post-hook: at a round's end, the sync and the next quorum
        opt.zero_grad()
        if args.fail_first_flight and flight_check is None and diloco._in_flight is not None:
            before = int(diloco.state_dict()["in_flight_fragment"])
            diloco.site.manager.report_error(RuntimeError("test: the first sync's transfer failed"))
            flight_check = (before, int(diloco.state_dict()["in_flight_fragment"]))
        if diloco.synced is None:
            continue
        syncs.append({"t0": t0, "t1": diloco.inner_steps, "committed": diloco.synced, "sites": sites})
        if diloco.synced:
            log.append({"step": step, "sites": sites, "t0": t0})
            last, last_step = sites, step
        else:
            discarded += 1
            now = residuals()
            discards_kept.append(all((a is None and (b is None or not b.any())) or (a is not None and torch.equal(a, b))
                                     for a, b in zip(kept, now)))
        kept[:] = residuals()
        if rank == 0:
            with open(os.path.join(args.out, f"{args.site}.progress"), "w") as f:
                f.write(str(diloco.outer_steps))
        done, rounds = diloco.outer_steps, args.rounds if not args.until else job_end(args.until, args.max_rounds)
        if (done >= rounds and last_step == done - 1 and len(last) == args.sites) or done >= args.max_rounds:
            break
        time.sleep(args.sleep)
        sites, t0, step = round_start()
    local = {n: p.detach().clone() for n, p in net.named_parameters()}
    with diloco.global_parameters():  # every site's: equal after each sync (streaming: the site's own elsewhere)
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save({"site": index, "params": params, "local": local, "log": log, "syncs": syncs, "heals": heals,
                "flight_check": flight_check, "discards_kept": discards_kept,
                "voted_down": voted_down,
                "residual_sum": sum(float(r.abs().sum()) for r in residuals() if r is not None),
                "bytes_sent": diloco.stats.bytes_sent, "discarded": discarded,
                "joined_at": joined_at, "initial": initial,
                "final_step": diloco.outer_steps, "num_sites": diloco.num_sites},
               os.path.join(args.out, f"{args.site}_rank{rank}.pt"))
    diloco.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
