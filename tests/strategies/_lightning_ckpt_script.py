"""Lightning training that checkpoints through a multidc strategy, run by tests/strategies/test_lightning_checkpoint.py.

    python tests/strategies/_lightning_ckpt_script.py --strategy hierarchical_ddp --devices 4 --root s3://b/run \\
        --max-steps 8 --every 4 --out DIR [--ckpt-path last] [--async]
    python tests/strategies/_lightning_ckpt_script.py --strategy parallel_3d --devices 4 --pp 2 --root /tmp/run \\
        --max-steps 2 --out DIR [--ckpt-path last]
    python tests/strategies/_lightning_ckpt_script.py --strategy diloco --devices 2 --root 's3://b-{site}/run' \\
        --max-steps 12 --every 4 --top-k -1 --replicas 1 --out DIR [--ckpt-path PATH]

``hierarchical_ddp`` trains a small regressor (AdamW, per-step LR schedule) with ``ModelCheckpoint(dirpath=
<root>/ckpts, every_n_train_steps=--every, save_last=True, save_top_k=--top-k)``; ``diloco`` the same under DiLoCo
(one site per rank, a sync every 5 steps, ``checkpoint_replicas=--replicas``); a ``--root`` that is a JSON object
site -> URL gives ``ModelCheckpoint`` a mapping (each URL + ``/ckpts``); ``parallel_3d`` trains a tiny GPT (pipeline
when ``--pp 2``, FSDP2 over 2 data-parallel shards) with ``default_root_dir=<root>`` and a ``ModelCheckpoint``
without dirpath (so ``<root>/checkpoints``). Saves happen at the last batch of an epoch (``--every`` = steps per
epoch): Lightning itself resumes a checkpoint written at ``on_train_epoch_end`` one batch short of the next epoch.
The global batch is 16 rows (regressor) or 8 (GPT) per step whatever the number of ranks, so runs on different
layouts follow the same trajectory. Every rank writes DIR/rank{r}.json (global loss per step, RNG fingerprints at
each save and after the load, the resolved checkpoint path, the LR) and DIR/weights_rank{r}.pt (full values of the
parameters it holds); at exit, DIR/exit_rank{r}.json (tests/_exit_probe.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from tests import _exit_probe  # noqa: I001  (before multidc: its exit handler must run first)
from multidc.hierarchical import DiLoCoConfig
from multidc.strategies import DiLoCoStrategy, HierarchicalDDPStrategy, Parallel3DStrategy
from tests._tiny_models import TinyGPT, batch, loss_fn

REGRESSOR_ROWS, GPT_ROWS = 16, 8  # global batch per step


def rng_fingerprint() -> str:
    """One hash over torch's, Python's and NumPy's random state."""
    digest = hashlib.sha1(torch.get_rng_state().numpy().tobytes())
    digest.update(repr(random.getstate()).encode())
    digest.update(np.random.get_state()[1].tobytes())
    return digest.hexdigest()[:16]


class Probe(pl.LightningModule):
    """What the test reads: global loss per step, RNG state at every save and right after the load."""

    def __init__(self) -> None:
        super().__init__()
        self.report = {"losses": {}, "saved_rng": {}, "loaded_rng": None}

    def on_fit_start(self) -> None:
        rank = self.global_rank  # distinct streams per rank, so the test sees which saved rank each one resumed
        torch.manual_seed(1000 + rank), random.seed(1000 + rank), np.random.seed(1000 + rank)

    def record_loss(self, loss: torch.Tensor) -> None:
        self.report["losses"][self.trainer.global_step + 1] = self.all_gather(loss.detach()).mean().item()

    def on_save_checkpoint(self, checkpoint) -> None:
        self.report["saved_rng"][checkpoint["global_step"]] = rng_fingerprint()

    def on_load_checkpoint(self, checkpoint) -> None:  # after the strategy loaded the checkpoint (and RNG)
        self.report["loaded_rng"] = rng_fingerprint()

    def configure_optimizers(self):
        optimizer = self.make_optimizer()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.1 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Regressor(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def make_optimizer(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.record_loss(loss)
        return loss


class GPT(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT(2)

    def pipeline_blocks(self):
        return self.model.blocks()

    def forward(self, tokens):
        return self.model(tokens)

    def make_optimizer(self):  # not Adam: attention's key bias has a zero gradient, which Adam turns into noise
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.trainer.strategy.pipeline_step(x, y, loss_fn)
        self.record_loss(loss)
        return loss


def regressor_data() -> TensorDataset:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))  # 4 steps per epoch
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def gpt_data() -> TensorDataset:
    x, y = zip(*(batch(step, GPT_ROWS) for step in range(2)))  # 2 steps per epoch
    return TensorDataset(torch.cat(x), torch.cat(y))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["hierarchical_ddp", "diloco", "parallel_3d"], required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--root", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _exit_probe.report_to(os.path.join(args.out, f"exit_rank{os.environ.get('LOCAL_RANK', '0')}.json"))
    torch.set_num_threads(1)
    pl.seed_everything(0)
    common = dict(accelerator="cpu", devices=args.devices, max_steps=args.max_steps, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    if args.strategy in ("hierarchical_ddp", "diloco"):
        module, data, rows = Regressor(), regressor_data(), REGRESSOR_ROWS
        if args.strategy == "diloco":  # one site per rank
            strategy = DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=5), num_sites=args.devices,
                                      checkpoint_async=args.async_save, checkpoint_replicas=args.replicas)
        else:
            strategy = HierarchicalDDPStrategy(checkpoint_async=args.async_save)  # sites: MULTIDC_NUM_SITES
        root = json.loads(args.root) if args.root.startswith("{") else args.root  # a mapping site -> URL
        dirpath = {s: f"{u}/ckpts" for s, u in root.items()} if isinstance(root, dict) else f"{root}/ckpts"
        callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_last=True,
                                   save_top_k=args.top_k)  # built after the strategy: a mapping needs its hooks
        trainer = pl.Trainer(strategy=strategy, callbacks=[callback], **common)
        replicas = args.devices
    else:
        module, data, rows = GPT(), gpt_data(), GPT_ROWS
        strategy = Parallel3DStrategy(pipeline_parallel_size=args.pp, dp_shard=2, pipeline_schedule="gpipe",
                                      microbatches=2, checkpoint_async=args.async_save)
        callback = ModelCheckpoint(every_n_train_steps=args.every)
        trainer = pl.Trainer(strategy=strategy, callbacks=[callback], default_root_dir=args.root, **common)
        replicas = 2
    trainer.fit(module, DataLoader(data, batch_size=rows // replicas), ckpt_path=args.ckpt_path)

    params = module.named_parameters()
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in params}
    torch.save(weights, os.path.join(args.out, f"weights_rank{trainer.global_rank}.pt"))
    optimizer = trainer.optimizers[0]
    report = {**module.report, "ckpt_path": trainer.ckpt_path, "global_step": trainer.global_step,
              "epoch": trainer.current_epoch, "lr": optimizer.param_groups[0]["lr"], "world_size": trainer.world_size}
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
