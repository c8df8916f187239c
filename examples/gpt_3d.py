"""Train a small GPT across 2 emulated sites with site x pipeline x tensor (x FSDP) parallelism, on CPU.

    python examples/gpt_3d.py                                  # 8 ranks: 2 sites x pp 2 x tp 2
    python examples/gpt_3d.py --devices 4 --sites 2 --pp 2 --tp 1 --schedule gpipe

An ordinary LightningModule; the lines marked ``# multidc`` are what parallel_3d needs. The data is generated: token
sequences from a fixed random bigram table, so the loss falls from ln(vocab) towards the table's entropy. After
``fit``, ``trainer.validate`` scores held-out sequences with the trained, still parallel model. The script exits
non-zero when the training loss did not fall (last step not below the first).
With ``--out DIR`` rank 0 writes DIR/run.json (per-step losses, validation loss) and every rank
DIR/weights_rank{r}.pt (the full values of the parameters it holds), which tests compare with a one-process run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multidc.strategies import Parallel3DStrategy, apply_tensor_parallel  # multidc

# FSDP2 warns when a sharded unit returns a view (nn.Linear over a 3-D input does, e.g. the head): only an in-place op
# on that output would lose its pre-backward hook, and none happens here (the pipeline sends stage outputs on as they
# are; the loss reads them). Exactly that warning, for the units this model has:
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(Sequential|Head|Block|Embedding)\) returned a "
                        r"view tensor", category=UserWarning)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads  # divided by the tensor-parallel size by apply_tensor_parallel
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential()
        self.mlp.up_proj = nn.Linear(hidden, 4 * hidden)
        self.mlp.act = nn.GELU()
        self.mlp.down_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def next_token_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class GPT(pl.LightningModule):
    def __init__(self, vocab=64, seq=16, hidden=32, heads=4, layers=4, lr=3e-3, max_steps=40) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = Embedding(vocab, seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = Head(vocab, hidden)

    def configure_model(self):  # tensor parallelism, as with Lightning's ModelParallelStrategy
        apply_tensor_parallel(self.layers, self.device_mesh["tensor_parallel"])  # multidc

    def pipeline_blocks(self):  # multidc: the ordered blocks the pipeline splits into stages
        return [self.embed, *self.layers, self.head]

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        loss = self.trainer.strategy.pipeline_step(tokens, target, next_token_loss)  # multidc: not self(tokens)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, target = batch
        loss = self.trainer.strategy.pipeline_eval_step(tokens, target, next_token_loss)  # multidc: not self(tokens)
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup, total = 5, self.hparams.max_steps

        def schedule(step):
            return (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


VAL_BATCHES, VAL_SEED = 4, 1  # per replica; held-out sequences from the same bigram table (other draws)


def bigram_data(vocab: int, seq: int, rows: int, seed: int = 0, sample_seed: int | None = None) -> TensorDataset:
    """Sequences from a fixed random bigram table (from ``seed``) whose rows put most mass on 2 tokens (learnable,
    not trivial); ``sample_seed`` draws other sequences from the same table."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 0.5
    favourites = torch.randint(0, vocab, (vocab, 2), generator=g)
    logits.scatter_(1, favourites, 4.0)
    table = logits.softmax(-1)
    if sample_seed is not None:
        g = torch.Generator().manual_seed(sample_seed)
    tokens = torch.empty(rows, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=g).squeeze(1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu (one GPU per rank, NCCL)")
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per data-parallel replica per step")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    model = GPT(hidden=args.hidden, layers=args.layers, max_steps=args.max_steps)
    data = bigram_data(model.hparams.vocab, model.hparams.seq, rows=4096)
    strategy = Parallel3DStrategy(  # multidc
        num_sites=args.sites, pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp,
        pipeline_schedule=args.schedule, microbatches=args.microbatches,
    )
    out = args.out or os.path.join("bench-results", "gpt_3d")
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        gradient_clip_val=args.clip, logger=CSVLogger(out, name="csv"), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=True,
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=False))
    rows = VAL_BATCHES * args.batch_size * trainer.strategy.layout.dp_size  # full batches on every replica
    val_data = bigram_data(model.hparams.vocab, model.hparams.seq, rows=rows, sample_seed=VAL_SEED)
    (val,) = trainer.validate(model, DataLoader(val_data, batch_size=args.batch_size), verbose=False)
    _report(trainer, model, out, args, val["val_loss"])


def _report(trainer, model, out: str, args, val_loss: float) -> None:
    from torch.distributed.tensor import DTensor

    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    os.makedirs(out, exist_ok=True)
    torch.save(weights, os.path.join(out, f"weights_rank{trainer.global_rank}.pt"))
    if trainer.global_rank != 0:
        return
    metrics_csv = os.path.join(trainer.logger.log_dir, "metrics.csv")
    with open(metrics_csv) as f:
        import csv

        losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
    layout = trainer.strategy.layout.describe()
    wan = trainer.strategy.topology.wan_stats.snapshot() if trainer.strategy.topology is not None else {}
    print(f"layout: {layout}")
    print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f} over {len(losses)} steps (ln vocab = "
          f"{math.log(model.hparams.vocab):.3f}); validation loss {val_loss:.3f}")
    if wan:
        print(f"WAN (rank 0): {wan['bytes_sent'] / 1e6:.2f} MB sent in {wan['calls']} hierarchical all-reduces")
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"losses": losses, "val_loss": val_loss, "layout": layout, "wan": wan, "args": vars(args)}, f)
    if not losses[-1] < losses[0]:
        raise SystemExit(f"the training loss did not fall: first {losses[0]:.4f}, last {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
