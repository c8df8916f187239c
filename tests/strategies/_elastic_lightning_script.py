"""One site of an elastic Lightning job, run by tests/strategies/test_elastic_strategy.py (one ``torchrun`` per
site, ``Trainer(strategy=HierarchicalDDPStrategy(elastic=True))`` over that site's ranks).

    torchrun --nproc-per-node K --master-port P tests/strategies/_elastic_lightning_script.py --site site1 \\
        --sites 2 --max-steps 120 --out DIR

Each rank trains ``tests.hierarchical.elastic_reference.model()`` with SGD on ``rows(site, local rank, step)``
where ``step`` is the job's committed step (``trainer.global_step``), so a single-process replay can check it.
Every committed step is logged with the sites that took part; each rank writes DIR/<site>_rank<r>.pt at the end
and DIR/<site>.progress as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
import lightning.pytorch as pl  # noqa: E402

from multidc.hierarchical import WanConfig  # noqa: E402
from multidc.strategies import HierarchicalDDPStrategy, Parallel3DStrategy  # noqa: E402
from tests.hierarchical.elastic_reference import (  # noqa: E402
    LR,
    MAX_SITES,
    fail_after_sync,
    full_parameters,
    lr_factor,
    model,
    record_writes,
    rows,
    wait_for_file,
)


class Net(pl.LightningModule):
    def __init__(self, index: int, sleep: float, out: str, name: str, interval: str, stall: tuple[int, float]) -> None:
        super().__init__()
        self.net, self.index, self.sleep, self.out, self.name = model(), index, sleep, out, name
        self.interval, self.stall, self.discarded = interval, stall, 0
        self.log_steps, self.initial, self.joined_at = [], None, None
        self.setup_s, self.first_quorum_s, self.trained_on = 0.0, None, None
        self.discard_at, self.rng_at_save, self.hold_until = -1, {}, None
        self.num_sites = 0

    def on_fit_start(self):  # after the strategy's setup built the site: more setup (data, a sanity check)
        assert self.trainer.strategy.elastic_site is not None
        if self.discard_at >= 0:
            fail_after_sync(self.trainer.strategy.elastic_site, self.discard_at)
        if self.global_rank == 0:
            open(os.path.join(self.out, f"{self.name}.built"), "w").close()
        time.sleep(self.setup_s)

    def on_train_start(self):
        self._train_start = time.monotonic()

    def on_train_batch_start(self, batch, batch_idx):
        torch.rand(1)  # as a data pipeline would: the streams move on between a save and the next step's quorum

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        step = self.trainer.global_step  # the job's committed steps, also right after a rejoin
        if self.joined_at is None:  # the first quorum came before this (optimizer_step, before the closure)
            self.joined_at, self.first_quorum_s = step, time.monotonic() - self._train_start
            self.initial = full_parameters(self.net)
            self.trained_on = self.device.type
        site = strategy.elastic_site
        present = torch.zeros(MAX_SITES, device=self.device)  # on the GPU with NCCL inside the site
        present[self.index] = 1.0 / site.topology.site_size  # summed over the step's ranks: 1 per member of a site
        site.all_reduce(present, op="sum")
        self.num_sites = site.num_sites
        self._pending = (step, [s for s in range(MAX_SITES) if present[s] > 0.5],
                         [s for s in range(MAX_SITES) if present[s] > 1.5])  # a site present twice
        if step == self.stall[0]:  # once (the retried step goes through), longer than the WAN timeout
            seconds, self.stall = self.stall[1], (-1, 0.0)
            time.sleep(seconds)
        x, y = (t.to(self.device) for t in rows(self.index, self.global_rank, step))
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # after ModelCheckpoint's
        if self.trainer.global_step % 10 == 0:
            self.rng_at_save[self.trainer.global_step] = torch.get_rng_state()
        if self.trainer.strategy.elastic_committed:
            step, sites, twice = self._pending
            self.log_steps.append({"step": step, "sites": sites, "twice": twice})
        else:
            self.discarded += 1
        if self.global_rank == 0:
            with open(os.path.join(self.out, f"{self.name}.progress"), "w") as f:
                f.write(str(self.trainer.global_step))
        if self.hold_until and self.trainer.global_step >= self.trainer.max_steps - 1:
            wait_for_file(self.hold_until)
        time.sleep(self.sleep)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # stepped once per committed step
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(100_000, 1), batch_size=1)  # the data comes from rows()


def _strategy(args):
    wan = WanConfig(timeout_s=args.timeout_s)
    if args.strategy == "parallel_3d":  # FSDP2 over the site's ranks; the site's name from MULTIDC_SITE
        os.environ["MULTIDC_SITE"] = args.site
        return Parallel3DStrategy(elastic=True, num_sites=args.sites, dp_shard=int(os.environ["LOCAL_WORLD_SIZE"]),
                                  wan=wan)
    return HierarchicalDDPStrategy(elastic=True, site=args.site, num_sites=args.sites, wan=wan)


def _precision(precision: str) -> list:
    """Lightning turns '16-mixed' into bf16 on CPU: build fp16 loss scaling explicitly to check its refusal."""
    if precision == "32-true":
        return []
    from lightning.pytorch.plugins import MixedPrecision

    return [MixedPrecision(precision, "cpu", scaler=torch.amp.GradScaler("cpu"))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--sites", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--interval", default="step", help="the LR scheduler's interval")
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--stall-at", type=int, default=-1, help="the job step at which this site stalls")
    parser.add_argument("--stall-s", type=float, default=0.0)
    parser.add_argument("--ckpt-dir", help="ModelCheckpoint every 10 steps into this directory")
    parser.add_argument("--resume", help="fit(ckpt_path=...)")
    parser.add_argument("--setup-s", type=float, default=0.0, help="sleep in on_fit_start (after the strategy's "
                        "setup); rank 0 writes DIR/<site>.built before")
    parser.add_argument("--accelerator", default="cpu", help="gpu: each rank on a GPU, NCCL inside the site")
    parser.add_argument("--discard-at", type=int, default=-1, help="the job step this site discards, once, after its "
                        "transfers completed (the other sites commit it)")
    parser.add_argument("--hold-until", help="before the last step, wait until this file exists (at most 120 s)")
    parser.add_argument("--strategy", default="hierarchical_ddp", choices=["hierarchical_ddp", "parallel_3d"],
                        help="parallel_3d: FSDP2 over the site's ranks (dp_shard), elastic across sites")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    index = int(args.site.removeprefix("site"))
    module = Net(index, args.sleep, args.out, args.site, args.interval, (args.stall_at, args.stall_s))
    module.setup_s, module.discard_at, module.hold_until = args.setup_s, args.discard_at, args.hold_until
    module.written = record_writes()
    trainer = pl.Trainer(
        strategy=_strategy(args),
        accelerator=args.accelerator, devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=args.max_steps,
        plugins=_precision(args.precision), logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=args.ckpt_dir is not None,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=10,
                                                save_top_k=-1)] if args.ckpt_dir else [],
    )
    trainer.fit(module, ckpt_path=args.resume)
    params = full_parameters(module.net)
    torch.save({"site": index, "device": module.trained_on, "params": params, "log": module.log_steps,
                "num_sites": module.num_sites, "sharded": [type(p).__name__ for p in module.net.parameters()],
                "discarded": module.discarded, "joined_at": module.joined_at, "initial": module.initial,
                "written": module.written, "rng_at_save": module.rng_at_save,
                "first_quorum_s": module.first_quorum_s, "final_step": trainer.global_step,
                "wan": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("wan/")}},
               os.path.join(args.out, f"{args.site}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
