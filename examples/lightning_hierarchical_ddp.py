"""An ordinary Lightning script that trains across sites. The multidc lines are marked ``# multidc``.

    python examples/lightning_hierarchical_ddp.py                     # 4 CPU ranks as 2 sites on this machine
    multidc lab run --sites 2 --ranks-per-site 2 --wan-rate 400mbit -- \\
        python examples/lightning_hierarchical_ddp.py                 # 2 sites joined by a shaped WAN (root)
    torchrun --nnodes 2 --node-rank $SITE --nproc-per-node 4 ... examples/lightning_hierarchical_ddp.py

Launched by itself it starts ``--devices`` ranks and splits them into ``MULTIDC_NUM_SITES`` (default here: 2)
contiguous sites. Under a launcher (``multidc lab run``, ``torchrun``: ``LOCAL_WORLD_SIZE`` is set) each node is
one site (``MULTIDC_SITE``, set by ``multidc lab run``; set it yourself with torchrun) and devices / num_nodes come
from the launcher's environment. The data is generated: y = 2 sin(x.w) plus noise. Per step it prints the loss
and the WAN figures the strategy logs (bytes sent between sites, WAN throughput, time waited on the WAN).
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import multidc.strategies  # noqa: F401  # multidc: registers "hierarchical_ddp"


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU(),
            torch.nn.Linear(width, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class PrintMetrics(pl.Callback):
    """Prints rank 0's logged metrics every ``every`` optimizer steps (the CSV logger has them all)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % self.every == 0):
            m = {k: float(v) for k, v in trainer.callback_metrics.items()}
            print(
                f"step {step:4d}  loss {m.get('train_loss', float('nan')):.4f}  "
                f"WAN {m.get('wan/bytes_sent', 0.0) / 2**20:6.2f} MiB/step  "
                f"{m.get('wan/MBps', 0.0):7.1f} MB/s  waited {m.get('wan/wait_s', 0.0) * 1e3:6.1f} ms",
                flush=True,
            )


def main() -> None:
    launched = "LOCAL_WORLD_SIZE" in os.environ  # torchrun / multidc lab run started the ranks
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 4)))
    parser.add_argument("--num-nodes", type=int, default=int(os.environ.get("WORLD_SIZE", 4)) // int(
        os.environ.get("LOCAL_WORLD_SIZE", 4)))
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--out", default="lightning_logs", help="logger directory")
    args = parser.parse_args()
    if not launched:
        os.environ.setdefault("MULTIDC_NUM_SITES", "2")  # multidc: one machine emulates 2 sites

    torch.set_num_threads(1)
    pl.seed_everything(0)
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(2)) / 4
    y = (x @ w).sin() * 2 + 0.05 * torch.randn(4096, 1, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="hierarchical_ddp",  # multidc: was "ddp"
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=1,
        default_root_dir=args.out,
        callbacks=[PrintMetrics(every=10)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader)
    if trainer.is_global_zero:
        topology = trainer.strategy.topology
        sizes = [len(r) for r in topology.layout.site_ranks]
        print(f"done: {trainer.world_size} ranks in {topology.num_sites} sites {sizes}, "
              f"WAN settings {trainer.strategy.wan}")


if __name__ == "__main__":
    main()
