"""Lightning training with ``DiLoCoStrategy``, run by tests/strategies/test_diloco_strategy.py.

    python tests/strategies/_diloco_script.py --devices 4 --sites 2 --config '{"sync_every": 4}' --max-steps 11 \\
        --accumulate 2 --root DIR --out DIR [--ckpt-path PATH]

Each rank trains the model of tests/hierarchical/test_diloco.py on its own rows: micro-batch ``k`` of rank
(site ``s``, local rank ``l``) is ``test_diloco._rows(s, l, k)``, ``steps_per_epoch`` optimizer steps per epoch, in
order (no sampler), so a single-process reference can replay it. ``ModelCheckpoint`` saves every
``steps_per_epoch`` steps (at an epoch's end, which Lightning resumes exactly). Every rank writes
DIR/rank{r}.json (its site, DiLoCo's stats, the WAN bytes sent before the first step) and DIR/weights_rank{r}.pt
(its parameters and, read through ``strategy.diloco.global_parameters()``, the global ones); rank 0's CSV logger
holds the WAN metrics. ``--sleep-site1 S``: site 1's ranks sleep S seconds per training step (a slow site, for
rounds by time); ``--no-checkpoints``: no ``ModelCheckpoint`` (with rounds by time the sites' step counts differ);
``--default-trainer``: ``Trainer(strategy, accelerator, devices)`` and nothing else set, then exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.hierarchical import DiLoCoConfig
from multidc.strategies import DiLoCoStrategy
from tests.diloco_reference import LR
from tests.diloco_reference import model as _model
from tests.diloco_reference import rows as _rows


class Net(pl.LightningModule):
    def __init__(self, micro_batches: int, sleep_site1: float = 0.0) -> None:
        super().__init__()
        self.net = _model()
        self.micro_batches = micro_batches
        self.sleep_site1 = sleep_site1
        self.report: dict = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.sleep_site1 and self.trainer.strategy.topology.site == 1:
            time.sleep(self.sleep_site1)
        self.trainer.strategy.diloco.count(len(x))  # as the guide shows; equal sites: the plain mean, bitwise
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        strategy = self.trainer.strategy
        site, local = strategy.topology.site, strategy.topology.local_rank_in_site
        rows = [_rows(site, local, k) for k in range(1, self.micro_batches + 1)]
        data = TensorDataset(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))
        return DataLoader(data, batch_size=len(rows[0][0]))

    def on_train_start(self) -> None:  # DiLoCo started in setup: what its start sent over the WAN
        self.report["start_bytes"] = self.trainer.strategy.topology.wan_stats.snapshot()["bytes_sent"]

    def on_train_end(self) -> None:  # DiLoCo still runs: teardown comes after
        diloco = self.trainer.strategy.diloco
        with diloco.global_parameters():
            self.report["global"] = {n: p.detach().clone() for n, p in self.net.named_parameters()}
        self.report["stats"] = dataclasses.asdict(diloco.stats)
        self.report["plans"] = diloco.round_plans
        self.report["diloco_should_stop"] = diloco.should_stop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--config", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps-per-epoch", type=int, default=6)
    parser.add_argument("--root", required=True)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sleep-site1", type=float, default=0.0)
    parser.add_argument("--no-checkpoints", action="store_true")
    parser.add_argument("--default-trainer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = DiLoCoStrategy(num_sites=args.sites, diloco=DiLoCoConfig(**json.loads(args.config)))
    module = Net(args.steps_per_epoch * args.accumulate, args.sleep_site1)
    checkpoints = ModelCheckpoint(dirpath=f"{args.root}/ckpts", every_n_train_steps=args.steps_per_epoch,
                                  save_top_k=-1)
    if args.default_trainer:  # the Trainer's defaults but for the strategy and the devices
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices).fit(module)
        return
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.max_steps,
                         accumulate_grad_batches=args.accumulate, use_distributed_sampler=False,
                         callbacks=[] if args.no_checkpoints else [checkpoints],
                         enable_checkpointing=not args.no_checkpoints,  # else Lightning's default saves per epoch
                         logger=CSVLogger(args.out, name="log", version=0),
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, ckpt_path=args.ckpt_path)
    rank = trainer.global_rank
    local = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    torch.save({"local": local, "global": module.report["global"]}, os.path.join(args.out, f"weights_rank{rank}.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"site": strategy.topology.site, "stats": module.report["stats"],
                   "start_bytes": module.report["start_bytes"], "global_step": trainer.global_step,
                   "plans": module.report["plans"], "should_stop": trainer.should_stop,
                   "diloco_should_stop": module.report["diloco_should_stop"]}, f)


if __name__ == "__main__":
    main()
