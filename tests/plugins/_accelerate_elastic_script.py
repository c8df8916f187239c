"""One site of an elastic Accelerate job, run by tests/plugins/test_accelerate_elastic.py (one ``accelerate launch``
per site, ``MultiDCAccelerator`` with ``MultiDCPlugin(elastic=True)``).

    accelerate launch --config_file CONFIG --num_processes K tests/plugins/_accelerate_elastic_script.py \\
        --site site1 --sites 2 --steps 40 --out DIR [--diloco] [--ckpt-dir D [--ckpt-every 4]] [--resume D]

An ordinary Accelerate loop: ``prepare``, forward, ``backward``, ``optimizer.step()``, ``scheduler.step()``,
``optimizer.zero_grad()``; the rows of each step are ``rows(site, process index, accelerator.job_step)``. Every
committed step (or DiLoCo round, with ``--diloco``) is logged with the sites that took part; each process writes
DIR/<site>_rank<r>.pt at the end and DIR/<site>.progress as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from accelerate.utils import DataLoaderConfiguration

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.hierarchical import DiLoCoConfig, WanConfig  # noqa: E402
from multidc.plugins import MultiDCAccelerator, MultiDCPlugin  # noqa: E402
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import (  # noqa: E402
    LR,
    MAX_SITES,
    fail_after_sync,
    full_parameters,
    lr_factor,
    model,
    record_writes,
    rows,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="committed steps (rounds with --diloco)")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--diloco", action="store_true")
    parser.add_argument("--fragments", type=int, default=1, help="--diloco streaming: a round is SYNC_EVERY/fragments")
    parser.add_argument("--overlap", type=int, default=0, help="--diloco overlap_steps")
    parser.add_argument("--ckpt-dir", help="save_state here after every --ckpt-every-th committed job step")
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--save-before-quorum", action="store_true", help="save_state after scheduler.step(), "
                        "before zero_grad() (the next quorum), instead of after it")
    parser.add_argument("--discard-at", type=int, default=-1, help="the job step this site discards, once, after its "
                        "transfers completed (the other sites commit it)")
    parser.add_argument("--resume", help="load_state(this, step=--resume-step) right after prepare")
    parser.add_argument("--resume-step", type=int)
    parser.add_argument("--resume-late", action="store_true", help="load_state after the site joined the job")
    parser.add_argument("--dp-shard", type=int, help="FSDP2 over the site's processes (MultiDCPlugin(dp_shard=))")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    index = int(args.site.removeprefix("site"))
    diloco = DiLoCoConfig(sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                          fragments=args.fragments, overlap_steps=args.overlap)
    plugin = MultiDCPlugin(elastic=True, site=args.site, num_sites=args.sites, wan=WanConfig(timeout_s=args.timeout_s),
                           cross_site="diloco" if args.diloco else None, diloco=diloco if args.diloco else None,
                           dp_shard=args.dp_shard)
    # split_batches: the scheduler steps once per optimizer step (and skips the steps the optimizer skipped)
    accelerator = MultiDCAccelerator(multidc_plugin=plugin,
                                     dataloader_config=DataLoaderConfiguration(split_batches=True))
    net = model()
    net.pipeline_blocks = lambda: [net[0], net[2]]  # DiLoCo's blocks: streaming makes each Linear a fragment
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # per committed step, or per inner step
    prepared, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    rank, site = accelerator.process_index, accelerator.elastic_site
    if args.discard_at >= 0:
        fail_after_sync(site, args.discard_at)
    written = record_writes()
    if args.resume and not args.resume_late:
        accelerator.load_state(args.resume, step=args.resume_step)

    def job_step() -> int:  # the job's committed steps (rounds with --diloco)
        return accelerator.diloco.outer_steps if args.diloco else accelerator.job_step

    accelerator.job_step  # noqa: B018  (the site joins the job here, after the load_state above)
    if args.resume_late:  # wrong: after joining (must raise, loading nothing)
        accelerator.load_state(args.resume, step=args.resume_step)
    joined_at, first_t = job_step(), accelerator.job_step
    initial = full_parameters(net)
    log, syncs, discarded, last, last_step, rng_at_save = [], [], 0, [], -1, {}

    def done(step: int) -> bool:  # every site took part in the last committed step
        return (step >= args.steps and last_step == step - 1 and len(last) == args.sites) or step >= args.max_steps

    entry = None
    while True:
        step, outer = accelerator.job_step, job_step()
        if entry is None and done(outer):
            break
        if entry is None:  # a step (a round) starts: which sites are in it
            present = torch.zeros(MAX_SITES)
            present[index] = 1.0 / site.topology.site_size  # summed over the step's ranks: 1 per site present
            site.all_reduce(present, op="sum")
            entry = {"step": outer, "t0": step, "sites": [s for s in range(MAX_SITES) if present[s] > 0.5]}
        x, y = rows(index, rank, step)
        accelerator.backward(torch.nn.functional.mse_loss(prepared(x), y))
        optimizer.step()
        scheduler.step()
        committed = None if args.diloco else accelerator.elastic_steps.committed
        if args.save_before_quorum and committed and accelerator.job_step % args.ckpt_every == 0:
            accelerator.save_state(args.ckpt_dir)  # the first site of the step's quorum, or one at the next quorum
            rng_at_save[accelerator.job_step] = torch.get_rng_state()
            torch.rand(1)  # the loop draws (the next batch, say) before the next quorum
        optimizer.zero_grad()
        committed = accelerator.diloco.synced if args.diloco else accelerator.elastic_steps.committed
        if committed is not None:
            syncs.append({**entry, "t1": accelerator.job_step, "committed": committed})
        if committed:
            log.append(entry)
            last, last_step = entry["sites"], entry["step"]
            if args.ckpt_dir and not args.save_before_quorum and accelerator.job_step % args.ckpt_every == 0:
                accelerator.save_state(args.ckpt_dir)  # written by the first site of the quorum only
        elif committed is False:
            discarded += 1
        if committed is not None:
            entry = None
        if rank == 0:
            with open(os.path.join(args.out, f"{args.site}.progress"), "w") as f:
                f.write(str(job_step()))
        time.sleep(args.sleep)
    local = params = full_parameters(net)
    if args.diloco:  # the global parameters: equal on every site (streaming: the local ones are not)
        with accelerator.diloco.global_parameters():
            params = full_parameters(net)
    torch.save({"site": index, "params": params, "local": local, "syncs": syncs, "first_t": first_t, "log": log,
                "discarded": discarded, "joined_at": joined_at,
                "initial": initial, "final_step": job_step(), "num_sites": site.num_sites, "written": written,
                "rng_at_save": rng_at_save, "sharded": [type(p).__name__ for p in net.parameters()],
                "lr": optimizer.param_groups[0]["lr"]},
               os.path.join(args.out, f"{args.site}_rank{rank}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
