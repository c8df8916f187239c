"""Screen variants of sparse streaming DiLoCo in one process, cheaply, before a ``multidc bench diloco`` run.

    python benchmarks/screen_sparse_diloco.py --method sparse --codec topk:0.0625:2 [--dim 64] [--error-decay 0.95]

The model, data, inner optimizer and schedule are ``multidc bench diloco``'s (``_bench_model``: 2 sites with their
own topics, each site's batch the rows of its 2 ranks together, AdamW with warm-up and cosine decay); the sites are
model copies in one process and DiLoCo is written out by hand (strided fragments, offsets, tau steps in flight, the
merge that keeps what a site trained while its sync was in flight), so variants the library does not offer can be
tried: error-feedback decay, a site keeping its unsent residual in its own parameters, averaging a value over the
sites that sent it, and two codecs that send no positions (``rand``: the same random ``K`` of each chunk on every
site, ``BITS``-bit values; ``sign``: every value as its sign times the chunk's mean magnitude). Each site encodes
its fragment in ``--shares`` pieces, as its ranks do. It is a screen, not the library: a setting it favours is then
measured with ``multidc bench diloco``. Prints the validation loss (global parameters) every ``--eval-every`` steps
and one JSON line.

Wire bits per parameter per sync (one float32 scale per chunk): ``topk:D:B:C`` ``D * (8 + B) + 32 / C`` (C <= 256);
``rand:K:B:C`` ``(K * B + 32) / C``; ``sign:C`` ``1 + 32 / C``. Bytes per inner step are that over ``--sync-every``;
``multidc bench diloco``'s DDP sends 32 bits per parameter per step, so 1,000x fewer allows about 1.0 bit per
parameter per sync at H = 32.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

import torch

from multidc.hierarchical.compression import get_codec
from multidc.hierarchical.tools._bench_model import TinyGPT, TopicData, next_token_loss

SITES, RANKS, BATCH, SEQ = 2, 2, 8, 64


class _RandK:
    """The same ``k`` random positions of each chunk on every site (a shared seed per sync), values at ``bits``."""

    def __init__(self, k: int, bits: int, chunk: int) -> None:
        self.k, self.chunk, self.values, self.seed = k, chunk, get_codec(f"topk:1.0:{bits}:{k}"), 0

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.pad(x, (0, -x.numel() % self.chunk)).view(-1, self.chunk)
        positions = torch.rand(rows.shape, generator=torch.Generator().manual_seed(self.seed)).topk(self.k).indices
        kept = rows.gather(1, positions).reshape(-1)
        sent = self.values.decode(self.values.encode(kept), kept.numel()).view(-1, self.k)
        return torch.zeros_like(rows).scatter_(1, positions, sent).view(-1)[: x.numel()]


class _Sign:
    """Every value as its sign times its chunk's mean magnitude."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.seed = chunk, 0

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.pad(x, (0, -x.numel() % self.chunk)).view(-1, self.chunk)
        return (rows.sign() * rows.abs().mean(1, keepdim=True)).view(-1)[: x.numel()]


class _Library:
    def __init__(self, name: str) -> None:
        self.codec, self.seed = get_codec(name), 0

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(self.codec.encode(x), x.numel())


def _codec(name: str):
    kind, *fields = name.split(":")
    if kind == "rand":
        return _RandK(*(int(f) for f in fields))
    if kind == "sign":
        return _Sign(int(fields[0]))
    return _Library(name)


def _schedule(steps: int):
    warm = max(1, steps // 20)  # the bench's: linear warm-up over 5%, cosine to a tenth
    return lambda s: (s + 1) / warm if s < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(
        1, steps - warm))))


class _Sites:
    """The sites' model copies, their inner optimizers and the fragments' flat views."""

    def __init__(self, base: TinyGPT, a) -> None:
        self.models = [copy.deepcopy(base) for _ in range(SITES)]
        self.opts = [torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.0) for m in self.models]
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(o, _schedule(a.steps)) for o in self.opts]
        owner = {id(p): i % a.fragments for i, b in enumerate(base.pipeline_blocks()) for p in b.parameters()}
        self.members = [[j for j, p in enumerate(base.parameters()) if owner[id(p)] == f] for f in range(a.fragments)]

    def flat(self, site: int, f: int) -> torch.Tensor:
        params = list(self.models[site].parameters())
        return torch.cat([params[j].detach().reshape(-1).float() for j in self.members[f]])

    def assign(self, site: int, f: int, values: torch.Tensor) -> None:
        params, at = list(self.models[site].parameters()), 0
        for j in self.members[f]:
            p = params[j]
            p.data.copy_(values[at : at + p.numel()].view_as(p))
            at += p.numel()


def _sync(a, sites: _Sites, codec, glob, residuals, f: int, t: int) -> torch.Tensor:
    """Fragment ``f``'s averaged arrival; the residuals keep what each site's codec dropped."""
    sent = []
    for s in range(SITES):
        delta = glob[f] - sites.flat(s, f)
        if a.method != "sparse":
            values = delta
        elif a.keep_residual:  # the site's parameters already lack its residual: delta holds it
            values = delta
        else:
            values = delta + residuals[s][f].mul_(a.error_decay)
        parts = []
        for i, share in enumerate(values.chunk(a.shares)):
            codec.seed = 1_000_003 * t + i  # the same on every site
            parts.append(codec.roundtrip(share))
        sent.append(torch.cat(parts))
        if a.method == "sparse":
            residuals[s][f] = values - sent[-1]
    if a.aggregate == "senders":
        return sum(sent) / sum((x != 0).float() for x in sent).clamp_min(1)
    return sum(sent) / SITES


