"""One site of the elastic fault benchmark (``benchmarks/fault_elastic.py``): a small GPT, DDP over the site's
ranks, ``ElasticSite`` across the sites. One ``torchrun`` per site::

    torchrun --nproc-per-node 2 ... -m benchmarks.fault_jobs.elastic_gpt --site site1 --sites 3 --steps 200 --out D

Rank ``r`` of site ``s`` trains step ``k`` on sequences drawn from ``TopicData`` with seed ``(s, r, k)``. Rank 0
appends one JSON line per committed step to ``D/<site>.events`` (``step``, ``sites`` present, ``loss``, wall
``time``); at the end every rank writes ``D/<site>_rank<r>.json`` (final step, a hash of its parameters, the
validation loss). The job ends once ``--steps`` steps are committed and every site took part in the last one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist

from multidc.hierarchical import WanConfig
from multidc.hierarchical.elastic import ElasticSite
from multidc.hierarchical.tools._bench_model import TinyGPT, TopicData, next_token_loss

VOCAB, SEQ, BATCH, MAX_SITES = 64, 32, 8, 8


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=64, layers=2, heads=4, seq=SEQ)


def _batch(data: TopicData, site: int, rank: int, step: int, sites: int) -> torch.Tensor:
    return data.sample(BATCH, SEQ + 1, data.site_weights(site, sites, 0.8), seed=(site * 1000 + rank) * 100_003 + step)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--min-sites", type=int, default=1, help="sites a step needs to commit")
    parser.add_argument("--sleep", type=float, default=0.0, help="pause after each step (paces the run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, index = dist.get_rank(), int(args.site.removeprefix("site"))
    data = TopicData(vocab=VOCAB, topics=2 * args.sites)
    net = _model()
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    site = ElasticSite(
        state_dict=lambda: {"model": net.state_dict(), "optim": opt.state_dict()},
        load_state_dict=lambda s: (net.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])),
        site=args.site, wan=WanConfig(timeout_s=args.timeout_s), sites=args.sites,
        min_sites=args.min_sites,
    )
    events = open(os.path.join(args.out, f"{args.site}.events"), "a") if rank == 0 else None
    last, last_step = [], -1
    try:
        while True:
            site.start_step()
            step = site.step
            if (step >= args.steps and last_step == step - 1 and len(last) == args.sites) or step >= args.max_steps:
                break
            idx = _batch(data, index, rank, step, args.sites)
            loss = next_token_loss(model(idx[:, :-1]), idx)  # through DDP: averaged inside the site
            loss.backward()
            site.sync_gradients(model)
            present = torch.zeros(MAX_SITES + 1)
            present[index] = 1.0 / dist.get_world_size()  # summed over the site's ranks: 1 per site present
            present[MAX_SITES] = loss.detach() / dist.get_world_size()
            site.all_reduce(present, op="sum")
            if site.commit():
                opt.step()
                last, last_step = [s for s in range(MAX_SITES) if present[s] > 0.5], step
                if events is not None:
                    events.write(json.dumps({"step": step, "sites": last, "loss": float(present[MAX_SITES]) /
                                             len(last), "time": time.time()}) + "\n")
                    events.flush()
            opt.zero_grad()
            time.sleep(args.sleep)
        with torch.no_grad():
            validation = data.sample(64, SEQ + 1, data.mixed_weights(), seed=7)
            val_loss = float(net.loss(validation))
        with open(os.path.join(args.out, f"{args.site}_rank{rank}.json"), "w") as f:
            json.dump({"final_step": site.step, "digest": _digest(net), "val_loss": val_loss,
                       "num_sites": site.num_sites}, f)
    finally:
        site.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
