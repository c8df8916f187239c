"""Pipeline bubble share, measured, next to the theory (p - 1) / (m + p - 1), for GPipe and 1F1B (and interleaved
1F1B with v stages per rank: (p - 1) / (v m + p - 1)).

    python benchmarks/bench_pipeline.py [--stages 2 4] [--microbatches 2 4 8] [--fwd-ms 20] [--repeats 5] \\
        [--plot docs/bench_pipeline.png]

Each stage is a simulated device: its forward holds the stage for ``fwd_ms`` and its backward for ``2 * fwd_ms``
(sleeps, which take no CPU, so p ranks on a 2-core machine do not slow each other down and the figure is the
schedule's, plus real gloo transfers of the activations and gradients). A rank's bubble share for one step is
``1 - busy / wall``: ``busy`` is the time its stages spent computing, ``wall`` the whole ``Pipeline.step``. The
ideal (no transfer cost) is the theory. Printed: median and spread (min..max) over repeats, averaged over ranks,
then one JSON line; with ``--plot``, a PNG of the measured shares next to the theory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from multidc.hierarchical.tools import _figures

ROWS_PER_MICROBATCH, WIDTH = 2, 16


class _Busy(torch.autograd.Function):
    """Identity whose forward and backward each hold the stage for a fixed time, and count it."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        block.hold(block.fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.block.hold(2 * ctx.block.fwd_s)
        return grad.clone(), None


class SimulatedBlock(nn.Module):
    def __init__(self, fwd_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.fwd_s = fwd_s
        self.busy_s = 0.0

    def hold(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy_s += time.perf_counter() - start

    def forward(self, x):
        return _Busy.apply(self.linear(x), self)


def theory(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


def _rank(rank: int, world: int, init: str, configs: list, fwd_s: float, repeats: int, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from multidc.hierarchical.parallel.layout import ParallelLayout
    from multidc.hierarchical.parallel.pipeline import PipelineConfig, build_pipeline, stage_modules

    mesh = ParallelLayout(pipeline_parallel_size=world, world_size=world).build_mesh()
    rows = []
    for schedule, m in configs:
        config = PipelineConfig(schedule=schedule, microbatches=m)
        blocks = [SimulatedBlock(fwd_s) for _ in range(world * config.stages_per_rank)]
        pipeline = build_pipeline(stage_modules(blocks, mesh, config), mesh, config)
        mine = [b for stage in pipeline.modules.values() for b in stage]
        x = torch.randn(m * ROWS_PER_MICROBATCH, WIDTH)
        shares = []
        for step in range(repeats + 1):  # step 0 warms up (shape inference, first transfers)
            for b in mine:
                b.busy_s = 0.0
            dist.barrier()
            start = time.perf_counter()
            pipeline.step(x, x, lambda out, target: out.square().mean())
            wall = time.perf_counter() - start
            if step:
                shares.append(1 - sum(b.busy_s for b in mine) / wall)
        gathered = [None] * world
        dist.all_gather_object(gathered, shares)
        per_repeat = [statistics.mean(r[i] for r in gathered) for i in range(repeats)]  # mean over ranks
        rows.append({
            "schedule": schedule, "p": world, "m": m, "v": config.stages_per_rank,
            "theory": theory(world, m, config.stages_per_rank), "median": statistics.median(per_repeat),
            "min": min(per_repeat), "max": max(per_repeat), "repeats": repeats,
        })
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def run(p: int, configs: list, fwd_s: float, repeats: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdzv')}"
        procs = [ctx.Process(target=_rank, args=(r, p, init, configs, fwd_s, repeats, queue)) for r in range(p)]
        for proc in procs:
            proc.start()
        try:
            rows = queue.get(timeout=600)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--fwd-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interleaved", action="store_true", help="also interleaved 1F1B with 2 stages per rank")
    parser.add_argument("--plot", default=None, help="also draw measured and theoretical shares to this PNG")
    args = parser.parse_args(argv)
    if args.plot:
        try:
            _figures.pyplot()
        except ImportError as exc:
            parser.error(f"--plot {args.plot}: {exc}")
    rows = []
    for p in args.stages:
        configs = []
        for m in args.microbatches:
            configs.append(("gpipe", m))
            if m >= p:
                configs.append(("1f1b", m))
            if args.interleaved and m % p == 0:
                configs.append(("interleaved_1f1b", m))
        rows += run(p, configs, args.fwd_ms / 1000, args.repeats)
    print(f"pipeline bubble share (forward {args.fwd_ms:g} ms, backward {2 * args.fwd_ms:g} ms per stage and "
          f"microbatch; median [min..max] of {args.repeats} steps, mean over ranks)")
    print(f"{'schedule':<18}{'p':>3}{'m':>4}{'v':>3}{'theory':>9}{'measured':>10}{'spread':>18}{'excess':>9}")
    for r in rows:
        spread = f"[{r['min']:.3f}..{r['max']:.3f}]"
        excess = r["median"] - r["theory"]
        print(f"{r['schedule']:<18}{r['p']:>3}{r['m']:>4}{r['v']:>3}{r['theory']:>9.3f}{r['median']:>10.3f}"
              f"{spread:>18}{excess:>+9.3f}")
    if args.plot:
        plot(rows, args.fwd_ms, args.plot)
        print(f"plot: {args.plot}")
    print(json.dumps({"benchmark": "pipeline_bubble", "fwd_ms": args.fwd_ms, "rows": rows}))


def plot(rows: list[dict], fwd_ms: float, path: str) -> None:
    """Draw ``run``'s rows to a PNG at ``path``: per configuration the measured bubble share (median, min-max
    whiskers) beside the theory."""
    plt = _figures.pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    x = range(len(rows))
    colors = {"gpipe": "tab:blue", "1f1b": "tab:orange", "interleaved_1f1b": "tab:green"}
    ax.bar([i - 0.2 for i in x], [r["theory"] for r in rows], 0.4, color="tab:gray", label="theory (p-1)/(vm+p-1)")
    for schedule, color in colors.items():
        mine = [(i, r) for i, r in zip(x, rows) if r["schedule"] == schedule]
        if mine:
            ax.bar([i + 0.2 for i, _ in mine], [r["median"] for _, r in mine], 0.4, color=color,
                   yerr=[[r["median"] - r["min"] for _, r in mine], [r["max"] - r["median"] for _, r in mine]],
                   capsize=3, label=f"{schedule} measured (median, min-max)")
    labels = [f"{r['schedule']}\np={r['p']} m={r['m']}" + (f" v={r['v']}" if r["v"] > 1 else "") for r in rows]
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="idle share of the step", title=f"Pipeline bubble: forward {fwd_ms:g} ms, backward "
                                                  f"{2 * fwd_ms:g} ms per stage and microbatch, gloo")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _figures.save(fig, path)


if __name__ == "__main__":
    main()
