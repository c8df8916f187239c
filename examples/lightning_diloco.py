"""An ordinary Lightning script that trains across sites over a slow WAN with streaming DiLoCo. The multidc lines
are marked ``# multidc``.

    python examples/lightning_diloco.py                               # 4 CPU ranks as 2 sites on this machine
    multidc lab run --sites 2 --ranks-per-site 2 --wan-rate 10mbit -- \\
        python examples/lightning_diloco.py                           # 2 sites joined by a 10 mbit WAN (root)
    torchrun --nnodes 2 --node-rank $SITE --nproc-per-node 4 ... examples/lightning_diloco.py

Inside each site the ranks train as ordinary DDP; every ``--sync-every`` optimizer steps each of the
``--fragments`` parameter fragments is averaged across sites (int8 on the wire), overlapping ``--overlap-steps``
steps of compute. ``strategy="diloco"`` with ``MULTIDC_DILOCO_*`` variables works the same without code.

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

from multidc.hierarchical import DiLoCoConfig  # multidc
from multidc.strategies import DiLoCoStrategy  # multidc


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(  # its 3 children are the blocks DiLoCo deals into fragments
            torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU()),
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()),
            torch.nn.Linear(width, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def on_train_end(self) -> None:  # each rank: its site's parameters, then the sites' consensus
        x, y = held_out()
        with torch.no_grad():
            self.held_out = torch.nn.functional.mse_loss(self.net(x), y).item()
            with self.trainer.strategy.diloco.global_parameters():  # multidc
                self.held_out_global = torch.nn.functional.mse_loss(self.net(x), y).item()


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    return data(512, seed=9)


def data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = 2 sin(x.w) plus noise; w is the same for every seed."""
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(2)) / 4
    return x, (x @ w).sin() * 2 + 0.05 * torch.randn(rows, 1, generator=torch.Generator().manual_seed(seed + 2))


class PrintMetrics(pl.Callback):
    """Prints rank 0's logged metrics every ``every`` optimizer steps (the CSV logger has them all)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % self.every == 0):
            stats = trainer.strategy.diloco.stats  # cumulative; the logger has the per-step wan/* figures
            print(
                f"step {step:4d}  loss {float(trainer.callback_metrics['train_loss']):.4f}  "
                f"WAN {stats.bytes_sent / 2**20:7.3f} MiB sent in {stats.outer_syncs} fragment syncs  "
                f"waited {stats.exposed_s:6.3f} s",
                flush=True,
            )


def main() -> None:
    launched = "LOCAL_WORLD_SIZE" in os.environ  # torchrun / multidc lab run started the ranks
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 4)))
    parser.add_argument("--num-nodes", type=int, default=int(os.environ.get("WORLD_SIZE", 4)) // int(
        os.environ.get("LOCAL_WORLD_SIZE", 4)))
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--overlap-steps", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--out", default="lightning_logs", help="logger directory")
    args = parser.parse_args()
    if not launched:
        os.environ.setdefault("MULTIDC_NUM_SITES", "2")  # multidc: one machine emulates 2 sites

    torch.set_num_threads(1)
    pl.seed_everything(0)
    loader = DataLoader(TensorDataset(*data(4096, seed=1)), batch_size=32, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=DiLoCoStrategy(diloco=DiLoCoConfig(  # multidc: was "ddp"
            sync_every=args.sync_every, fragments=args.fragments, overlap_steps=args.overlap_steps,
            compression="int8")),
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=1,
        default_root_dir=args.out,
        callbacks=[PrintMetrics(every=10)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        topology = trainer.strategy.topology
        sizes = [len(r) for r in topology.layout.site_ranks]
        print(f"done: {trainer.world_size} ranks in {topology.num_sites} sites {sizes}, "
              f"DiLoCo {trainer.strategy.diloco_config}")
        print(f"validation loss: site {topology.site}'s parameters {model.held_out:.4f}, "
              f"global parameters {model.held_out_global:.4f}")


if __name__ == "__main__":
    main()
