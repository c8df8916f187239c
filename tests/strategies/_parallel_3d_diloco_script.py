"""Lightning training with ``Parallel3DStrategy(cross_site="diloco")``, run by
tests/strategies/test_parallel_3d_diloco.py:

    python tests/strategies/_parallel_3d_diloco_script.py --config '{"sync_every": 4}' --max-steps 11 \\
        --steps-per-epoch 6 --root DIR --out DIR [--tp 2] [--ckpt-path PATH] [--fits JSON]

4 ranks as 2 sites x tensor parallelism 2 (``configure_model`` applies it; FSDP2 and DiLoCo are the strategy's;
``--tp 1``: sites2 x dp_shard2). ``--fits``: more fits in the same processes afterwards (other settings, layouts,
checkpoints, unequal sites by ``MULTIDC_SITE`` names), each writing DIR/<name>_rank{r}.pt (weights and report, top-k
residuals at the start and end).
The data-parallel replica ``l`` of site ``s`` trains on ``test_parallel_3d_diloco.rows(s, l, k)`` at step ``k`` of
each epoch (``steps_per_epoch`` steps, no sampler), so the single-process reference can replay it.
``ModelCheckpoint`` saves every ``steps_per_epoch`` steps (at an epoch's end, which Lightning resumes exactly).
Every rank writes DIR/rank{r}.json (its site, DiLoCo's stats, the batches this run trained) and
DIR/weights_rank{r}.pt (the full values of its parameters and, read through
``strategy.diloco.global_parameters()``, of the global ones); rank 0's CSV logger holds the WAN metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.hierarchical import DiLoCoConfig
from multidc.hierarchical.parallel import data_parallel_coordinate
from multidc.hierarchical.parallel.parallelize import layout_of
from multidc.strategies import Parallel3DStrategy, apply_tensor_parallel
from tests._gpt_diloco import LR, full, model, rows
from tests._tiny_models import loss_fn


class Net(pl.LightningModule):
    def __init__(self, steps_per_epoch: int) -> None:
        super().__init__()
        self.model = model()
        self.steps_per_epoch = steps_per_epoch
        self.report: dict = {}
        self.batches_run = 0

    def configure_model(self):
        tp_mesh = self.device_mesh["tensor_parallel"]
        if tp_mesh.size() > 1:
            apply_tensor_parallel(self.model.layers, tp_mesh)

    def pipeline_blocks(self):
        return self.model.blocks()

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches_run += 1
        return self.trainer.strategy.pipeline_step(x, y, loss_fn)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        mesh = self.trainer.strategy.device_mesh
        layout = layout_of(mesh)  # the job's; on unequal sites the mesh is this site's
        index, _ = data_parallel_coordinate(mesh)
        site = layout.site_of(dist.get_rank())
        local = index - sum(layout.dp_replicate * d for d in layout.dp_shards[:site])
        batches = [rows(site, local, k) for k in range(1, self.steps_per_epoch + 1)]
        data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        return DataLoader(data, batch_size=len(batches[0][0]))

    def on_train_start(self) -> None:  # after Lightning restored ckpt_path
        self.report["start"] = full(self.model.named_parameters())
        self.report["start_residual"] = residuals(self.trainer.strategy.diloco)

    def validation_step(self, batch, batch_idx):
        self.report["validated"] = full(self.model.named_parameters())  # as the checkpoint loaded them

    def on_train_end(self) -> None:  # DiLoCo still runs: teardown comes after
        diloco = self.trainer.strategy.diloco
        with diloco.global_parameters():
            self.report["global"] = full(self.model.named_parameters())
        self.report["stats"] = vars(diloco.stats)
        self.report["residual"] = residuals(diloco)


def residuals(diloco) -> dict[str, torch.Tensor]:
    """This rank's top-k error-feedback residuals as its checkpoints hold them (``{}`` without top-k)."""
    mine = diloco.state_dict().get("residual", {}).get(f"rank_{dist.get_rank()}", {})
    return {name: value.clone() for name, value in mine.items() if name.startswith("fragment_")}  # not the layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--steps-per-epoch", type=int, default=6)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--root", required=True)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--validate", action="store_true", help="after the fit, a fresh Trainer and module "
                        "validate --ckpt-path (each site must load its own model from the per-site checkpoint)")
    parser.add_argument("--fits", default="[]", help="more fits after the first, in the same processes: a JSON "
                        "list of {name, config, tp, root, ckpt_path}; each writes DIR/<name>_rank{r}.pt")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = {"config": json.loads(args.config), "tp": args.tp, "root": args.root, "ckpt_path": args.ckpt_path}
    weights, info, trainer = fit(spec, args.max_steps, args.steps_per_epoch,
                                 CSVLogger(args.out, name="log", version=0))
    rank = trainer.global_rank
    if args.validate:
        fresh = Net(args.steps_per_epoch)
        loader = DataLoader(TensorDataset(*rows(0, 0, 1)), batch_size=len(rows(0, 0, 1)[0]))
        pl.Trainer(strategy=_strategy(spec), accelerator="cpu", devices=4, use_distributed_sampler=False,
                   logger=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=1).validate(fresh, loader, ckpt_path=args.ckpt_path)
        weights["validated"] = fresh.report["validated"]
    torch.save(weights, os.path.join(args.out, f"weights_rank{rank}.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    for more in json.loads(args.fits):
        weights, info, _ = fit(more, args.max_steps, args.steps_per_epoch, logger=False)
        torch.save({**weights, "info": info}, os.path.join(args.out, f"{more['name']}_rank{rank}.pt"))


def _strategy(spec: dict) -> Parallel3DStrategy:
    return Parallel3DStrategy(num_sites=2, tensor_parallel_size=spec["tp"], cross_site="diloco",
                              diloco=DiLoCoConfig(**spec["config"]))


def fit(spec: dict, max_steps: int, steps_per_epoch: int, logger):
    """One ``Trainer.fit`` of ``spec`` (config, tp, root, ckpt_path; ``sites``: each rank's ``MULTIDC_SITE``, e.g.
    ``"aaab"`` for unequal sites of 3 + 1 ranks): ``(weights, info, trainer)``."""
    if spec.get("sites"):  # as a launcher sets it per rank (Lightning starts the ranks here: rank = LOCAL_RANK)
        os.environ["MULTIDC_SITE"] = spec["sites"][int(os.environ.get("LOCAL_RANK", "0"))]
    try:
        return _fit(spec, max_steps, steps_per_epoch, logger)
    finally:
        os.environ.pop("MULTIDC_SITE", None)


def _fit(spec: dict, max_steps: int, steps_per_epoch: int, logger):
    strategy = _strategy(spec)
    module = Net(steps_per_epoch)
    checkpoints = ModelCheckpoint(dirpath=f"{spec['root']}/ckpts", every_n_train_steps=steps_per_epoch,
                                  save_top_k=-1)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=max_steps,
                         gradient_clip_val=1e9,  # the site's own norm; far above it: no change to the values
                         use_distributed_sampler=False, callbacks=[checkpoints], logger=logger,
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, ckpt_path=spec["ckpt_path"])
    weights = {"local": full(module.model.named_parameters()), "global": module.report["global"],
               "start": module.report["start"], "residual": module.report["residual"],
               "start_residual": module.report["start_residual"]}
    info = {"site": strategy.topology.site, "stats": module.report["stats"], "global_step": trainer.global_step,
            "batches_run": module.batches_run}
    return weights, info, trainer


if __name__ == "__main__":
    main()
