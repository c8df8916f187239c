"""Tiny models and a parity harness for the parallelism tests: one function trains a case on gloo ranks through
``parallelize``, another trains the same case in one process with plain PyTorch, and the test compares them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HIDDEN, HEADS = 32, 4, 16, 2
EVAL_ROWS = 4  # rows of the validation batch; divides every case's microbatch count


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads = HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp = nn.Sequential()
        self.mlp.up_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.mlp.act = nn.GELU()
        self.mlp.down_proj = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = Embed()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = Head()

    def blocks(self):
        return [self.embed, *self.layers, self.head]

    def forward(self, tokens):
        x = tokens
        for block in self.blocks():
            x = block(x)
        return x


class UniformMLP(nn.Module):
    """Identical bias-free blocks with TP-divisible sizes: per-rank memory is exactly full / (tp * pp * shard)."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential() for _ in range(layers))
        for layer in self.layers:
            layer.up_proj = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
            layer.down_proj = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(params):
    opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def reference_run(case: dict) -> dict:
    """The same training in one process, plain PyTorch, on the global batch."""
    torch.manual_seed(0)
    model = TinyGPT(case.get("layers", 2))
    opt, sched = _optimizer(model.parameters())
    losses, norms = [], []
    for step in range(case.get("steps", 3)):
        x, y = batch(step, case["global_batch"])
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case.get("clip", 0.5)).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    x, y = batch(99, case["global_batch"])
    with torch.no_grad():
        eval_loss = loss_fn(model(x[:EVAL_ROWS]), y[:EVAL_ROWS]).item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "eval_loss": eval_loss}



def parallel_run(rank: int, world: int, case: dict) -> dict:
    """Train ``case`` on this gloo rank through ``parallelize``; return what the test compares."""
    from torch.distributed.tensor import DTensor

    from multidc.hierarchical import WanConfig
    from multidc.hierarchical.parallel.layout import ParallelLayout
    from multidc.hierarchical.parallel.parallelize import data_parallel_coordinate, parallelize, prepare_parallel
    from multidc.hierarchical.parallel.pipeline import PipelineConfig

    mesh = ParallelLayout(**case["layout"]).build_mesh()
    torch.manual_seed(0)
    model = TinyGPT(case.get("layers", 2))
    pipeline = PipelineConfig(**case["pipeline"]) if "pipeline" in case else None
    kwargs = dict(
        blocks=model.blocks(), tensor_parallel=case.get("tp"), pipeline=pipeline,
        wan=WanConfig(chunk_mb=0.001, streams=2, compression=case.get("compression", "none")),
    )
    if case.get("optimizer_first"):  # Accelerate's order: optimizer over the full model, then prepare both
        opt, sched = _optimizer(model.parameters())
        pm = prepare_parallel(model, [opt], mesh, **kwargs)
    else:
        pm = parallelize(model, mesh, **kwargs)
        opt, sched = _optimizer(list(pm.parameters()))
    dp_rank, dp = data_parallel_coordinate(mesh)
    losses, norms = [], []
    for step in range(case.get("steps", 3)):
        x, y = batch(step, case["global_batch"])
        rows = case["global_batch"] // dp
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        losses.append(pm.step(x, y, loss_fn).item())
        norms.append(pm.clip_grad_norm_(case.get("clip", 0.5)).item())
        opt.step()
        sched.step()
        opt.zero_grad()
    if pm.pipeline is not None:  # validation through the schedule, on the trained weights
        x, y = batch(99, case["global_batch"])
        out_eval = pm.pipeline.eval_step(x[:EVAL_ROWS], y[:EVAL_ROWS], loss_fn)
    params = {}
    for name, p in model.named_parameters():
        params[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    out = {"losses": losses, "norms": norms, "params": params, "dp_rank": dp_rank}
    if pm.pipeline is not None:
        out["eval_loss"] = out_eval.item()
    out["wan"] = pm.topology.wan_stats.snapshot() if pm.topology is not None else None
    if case.get("no_sync_probe"):  # after the compared state: an accumulation micro-step must not touch the WAN
        pm.set_requires_gradient_sync(False)
        pm.step(x, y, loss_fn)
        out["wan_after_no_sync_step"] = pm.topology.wan_stats.snapshot()
        pm.set_requires_gradient_sync(True)
        pm.step(x, y, loss_fn)
        out["wan_after_sync_step"] = pm.topology.wan_stats.snapshot()
    if case.get("memory"):
        out["memory"] = _memory_case(mesh, pipeline)
    return out


def _memory_case(mesh, pipeline) -> tuple[int, int]:
    """(bytes of parameters this rank stores, bytes of the full model) for ``UniformMLP`` in this layout."""
    from torch.distributed.tensor import DTensor

    from multidc.hierarchical.parallel.parallelize import parallelize

    torch.manual_seed(0)
    model = UniformMLP()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    parallelize(model, mesh, blocks=list(model.layers), tensor_parallel="transformer", pipeline=pipeline)
    storages = {}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values()), full


def assert_parity(results: list[dict], reference: dict, *, rtol: float = 1e-4, atol: float = 2e-5) -> None:
    """Loss (mean over data-parallel replicas), global grad norm and every parameter match the reference."""
    steps = len(reference["losses"])
    for step in range(steps):
        by_replica = {r["dp_rank"]: r["losses"][step] for r in results}
        mean = sum(by_replica.values()) / len(by_replica)
        assert math.isclose(mean, reference["losses"][step], rel_tol=rtol, abs_tol=atol), (step, mean, reference)
        for r in results:
            assert math.isclose(r["norms"][step], reference["norms"][step], rel_tol=rtol, abs_tol=atol)
    for r in results:
        if "eval_loss" in r:
            assert math.isclose(r["eval_loss"], reference["eval_loss"], rel_tol=rtol, abs_tol=atol), r["eval_loss"]
    seen = set()
    for r in results:
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=rtol, atol=atol, msg=name)
            seen.add(name)
    assert seen == set(reference["params"]), set(reference["params"]) - seen
