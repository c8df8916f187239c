"""An ordinary Lightning training script, run by test_lightning_strategy.py with ``python`` (the strategy
launches its own ranks). The only multidc lines are the import and the strategy name.

    python tests/strategies/_lightning_script.py --strategy hierarchical_ddp --out DIR [--devices 4] [--accumulate 2]
    python tests/strategies/_lightning_script.py --fabric --strategy hierarchical_ddp --out DIR --devices 2

Rank 0 writes DIR/weights.pt (final and initial parameters) and DIR/run.json (what the test checks); the CSV
logger writes DIR/csv/.../metrics.csv. ``--fabric`` trains the same model with ``lightning.fabric.Fabric`` and also
stores a single-process reference trained on the union of the ranks' batches.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import multidc.strategies  # noqa: F401  (registers "hierarchical_ddp")


class TinyRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WanPerBatch(pl.Callback):
    """Test probe: this rank's cumulative WAN bytes after every micro-batch, and whether it was a sync batch."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        topology = getattr(trainer.strategy, "topology", None)
        if topology is not None:
            sent = topology.wan_stats.snapshot()["bytes_sent"]
            self.records.append({"batch": batch_idx, "global_step": trainer.global_step, "bytes_sent": sent})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--fabric", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    x, y = _data()
    if args.fabric:
        return _main_fabric(args, x, y)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    model = TinyRegressor()
    initial = _weights(model)
    probe = WanPerBatch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        logger=CSVLogger(os.path.join(args.out, "csv"), name="run"),
        log_every_n_steps=1,
        callbacks=[probe],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)

    if trainer.global_rank == 0:
        torch.save({"final": _weights(model), "initial": initial}, os.path.join(args.out, "weights.pt"))
        strategy = trainer.strategy
        topology = getattr(strategy, "topology", None)
        report = {
            "strategy_class": type(strategy).__name__,
            "per_batch": probe.records,
            "progress_bar_metrics": sorted(trainer.progress_bar_metrics),
            "metrics_csv": trainer.logger.experiment.metrics_file_path,
            "site_sizes": [len(r) for r in topology.layout.site_ranks] if topology is not None else None,
            "wan": vars(strategy.wan) if hasattr(strategy, "wan") else None,
            "world_size": trainer.world_size,
        }
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump(report, f, default=str)


def _main_fabric(args, x: torch.Tensor, y: torch.Tensor) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)
    fabric.launch()
    model = TinyRegressor().net
    reference = TinyRegressor().net
    reference.load_state_dict(model.state_dict())
    initial = _weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    per_rank, world, metrics = 4, fabric.world_size, []
    for step in range(args.max_steps):
        batch = slice(step * per_rank * world, (step + 1) * per_rank * world)
        mine = slice(batch.start + fabric.global_rank * per_rank, batch.start + (fabric.global_rank + 1) * per_rank)
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]))
        optimizer.step()
        metrics.append(fabric.strategy.wan_metrics() if hasattr(fabric.strategy, "wan_metrics") else {})
        # Reference: one process, the mean of the ranks' mean losses (what DDP's averaged gradient descends).
        ref_optimizer.zero_grad()
        chunks = zip(x[batch].split(per_rank), y[batch].split(per_rank))
        (sum(torch.nn.functional.mse_loss(reference(a), b) for a, b in chunks) / world).backward()
        ref_optimizer.step()
    if fabric.global_rank == 0:
        weights = {"final": _weights(model.module), "initial": initial, "reference": _weights(reference)}
        torch.save(weights, os.path.join(args.out, "weights.pt"))
        report = {"strategy_class": type(fabric.strategy).__name__, "wan_metrics": metrics}
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump(report, f)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    return x, x.sum(dim=1, keepdim=True).sin()


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


if __name__ == "__main__":
    main()
