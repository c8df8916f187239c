"""A LightningModule written for Lightning's ``ModelParallelStrategy`` (TP plans and ``fully_shard`` in
``configure_model`` on ``self.device_mesh["tensor_parallel"]`` / ``["data_parallel"]``, asserting, as Lightning's
tensor-parallel example does, that the data-parallel mesh is 1-D), run unchanged under any of:

    python tests/strategies/_model_parallel_script.py --out DIR
                                    # "parallel_3d" from MULTIDC_NUM_SITES=2, MULTIDC_TP_SIZE=2
    python tests/strategies/_model_parallel_script.py --out DIR --strategy model_parallel
                                    # ModelParallelStrategy(dp 2, tp 2)
    python tests/strategies/_model_parallel_script.py --out DIR --strategy parallel_3d [--fsdp-across-sites]
                                                          # Parallel3DStrategy(num_sites=2, dp 2, tp 2)

Every rank writes DIR/weights_rank{r}.pt (full values of its parameters) and DIR/bytes_rank{r}.json: the bytes
this rank's FSDP all-gathers and reduce-scatters sent to ranks of the other site (sites: ``--sites`` contiguous
blocks of ranks, also for ModelParallelStrategy, which has none), what multidc's WAN statistics counted, and the
bytes of this rank's parameter shards.
Rank 0 writes DIR/run.json (losses).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.strategies import Parallel3DStrategy  # importing it registers "parallel_3d"
from tests._tiny_models import TinyGPT, batch, loss_fn

STEPS, ROWS_PER_REPLICA, CLIP = 3, 4, 0.5


class ModelParallelGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT(2)

    def configure_model(self):
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        assert dp_mesh.ndim == 1  # as Lightning's examples/pytorch/tensor_parallel: no hybrid sharding
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


class CrossSiteMeter:
    """Bytes this rank's FSDP all-gathers and reduce-scatters (``dist.all_gather_single`` /
    ``reduce_scatter_single``, what FSDP2 calls) send to ranks of other sites, counted as a direct exchange: an
    all-gather sends this rank's input to each other rank, a reduce-scatter each other rank's output-sized part.
    Exact for the groups of these runs, whose cross-site groups hold one rank per site."""

    def __init__(self, sites: int, world: int) -> None:
        self.site_size, self.bytes = world // sites, 0
        for name, sent in (("all_gather_single", "input"), ("reduce_scatter_single", "output")):
            setattr(dist, name, self._counting(getattr(dist, name), sent))

    def _counting(self, collective, sent: str):
        def counted(*args, **kwargs):
            output, tensor = (kwargs.get("output", args[0] if args else None),
                              kwargs.get("input", args[1] if len(args) > 1 else None))
            ranks = dist.get_process_group_ranks(kwargs["group"])
            mine = dist.get_rank() // self.site_size
            others = sum(r // self.site_size != mine for r in ranks)
            self.bytes += others * (tensor if sent == "input" else output).nbytes
            return collective(*args, **kwargs)

        return counted


def make_strategy(args):
    if args.strategy == "name":
        return "parallel_3d"
    if args.strategy == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp)
    return Parallel3DStrategy(num_sites=args.sites, data_parallel_size=args.dp, tensor_parallel_size=args.tp,
                              fsdp_across_sites=args.fsdp_across_sites)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", choices=("name", "model_parallel", "parallel_3d"), default="name")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--fsdp-across-sites", action="store_true")
    # 0: no clipping (ModelParallelStrategy's clipping, torch's clip_grad_norm_, cannot mix TP and non-TP meshes)
    parser.add_argument("--clip", type=float, default=CLIP)
    args = parser.parse_args()
    torch.set_num_threads(1)
    meter = CrossSiteMeter(args.sites, args.devices)
    pl.seed_everything(0)
    module = ModelParallelGPT()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=make_strategy(args), max_steps=STEPS,
        gradient_clip_val=args.clip or None, logger=CSVLogger(args.out, name="csv"), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    replicas = trainer.strategy.layout.resolve(args.devices).dp_size if args.strategy == "name" else args.dp
    trainer.fit(module, DataLoader(dataset(replicas), batch_size=ROWS_PER_REPLICA))
    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.model.parameters())
    params = module.model.named_parameters()
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in params}
    rank = trainer.global_rank
    torch.save(weights, os.path.join(args.out, f"weights_rank{rank}.pt"))
    topology = getattr(trainer.strategy, "topology", None)
    wan = topology.wan_stats.snapshot()["bytes_sent"] if topology is not None else 0
    with open(os.path.join(args.out, f"bytes_rank{rank}.json"), "w") as f:
        json.dump({"fsdp_cross_site": meter.bytes, "wan_stats": wan, "param_bytes": local}, f)
    if rank == 0:
        with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
            losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump({"losses": losses, "replicas": replicas}, f)


if __name__ == "__main__":
    main()
