"""One site of an elastic DiLoCo Lightning job, run by tests/strategies/test_elastic_strategy.py (one ``torchrun``
per site, ``Trainer(strategy=DiLoCoStrategy(elastic=True))`` over that site's ranks).

    torchrun --nproc-per-node 1 --master-port P tests/strategies/_elastic_diloco_lightning_script.py \\
        --site site1 --sites 2 --max-steps 200 --out DIR [--ckpt-dir D] [--resume D/step=16.ckpt]

Each rank trains ``tests.hierarchical.elastic_reference.model()`` with inner SGD on ``rows(site, local rank, t)``,
``t`` the job's inner step (``trainer.global_step``), at ``LR * lr_factor(t)``; every ``SYNC_EVERY`` steps DiLoCo
averages over the sites of the round (``--fragments 2``: streaming, one of two fragments every ``SYNC_EVERY / 2``
steps; ``--overlap N``: each sync merges N steps after it starts, where the round ends). Every committed round is
logged with its sites and first inner step, every sync with its outcome; each rank writes DIR/<site>_rank<r>.pt at
the end and DIR/<site>.progress (inner steps) as it goes. ``--ckpt-dir``: a ``ModelCheckpoint`` every 2 rounds on
every site.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
import lightning.pytorch as pl  # noqa: E402

from multidc.hierarchical import DiLoCoConfig, WanConfig  # noqa: E402
from multidc.strategies import DiLoCoStrategy, Parallel3DStrategy  # noqa: E402
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import (  # noqa: E402
    LR,
    MAX_SITES,
    full_parameters,
    lr_factor,
    model,
    rows,
    wait_for_file,
)


class Net(pl.LightningModule):
    def __init__(self, index: int, sleep: float, out: str, name: str) -> None:
        super().__init__()
        self.net, self.index, self.sleep, self.out, self.name = model(), index, sleep, out, name
        self.rounds, self.discarded, self.initial, self.joined_at, self._round = [], 0, None, None, None
        self.syncs, self.first_t, self.trained_on, self.hold_until = [], None, None, None

    def pipeline_blocks(self):  # DiLoCo's blocks: streaming deals the two Linear layers into two fragments
        return [self.net[0], self.net[2]]

    def training_step(self, batch, batch_idx):
        diloco, t = self.trainer.strategy.diloco, self.trainer.global_step  # the job's inner step
        if self.joined_at is None:
            self.joined_at, self.first_t = diloco.outer_steps, t
            self.initial = full_parameters(self.net)
            self.trained_on = self.device.type
        if self._round is None:  # a round starts (the first step, or the one after a sync): which sites are in it
            present = torch.zeros(MAX_SITES, device=self.device)  # on the GPU with NCCL inside the site
            present[self.index] = 1.0 / diloco.site.topology.site_size  # summed over the round's ranks: 1 per site
            diloco.site.all_reduce(present, op="sum")
            self._round = {"step": diloco.outer_steps, "t0": t, "sites": [s for s in range(MAX_SITES)
                                                                         if present[s] > 0.5]}
        x, y = (v.to(self.device) for v in rows(self.index, self.global_rank, t))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        synced = self.trainer.strategy.diloco.synced
        if synced is not None:
            self.syncs.append({**self._round, "t1": self.trainer.global_step, "committed": synced})
        if synced:
            self.rounds.append(self._round)
        elif synced is False:
            self.discarded += 1
        if synced is not None:
            self._round = None
        if self.global_rank == 0:
            with open(os.path.join(self.out, f"{self.name}.progress"), "w") as f:
                f.write(str(self.trainer.global_step))
        # two rounds before the end: a site that joins at the job's last quorum would train past it alone
        if self.hold_until and self.trainer.global_step >= self.trainer.max_steps - 2 * SYNC_EVERY:
            wait_for_file(self.hold_until)
            self.hold_until = None
        time.sleep(self.sleep)

    def on_train_end(self):  # the global parameters, equal on every site (streaming: the local ones are not)
        with self.trainer.strategy.diloco.global_parameters():
            self.global_params = full_parameters(self.net)
        self.sharded = [type(p).__name__ for p in self.net.parameters()]

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # per inner step: travels with the state
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(100_000, 1), batch_size=1)  # the data comes from rows()


def _strategy(args, config: DiLoCoConfig):
    wan = WanConfig(timeout_s=args.timeout_s)
    if args.strategy == "parallel_3d":  # FSDP2 over the site's ranks; the site's name from MULTIDC_SITE
        os.environ["MULTIDC_SITE"] = args.site
        return Parallel3DStrategy(elastic=True, cross_site="diloco", diloco=config, num_sites=args.sites,
                                  dp_shard=int(os.environ["LOCAL_WORLD_SIZE"]), wan=wan)
    return DiLoCoStrategy(elastic=True, diloco=config, site=args.site, num_sites=args.sites, wan=wan)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--ckpt-dir", help="ModelCheckpoint every 2 rounds into this directory")
    parser.add_argument("--resume", help="fit(ckpt_path=...)")
    parser.add_argument("--fragments", type=int, default=1, help="streaming DiLoCo: a round is SYNC_EVERY/fragments")
    parser.add_argument("--overlap", type=int, default=0, help="overlap_steps")
    parser.add_argument("--accelerator", default="cpu", help="gpu: each rank on a GPU, NCCL inside the site")
    parser.add_argument("--strategy", default="diloco", choices=["diloco", "parallel_3d"],
                        help="parallel_3d: FSDP2 over the site's ranks (dp_shard), elastic DiLoCo across sites")
    parser.add_argument("--hold-until", help="two rounds before the end, wait until this file exists (at most 120 s)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    index = int(args.site.removeprefix("site"))
    module = Net(index, args.sleep, args.out, args.site)
    module.hold_until = args.hold_until
    config = DiLoCoConfig(sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                          fragments=args.fragments, overlap_steps=args.overlap)
    trainer = pl.Trainer(
        strategy=_strategy(args, config),
        accelerator=args.accelerator, devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=args.max_steps,
        enable_checkpointing=args.ckpt_dir is not None, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", save_top_k=-1,
                                                every_n_train_steps=2 * SYNC_EVERY)] if args.ckpt_dir else [],
    )
    trainer.fit(module, ckpt_path=args.resume)
    local = full_parameters(module.net)
    torch.save({"site": index, "device": module.trained_on, "params": module.global_params, "local": local,
                "sharded": module.sharded,
                "log": module.rounds, "syncs": module.syncs, "discarded": module.discarded,
                "joined_at": module.joined_at, "first_t": module.first_t, "initial": module.initial,
                "final_step": trainer.global_step},
               os.path.join(args.out, f"{args.site}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
