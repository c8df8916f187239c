"""The common transformer-block tensor-parallel plan (Megatron style), applied with ``parallelize_module``.

Inside each block, the projections that fan out (query/key/value, MLP up/gate) are split by output features
(``ColwiseParallel``) and the projections that fan back in (attention output, MLP down) by input features
(``RowwiseParallel``), so each block needs one all-reduce in forward per pair and its output is an ordinary,
replicated tensor: pipeline stages and the rest of the model see plain tensors. Head counts stored on the
attention module are divided by the tensor-parallel size, as the local projections now hold that many heads.

Recognised ``nn.Linear`` names (the last part of the qualified name):

* column-wise: ``q_proj k_proj v_proj wq wk wv query key value up_proj gate_proj w1 w3 fc1 fc_in c_fc``
* row-wise: ``o_proj out_proj wo down_proj w2 fc2 fc_out c_proj proj``

Fused query-key-value projections (``qkv``, ``c_attn``, ``Wqkv``) cannot be split column-wise without reordering
their rows and are refused with a ValueError. Embeddings, norms and the output head stay replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

COLWISE = frozenset(
    "q_proj k_proj v_proj wq wk wv query key value up_proj gate_proj w1 w3 fc1 fc_in c_fc".split()
)
ROWWISE = frozenset("o_proj out_proj wo down_proj w2 fc2 fc_out c_proj proj".split())
FUSED = frozenset("qkv c_attn Wqkv wqkv qkv_proj in_proj".split())
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "n_kv_heads", "num_key_value_heads")
_APPLIED = "_multidc_tensor_parallel_size"  # set on a block once split: a second call must not split it again


def transformer_block_plan(block: nn.Module, tp: int) -> dict:
    """``{qualified name: ParallelStyle}`` for one block (empty when it has no recognised projection, e.g. an
    embedding); ValueError when it cannot be split ``tp`` ways."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in FUSED:
            raise ValueError(
                f"{name!r} looks like a fused query/key/value projection; split it into separate q/k/v "
                f"nn.Linear layers (e.g. q_proj, k_proj, v_proj) for tensor parallelism."
            )
        if not isinstance(module, nn.Linear) or leaf not in COLWISE | ROWWISE:
            continue
        colwise = leaf in COLWISE
        features = module.out_features if colwise else module.in_features
        if features % tp:
            kind = "out_features" if colwise else "in_features"
            raise ValueError(
                f"{name}.{kind}={features} does not divide by tensor_parallel_size={tp}; use a size that does."
            )
        plan[name] = ColwiseParallel() if colwise else RowwiseParallel()
    if plan and not any(isinstance(style, RowwiseParallel) for style in plan.values()):
        raise ValueError(
            f"found no row-wise projection ({sorted(ROWWISE)}) in {type(block).__name__}; the transformer plan "
            f"needs each column-wise split closed by a row-wise one. Pass your own plan to parallelize_module."
        )
    return plan


def apply_tensor_parallel(blocks: Iterable[nn.Module], tp_mesh) -> None:
    """Apply ``transformer_block_plan`` to each block over ``tp_mesh`` (e.g. ``mesh["tensor_parallel"]``).

    Every rank of the tensor-parallel group must call it with the same blocks (parameters are distributed from
    the group's first rank). Blocks without recognised projections (embeddings, heads) are left replicated; a
    one-rank ``tp_mesh`` leaves everything unchanged. Divides ``n_heads``-style attributes (``HEAD_ATTRS``) of
    the split blocks' submodules by the tensor-parallel size. Idempotent: blocks it already split are skipped, so
    a Lightning ``configure_model`` that calls it runs again for ``validate`` / ``test`` after ``fit`` unharmed.

    Raises:
        ValueError: before changing any block, when no block has a recognised projection, sizes do not divide,
            or a block was already split for another tensor-parallel size.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    if tp == 1:
        return
    blocks = list(blocks)
    done = [block for block in blocks if _applied(block) is not None]
    for block in done:
        if _applied(block) != tp:
            raise ValueError(
                f"{type(block).__name__} was already split for tensor_parallel_size={_applied(block)}, "
                f"not {tp}; build the model again to change the size."
            )
    blocks = [block for block in blocks if _applied(block) is None]
    plans = [transformer_block_plan(block, tp) for block in blocks]  # validate everything before changing any
    if not any(plans) and not done:
        raise ValueError(
            f"tensor_parallel_size={tp} but none of the {len(blocks)} blocks has a recognised projection "
            f"(column-wise {sorted(COLWISE)}, row-wise {sorted(ROWWISE)}); rename them or pass your own plan."
        )
    split = [(block, plan) for block, plan in zip(blocks, plans) if plan]
    for block, _ in split:
        _check_heads(block, tp)
    for block, plan in split:
        parallelize_module(block, tp_mesh, plan)
        for module in block.modules():
            for attr in HEAD_ATTRS:
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)
        _mark(block, tp)


def _mark(block: nn.Module, tp: int) -> None:
    """Mark ``block`` and every module in it as split, so a later call given a part of it is not split again."""
    for module in block.modules():
        setattr(module, _APPLIED, tp)


def _applied(block: nn.Module) -> int | None:
    """The size ``block``, or a module inside it, was already split for (a later call given a model that holds
    split blocks must not split them again); ``None`` if none was."""
    return next((getattr(m, _APPLIED) for m in block.modules() if getattr(m, _APPLIED, None) is not None), None)


def _check_heads(block: nn.Module, tp: int) -> None:
    for name, module in block.named_modules():
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and value % tp:
                where = f"{name}.{attr}" if name else attr
                raise ValueError(f"{where}={value} does not divide by tensor_parallel_size={tp}.")
