"""A small, resumable DDP training job: one rank per process, launched with torchrun-style env.

Gradients go through ``register_ddp_hook`` (hierarchical, sites from ``MULTIDC_SITE``); a checkpoint is committed
every ``--every`` steps with :class:`multidc.plugins.Checkpointer`; a restart with the same command resumes from
the newest committed one. Every rank writes one JSON line per event to stdout::

    {"event": "resumed", "rank": 0, "step": 10}
    {"event": "step", "rank": 0, "step": 11, "loss": 0.123, "t": 1712.5}
    {"event": "saving", "rank": 0, "step": 15, "t": ...}
    {"event": "committed", "rank": 0, "step": 15, "t": ...}
    {"event": "failed", "rank": 0, "error": "RuntimeError", "message": "... WanError: ...", "t": ...}  (exit 1)

The data of a step depends only on the step and the rank, so an interrupted-and-resumed run sees the same
batches as an unbroken one and its losses must match.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical import Topology, WanConfig, register_ddp_hook
from multidc.plugins import Checkpointer, ModelState

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8
LR, MOMENTUM = 0.05, 0.9


def _emit(**event) -> None:
    event.setdefault("t", time.time())
    os.write(1, (json.dumps(event) + "\n").encode())  # one write: ranks may share a terminal


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=gen)
    return x, x[:, :OUT] * 2.0 - x[:, OUT:2 * OUT]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def reference_losses(world: int, steps: int) -> dict[int, float]:
    """Rank 0's loss at every step of an unbroken ``world``-rank run, computed in one process (no DDP)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = {}
    for step in range(1, steps + 1):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            x, y = _batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            for acc, grad in zip(grads, torch.autograd.grad(loss, list(model.parameters()))):
                acc += grad / world
            if rank == 0:
                losses[step] = loss.item()
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad
        optimizer.step()
    return losses


def train(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    wan = WanConfig(timeout_s=args.timeout_s, chunk_mb=args.chunk_mb)
    topology = Topology.build(wan=wan)
    ddp = nn.parallel.DistributedDataParallel(_model(), broadcast_buffers=False)
    register_ddp_hook(ddp, topology, wan=wan)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    ckpt = Checkpointer(args.ckpt, topology=topology)  # waits up to the topology's WanConfig.timeout_s
    state = {"model": ModelState(ddp, optimizer), "trainer": {"step": 0}}
    if args.ckpt_mb:  # ballast, so that a save takes long enough for a fault to land inside it
        state["ballast"] = torch.zeros(int(args.ckpt_mb * (1 << 18)))
    if ckpt.latest() is not None:
        ckpt.load(state)
        _emit(event="resumed", rank=rank, step=state["trainer"]["step"])
    for step in range(state["trainer"]["step"] + 1, args.steps + 1):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        _emit(event="step", rank=rank, step=step, loss=loss.item())
        if step % args.every == 0:
            state["trainer"]["step"] = step
            _emit(event="saving", rank=rank, step=step)
            ckpt.save(state, step=step)
            _emit(event="committed", rank=rank, step=step)
        time.sleep(args.step_sleep)
    ckpt.close()
    topology.close()
    dist.destroy_process_group()
    _emit(event="done", rank=rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint root URL or directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="commit a checkpoint every this many steps")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="WanConfig.timeout_s")
    parser.add_argument("--chunk-mb", type=float, default=0.001, help="small: several WAN chunks per bucket")
    parser.add_argument("--step-sleep", type=float, default=0.1, help="seconds of 'compute' per step")
    parser.add_argument("--ckpt-mb", type=float, default=0.0, help="extra MiB of state in each checkpoint")
    parser.add_argument("--linger-s", type=float, default=0.0,
                        help="after a failure stay alive this long before exiting (a process that catches the error "
                             "and keeps running: its site peers must then time out on their own)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        train(args)
    except Exception as exc:
        _emit(event="failed", rank=int(os.environ.get("RANK", -1)), error=type(exc).__name__, message=str(exc))
        traceback.print_exc()
        time.sleep(args.linger_s)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
