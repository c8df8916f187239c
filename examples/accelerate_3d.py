"""Train a small GPT with Hugging Face Accelerate across 2 emulated sites with pipeline (and optionally tensor / FSDP)
parallelism, on CPU.

    accelerate launch --config_file examples/accelerate_config.yaml examples/accelerate_3d.py          # site 2 x pp 2
    accelerate launch --config_file examples/accelerate_config.yaml examples/accelerate_3d.py --pp 1 --tp 2

An ordinary Accelerate loop; the lines marked ``# multidc`` are the changes: the plugin with the layout, the model's
ordered blocks passed to ``prepare``, and ``accelerator.pipeline_step`` in place of forward + ``backward`` (under
pipeline parallelism no rank holds the whole model). The data is generated: token sequences from a fixed random
bigram table, so the loss falls from ln(vocab) towards the table's entropy.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from multidc.plugins import MultiDCAccelerator, MultiDCPlugin  # multidc

# FSDP2 warns when a sharded unit returns a view (nn.Linear over a 3-D input does: the head, and the whole GPT, whose
# output is the head's): only an in-place op on that output would lose its pre-backward hook, and none happens here
# (the pipeline sends stage outputs on as they are; the loss reads them). Exactly that warning, for this model's units:
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP(GPT|Sequential|Block|Embedding)\) returned "
                        r"a view tensor", category=UserWarning)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads  # divided by the tensor-parallel size by the "transformer" plan
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
        self.mlp.up_proj, self.mlp.act, self.mlp.down_proj = nn.Linear(hidden, 4 * hidden), nn.GELU(), \
            nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, seq: int = 16, hidden: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = Embedding(vocab, seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, vocab))

    def pipeline_blocks(self) -> list[nn.Module]:  # multidc: the ordered blocks the pipeline splits into stages
        return [self.embed, *self.layers, self.head]

    def forward(self, tokens):
        for block in self.pipeline_blocks():
            tokens = block(tokens)
        return tokens


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def bigram_data(vocab: int, seq: int, rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    table = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)
    tokens = torch.empty(rows, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=g).squeeze(1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved_1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per data-parallel replica per step")
    args = parser.parse_args()

    plugin = MultiDCPlugin(  # multidc: the layout (dp_shard inferred: the ranks left over in each site)
        num_sites=args.sites, pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp,
        pipeline_schedule=args.schedule, microbatches=args.microbatches,  # used when pp > 1
        tensor_parallel="transformer" if args.tp > 1 else None,  # the common plan on each block's q/k/v/o, up/down
    )
    accelerator = MultiDCAccelerator(multidc_plugin=plugin)  # multidc (was: Accelerator())
    set_seed(0)
    model = GPT()
    replicas = accelerator.layout.dp_size  # multidc: data-parallel replicas (batches per step)
    data = bigram_data(64, 16, rows=args.steps * args.batch_size * replicas)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.print(f"{accelerator.layout.describe()}; loss starts near ln(64) = {math.log(64):.2f}")

    for step, (x, y) in enumerate(loader, start=1):
        loss = accelerator.pipeline_step(model, x, y, next_token_loss)  # multidc: forward + backward
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean_loss = accelerator.gather(loss.reshape(1)).mean().item()
        wan = accelerator.wan_metrics()  # multidc
        if step == 1 or step % 10 == 0:
            accelerator.print(f"step {step:3d}  loss {mean_loss:.3f}  wan {wan.get('wan/bytes_sent', 0) / 1e3:7.1f} "
                              f"kB sent  {wan.get('wan/MBps', 0):6.2f} MB/s")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