def _merge(a, sites: _Sites, glob, momentum, residuals, flight) -> None:
    f, _, avg, started = flight
    if a.outer_momentum:  # Nesterov SGD
        momentum[f].mul_(a.outer_momentum).add_(avg)
        glob[f] -= a.outer_lr * (avg + a.outer_momentum * momentum[f])
    else:
        glob[f] -= a.outer_lr * avg
    for s in range(SITES):
        local = sites.flat(s, f)
        if a.method == "sparse":
            new = glob[f] + (local - started[s]) - (residuals[s][f] if a.keep_residual else 0)
        else:
            new = a.alpha * local + (1 - a.alpha) * glob[f]
        sites.assign(s, f, new)


def main(a) -> dict:
    torch.set_num_threads(1)
    data = TopicData(vocab=128, topics=8, seed=0)
    train = [[data.sample(a.steps * BATCH, SEQ + 1, data.site_weights(s, SITES, 0.8), seed=10_000 * (s + 1) + 100 * r)
              for r in range(RANKS)] for s in range(SITES)]
    val = data.sample(64, SEQ + 1, data.mixed_weights(), seed=7)
    rows = lambda s, t: torch.cat([train[s][r][(t - 1) * BATCH : t * BATCH] for r in range(RANKS)])  # noqa: E731
    torch.manual_seed(0)
    base = TinyGPT(vocab=128, dim=a.dim, layers=a.layers, heads=4, seq=SEQ)
    sites = _Sites(base, a)
    codec = None if a.method == "ddp" else _codec(a.codec if a.method == "sparse" else "int8")
    glob = [sites.flat(0, f).clone() for f in range(a.fragments)]
    momentum = [torch.zeros_like(g) for g in glob]
    residuals = [[torch.zeros_like(g) for g in glob] for _ in range(SITES)]
    offsets = [((f + 1) * a.sync_every // a.fragments) % a.sync_every for f in range(a.fragments)]
    curve, flight, started_s = [], None, time.time()
    for t in range(1, a.steps + 1):
        for s in range(SITES) if a.method != "ddp" else []:
            x = rows(s, t)
            sites.opts[s].zero_grad()
            next_token_loss(sites.models[s](x[:, :-1]), x).backward()
            sites.opts[s].step()
            sites.schedules[s].step()
        if a.method == "ddp":  # one model on both sites' rows
            x = torch.cat([rows(s, t) for s in range(SITES)])
            sites.opts[0].zero_grad()
            next_token_loss(sites.models[0](x[:, :-1]), x).backward()
            sites.opts[0].step()
            sites.schedules[0].step()
        elif flight is not None and flight[1] <= t:
            _merge(a, sites, glob, momentum, residuals, flight)
            flight = None
        due = [f for f in range(a.fragments) if t % a.sync_every == offsets[f]] if a.method != "ddp" else []
        for f in due:
            started = [sites.flat(s, f) for s in range(SITES)]
            flight = (f, t + a.overlap_steps, _sync(a, sites, codec, glob, residuals, f, t), started)
            if t == a.steps:  # the run's last sync merges at once
                _merge(a, sites, glob, momentum, residuals, flight)
                flight = None
        if t % a.eval_every == 0 or t == a.steps:
            curve.append((t, _evaluate(a, sites, glob, val)))
            print(t, round(curve[-1][1], 4), f"{time.time() - started_s:.0f}s", file=sys.stderr, flush=True)
    return {"args": vars(a), "curve": curve, "final": curve[-1][1]}


@torch.no_grad()
def _evaluate(a, sites: _Sites, glob, val: torch.Tensor) -> float:
    """Validation loss of the global parameters (DDP: its one model), as the bench evaluates."""
    model = sites.models[0]
    saved = [p.detach().clone() for p in model.parameters()]
    for f in range(a.fragments) if a.method != "ddp" else []:
        sites.assign(0, f, glob[f])
    loss = sum(model.loss(val[i : i + 8]).item() for i in range(0, len(val), 8)) / (len(val) // 8)
    for p, v in zip(model.parameters(), saved):
        p.data.copy_(v)
    return loss


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="sparse", choices=["sparse", "int8", "ddp"],
                   help="sparse streaming DiLoCo, int8 streaming DiLoCo (the bench's settings), or DDP")
    p.add_argument("--codec", default="topk:0.0625:2", help="topk[:D[:B[:C]]], rand:K:B:C or sign:C")
    p.add_argument("--sync-every", type=int, default=32)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap-steps", type=int, default=5)
    p.add_argument("--outer-lr", type=float, default=None, help="default 1 (sparse), 0.7 (int8)")
    p.add_argument("--outer-momentum", type=float, default=None, help="Nesterov; default 0 (sparse), 0.9 (int8)")
    p.add_argument("--alpha", type=float, default=0.5, help="int8's merge weight of the local parameters")
    p.add_argument("--error-decay", type=float, default=1.0, help="residual *= this before each sync")
    p.add_argument("--keep-residual", action="store_true", help="a site keeps its unsent residual in its params")
    p.add_argument("--aggregate", default="mean", choices=["mean", "senders"],
                   help="mean over sites, or over the sites that sent a value")
    p.add_argument("--shares", type=int, default=RANKS, help="pieces each site encodes (its ranks)")
    p.add_argument("--steps", type=int, default=640)
    p.add_argument("--eval-every", type=int, default=160)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args(argv)
    sparse = a.method == "sparse"
    a.outer_lr = a.outer_lr if a.outer_lr is not None else (1.0 if sparse else 0.7)
    a.outer_momentum = a.outer_momentum if a.outer_momentum is not None else (0.0 if sparse else 0.9)
    return a


if __name__ == "__main__":
    print(json.dumps(main(_parse())))
