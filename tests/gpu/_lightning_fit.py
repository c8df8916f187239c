"""One Lightning fit of a small regressor through a multidc strategy, run by tests/gpu/test_cuda.py.

    python tests/gpu/_lightning_fit.py --strategy hierarchical_ddp --accelerator gpu --max-steps 12 \\
        --ckpt-dir DIR --out weights.pt [--resume DIR/step=4.ckpt]

A ``ModelCheckpoint`` every 4 steps goes through the strategy's own checkpointing (multidc's sharded checkpoints,
here to a local folder); the final weights (DiLoCo: the global ones) and their device go to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from multidc.hierarchical import DiLoCoConfig  # noqa: E402
from multidc.strategies import DiLoCoStrategy, HierarchicalDDPStrategy  # noqa: E402

EVERY = 4


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.first_step = None

    def training_step(self, batch, batch_idx):  # data from the step, so a resumed fit sees the same batches
        if self.first_step is None:
            self.first_step = self.global_step
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(self.global_step)).to(self.device)
        return torch.nn.functional.mse_loss(self.net(x), (x[:, :1] * 2).sin())

    def on_train_end(self):  # DiLoCo: the global parameters (the strategy drops its DiLoCo state at teardown)
        diloco = getattr(self.trainer.strategy, "diloco", None)
        with diloco.global_parameters() if diloco is not None else contextlib.nullcontext():
            self.final = {n: p.detach().cpu().clone() for n, p in self.net.named_parameters()}
        self.trained_on = next(self.net.parameters()).device.type  # teardown moves the model back to the CPU

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["hierarchical_ddp", "diloco"], required=True)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--resume")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    pl.seed_everything(1 if args.resume else 0)  # a resumed fit starts from other weights until it restores
    loader = DataLoader(TensorDataset(torch.zeros(1024, 1)), batch_size=32)  # training_step makes the data
    if args.strategy == "hierarchical_ddp":
        strategy = HierarchicalDDPStrategy(num_sites=1)
    else:  # a sync every 2 steps, merged one step later (its transfer runs while the next step computes)
        strategy = DiLoCoStrategy(num_sites=1, diloco=DiLoCoConfig(sync_every=2, overlap_steps=1))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, strategy=strategy, max_steps=args.max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", save_top_k=-1,
                                                every_n_train_steps=EVERY)],
    )
    module = Regressor()
    trainer.fit(module, loader, ckpt_path=args.resume)
    torch.save({"weights": module.final, "device": module.trained_on, "step": trainer.global_step,
                "first_step": module.first_step}, args.out)


if __name__ == "__main__":
    main()
