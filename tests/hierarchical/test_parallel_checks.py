"""Single-process checks of the 3D-parallel helpers (no multi-rank spawn): tied weights across pipeline stages,
tensor-parallel plan errors, where gradient clipping accumulates its norm, and rebinding an optimizer built before
``parallelize`` (on a one-rank gloo group in this process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical.parallel.layout import MESH_AXES, ParallelLayout
from multidc.hierarchical.parallel.parallelize import _check_ties_within_stages, parallelize
from multidc.hierarchical.parallel.pipeline import PipelineConfig, split_blocks
from multidc.hierarchical.parallel.tensor_parallel import apply_tensor_parallel, transformer_block_plan
from tests._tiny_models import HIDDEN, TinyGPT, _optimizer, batch, loss_fn


def _pp_mesh(pp: int):
    """Just enough of a ``build_mesh`` mesh for ``parallelize`` to validate its arguments (which it does first)."""
    return SimpleNamespace(mesh_dim_names=MESH_AXES, shape=(1, pp, 1, 1, 1), size=lambda: pp)


# ------------------------------------------------------------------------------------- tied weights, pipeline
def test_weights_tied_across_pipeline_stages_raise_naming_parameters_stages_and_fix():
    model = TinyGPT(2)
    model.head.out.weight = model.embed.tok.weight  # tied input/output embedding: stage 0 and stage 1
    with pytest.raises(ValueError) as info:
        parallelize(model, _pp_mesh(2), blocks=model.blocks(), pipeline=PipelineConfig(schedule="gpipe"))
    message = str(info.value)
    for words in ("'embed.tok.weight' (block 0, pipeline stage 0)", "'head.out.weight' (block 3, stage 1)",
                  "Untie them", "split_points", "stages now start at blocks [0, 2]"):
        assert words in message, message


def test_weights_tied_inside_one_stage_are_allowed():
    model = TinyGPT(2)
    model.layers[1].mlp.up_proj.weight = model.layers[0].mlp.up_proj.weight
    blocks = model.blocks()
    names = ["embed", "layers.0", "layers.1", "head"]
    _check_ties_within_stages(blocks, names, split_blocks(4, 2, split_points=(3,)))  # layers 0, 1 on stage 0
    with pytest.raises(ValueError, match=r"'layers.0.mlp.up_proj.weight' \(block 1, pipeline stage 0\)"):
        _check_ties_within_stages(blocks, names, split_blocks(4, 2, split_points=(2,)))


# ------------------------------------------------------------------------------------ tensor-parallel plans
class _Attention(nn.Module):
    def __init__(self, heads: int = 2, q_out: int = HIDDEN, o_in: int = HIDDEN, fused: bool = False) -> None:
        super().__init__()
        self.n_heads = heads
        if fused:
            self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        else:
            self.q_proj = nn.Linear(HIDDEN, q_out)
        self.o_proj = nn.Linear(o_in, HIDDEN)


class _Block(nn.Module):
    def __init__(self, attn: nn.Module | None = None, mlp: bool = True) -> None:
        super().__init__()
        self.attn = attn
        if mlp:
            self.up_proj = nn.Linear(HIDDEN, 2 * HIDDEN)


TP_ERRORS = {
    "fused-qkv": (lambda: _Block(_Attention(fused=True)), 2, "'attn.qkv' looks like a fused query/key/value"),
    "colwise-out-features": (lambda: _Block(_Attention(q_out=6, o_in=6)), 4,
                             "attn.q_proj.out_features=6 does not divide by tensor_parallel_size=4"),
    "rowwise-in-features": (lambda: _Block(_Attention(q_out=8, o_in=6)), 4,
                            "attn.o_proj.in_features=6 does not divide by tensor_parallel_size=4"),
    "no-rowwise-layer": (lambda: _Block(None), 2, "found no row-wise projection"),
    "heads-do-not-divide": (lambda: _Block(_Attention(heads=3)), 2,
                            "attn.n_heads=3 does not divide by tensor_parallel_size=2"),
}


@pytest.mark.parametrize("name", list(TP_ERRORS))
def test_tensor_parallel_helper_refuses_blocks_it_cannot_split_before_changing_any(name):
    make, tp, words = TP_ERRORS[name]
    good, bad = _Block(_Attention()), make()
    tp_mesh = SimpleNamespace(size=lambda: tp)  # the errors come before any communication
    with pytest.raises(ValueError) as info:
        apply_tensor_parallel([good, bad], tp_mesh)
    assert words in str(info.value), str(info.value)
    assert good.attn.n_heads == 2 and not any(type(p) is not nn.Parameter for p in good.parameters())


def test_tensor_parallel_helper_refuses_blocks_without_any_known_projection():
    with pytest.raises(ValueError, match="none of the 2 blocks has a recognised projection"):
        apply_tensor_parallel([nn.Embedding(4, HIDDEN), nn.LayerNorm(HIDDEN)], SimpleNamespace(size=lambda: 2))


def test_tensor_parallel_helper_never_splits_a_part_or_a_holder_of_a_split_block_again():
    from multidc.hierarchical.parallel.tensor_parallel import _mark

    block = _Block(_Attention())
    _mark(block, 2)  # what a finished split leaves behind
    holder = nn.Sequential(block)
    for given in (block.attn, holder):  # a child of the split block, a module holding it
        with pytest.raises(ValueError, match="already split for tensor_parallel_size=2, not 4"):
            apply_tensor_parallel([given], SimpleNamespace(size=lambda: 4))
        apply_tensor_parallel([given], SimpleNamespace(size=lambda: 2))  # same size: nothing to do
    assert block.attn.n_heads == 2


def test_transformer_plan_splits_colwise_then_rowwise():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = transformer_block_plan(_Block(_Attention()), 2)
    assert {n: type(s) for n, s in plan.items()} == {
        "attn.q_proj": ColwiseParallel, "attn.o_proj": RowwiseParallel, "up_proj": ColwiseParallel,
    }
    assert transformer_block_plan(nn.Embedding(4, HIDDEN), 2) == {}


# -------------------------------------------------------------------------------------- gradient clipping
def test_clip_accumulates_the_norm_on_the_mesh_device_also_without_gradients(monkeypatch):
    """No host copy per gradient, and a rank with no gradients all-reduces on the mesh's device (NCCL refuses CPU
    tensors). "meta" stands in for a GPU: a .cpu() of a meta tensor raises."""
    from multidc.hierarchical.parallel.grad_clip import clip_grad_norm_

    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: reduced.append(tensor.device))
    mesh = SimpleNamespace(device_type="meta", get_coordinate=lambda: [0] * len(MESH_AXES))
    param = nn.Parameter(torch.empty(4, device="meta"))
    param.grad = torch.empty(4, device="meta")
    assert clip_grad_norm_([param], 1.0, mesh).device.type == "meta"
    assert clip_grad_norm_([nn.Parameter(torch.empty(4, device="meta"))], 1.0, mesh).device.type == "meta"
    assert [d.type for d in reduced] == ["meta", "meta"]


# ---------------------------------------------------------------- optimizer built before parallelize (1 rank)
@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    for name in ("MULTIDC_SITE", "MULTIDC_NUM_SITES", "MULTIDC_DP_SHARD", "MULTIDC_PP_SIZE", "MULTIDC_TP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield ParallelLayout().build_mesh()
    finally:
        dist.destroy_process_group()


def test_optimizer_built_before_parallelize_is_rebound_and_trains_like_plain_pytorch(one_rank):
    torch.manual_seed(0)
    reference = TinyGPT(2)
    ref_opt, _ = _optimizer(reference.parameters())
    torch.manual_seed(0)
    model = TinyGPT(2)
    opt, _ = _optimizer(model.parameters())  # Accelerate's prepare(model) ... prepare(opt) order
    pm = parallelize(model, one_rank, blocks=model.blocks())
    current = {id(p) for p in model.parameters()}
    assert not any(id(p) in current for p in opt.param_groups[0]["params"]), "FSDP replaced every parameter"
    pm.rebind_optimizer(opt)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    pm.rebind_optimizer(opt)  # already the parallelized parameters: unchanged
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    for step in range(2):
        x, y = batch(step, 4)
        for m, o in ((model, opt), (reference, ref_opt)):
            loss_fn(m(x), y).backward()
            o.step()
            o.zero_grad()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].full_tensor(), value, rtol=1e-5, atol=1e-6)


def test_rebinding_refuses_a_stepped_optimizer_and_foreign_parameters(one_rank):
    model = TinyGPT(2)
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(0, 2)
    loss_fn(model(x), y).backward()
    stepped.step()
    stepped.zero_grad()
    foreign = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    pm = parallelize(model, one_rank, blocks=model.blocks())
    with pytest.raises(ValueError, match="has already stepped"):
        pm.rebind_optimizer(stepped)
    with pytest.raises(ValueError, match="holds 1 parameters that are not the model's"):
        pm.rebind_optimizer(foreign)
