"""A LightningModule written for Lightning's ``ModelParallelStrategy`` (TP plans and ``fully_shard`` in
``configure_model`` on ``self.device_mesh["tensor_parallel"]`` / ``["data_parallel"]``), run unchanged with
``strategy="parallel_3d"``. Run by tests/strategies/test_parallel_3d.py:

    python tests/strategies/_model_parallel_script.py --out DIR      # 4 ranks: MULTIDC_NUM_SITES=2, MULTIDC_TP_SIZE=2

Every rank writes DIR/weights_rank{r}.pt (full values of its parameters); rank 0 writes DIR/run.json (losses).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
import multidc.strategies  # noqa: E402,F401  (registers "parallel_3d")
from tests._tiny_models import TinyGPT, batch, loss_fn  # noqa: E402

STEPS, ROWS_PER_REPLICA, CLIP = 3, 4, 0.5


class ModelParallelGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT(2)

    def configure_model(self):
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            plan = {f"attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
            plan.update({"attn.o_proj": RowwiseParallel(), "mlp.up_proj": ColwiseParallel()})
            plan["mlp.down_proj"] = RowwiseParallel()
            parallelize_module(layer, tp_mesh, plan)
            layer.attn.n_heads //= tp_mesh.size()
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.model(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset(replicas: int) -> TensorDataset:
    x, y = zip(*(batch(step, ROWS_PER_REPLICA * replicas) for step in range(STEPS)))
    return TensorDataset(torch.cat(x), torch.cat(y))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    module = ModelParallelGPT()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy="parallel_3d", max_steps=STEPS, gradient_clip_val=CLIP,
        logger=CSVLogger(args.out, name="csv"), log_every_n_steps=1, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False,
    )
    replicas = trainer.strategy.layout.resolve(args.devices).dp_size
    trainer.fit(module, DataLoader(dataset(replicas), batch_size=ROWS_PER_REPLICA))
    params = module.model.named_parameters()
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in params}
    torch.save(weights, os.path.join(args.out, f"weights_rank{trainer.global_rank}.pt"))
    if trainer.global_rank == 0:
        with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
            losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump({"losses": losses, "replicas": replicas}, f)


if __name__ == "__main__":
    main()
