"""Resuming from multidc checkpoints on gloo ranks: every pipeline stage gets its own optimizer back, and a save
that cannot go ahead fails on every rank at once. Both run in one 2-rank spawn (starting ranks is the slow part).

The pipeline case runs ``MultiDCAccelerator`` with pipeline_parallel_size=2 on 2 ranks: AdamW with one parameter
group per stage and one spanning both (different lr, betas, weight decay), trained 4 steps unbroken with a save
before step 2, then a fresh model resumed from that save into the same layout and trained on. The unbroken run
is the reference: optimizer hyper-parameters must match it right after the load, weights after the last step.
"""

from __future__ import annotations

import time

import pytest
import torch

from multidc.hierarchical.tools.ranks import run_ranks
from multidc.plugins import Checkpointer, latest, list_checkpoints
from tests._resources import require_module
from tests._tiny_models import TinyGPT, batch, loss_fn

pytestmark = pytest.mark.timeout(120)
GLOBAL_BATCH, STEPS, SAVE_AT = 8, 4, 2
GROUPS = (  # (which parameters, hyper-parameters): stage 0's matrices, stage 1's matrices, every vector
    ("stage0", dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)),
    ("stage1", dict(lr=0.02, betas=(0.8, 0.9), weight_decay=0.05)),
    ("vectors", dict(lr=0.005, betas=(0.85, 0.99), weight_decay=0.0)),
)


def _launch_env(world: int) -> list[dict]:
    return [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
            for r in range(world)]


def _prepared(accelerator, seed: int):
    """TinyGPT (stage 0: embed, layer 0; stage 1: layer 1, head) with per-stage AdamW groups, prepared for pp2."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    model = TinyGPT(2)
    blocks = model.blocks()
    stage0 = {id(p) for block in blocks[:2] for p in block.parameters()}
    params = {"stage0": [], "stage1": [], "vectors": []}
    for p in model.parameters():
        params["vectors" if p.ndim < 2 else "stage0" if id(p) in stage0 else "stage1"].append(p)
    opt = torch.optim.AdamW([{"params": params[name], **hyper} for name, hyper in GROUPS])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x, y = zip(*(batch(step, GLOBAL_BATCH) for step in range(STEPS)))
    loader = DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=GLOBAL_BATCH)
    return accelerator.prepare(model, opt, loader, sched, blocks=blocks)


def _hyper(opt) -> list[dict | None]:
    """Each group's hyper-parameters; ``None`` for a group with no parameters on this stage (nothing to restore)."""
    return [{k: v for k, v in g.items() if k != "params"} if g["params"] else None for g in opt.param_groups]


def _weights(accelerator, model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in accelerator.unwrap_model(model).named_parameters()}


def _train_steps(accelerator, model, opt, sched, loader, first: int, on_step=None) -> None:
    for step, (x, y) in enumerate(loader):
        if step < first:
            continue
        if on_step is not None:
            on_step(step)
        accelerator.pipeline_step(model, x, y, loss_fn)
        opt.step()
        sched.step()
        opt.zero_grad()


def _pipeline_save_and_resume(rank, world, url):
    from tests.plugins._accelerate_ckpt import fresh_accelerator

    plugin = dict(pipeline_parallel_size=2, microbatches=2)
    out = {}
    with fresh_accelerator(None, plugin, step_scheduler_with_optimizer=False) as acc:
        model, opt, loader, sched = _prepared(acc, seed=0)

        def save(step):
            if step == SAVE_AT:
                acc.save_state(url, step=step)
                out["hyper_at_save"] = _hyper(opt)

        _train_steps(acc, model, opt, sched, loader, 0, save)
        out["unbroken"] = _weights(acc, model)
    with fresh_accelerator(None, plugin, step_scheduler_with_optimizer=False) as acc:
        model, opt, loader, sched = _prepared(acc, seed=1)  # other initial weights: the load must matter
        out["info"] = acc.load_state(url).step
        out["hyper_loaded"] = _hyper(opt)
        _train_steps(acc, model, opt, sched, loader, SAVE_AT)  # KeyError 'betas' here if groups were lost
        out["resumed"] = _weights(acc, model)
        try:
            acc.save_state(url, step=SAVE_AT - 1)  # older than the committed one
        except ValueError as exc:
            out["older"] = str(exc)
        acc.save_state(url, step=SAVE_AT - 1, replace=True)
        out["after_replace"] = [info.step for info in list_checkpoints(url)]
    return out


def _two_ranks(rank, world, root):
    import importlib.util

    out = {"refused": _refused_saves(rank, world, f"file://{root}/refused")}
    if importlib.util.find_spec("accelerate") is not None:
        out["pipeline"] = _pipeline_save_and_resume(rank, world, f"file://{root}/pp")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return root, run_ranks(_two_ranks, 2, str(root), env=_launch_env(2), timeout=110)


def test_pipeline_stages_resume_their_own_optimizer_groups_like_an_unbroken_run(ranks):
    require_module("accelerate", "accelerate")
    ranks = [out["pipeline"] for out in ranks[1]]
    for rank, out in enumerate(ranks):
        assert out["info"] == SAVE_AT
        present = [h for h in out["hyper_at_save"] if h is not None]
        assert len(present) == 2, f"rank {rank}: its stage group and the spanning group, {out['hyper_at_save']}"
        assert out["hyper_loaded"] == out["hyper_at_save"], f"rank {rank}"
        assert out["resumed"].keys() == out["unbroken"].keys()
        for name, value in out["unbroken"].items():
            torch.testing.assert_close(out["resumed"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert ranks[0]["unbroken"].keys().isdisjoint(ranks[1]["unbroken"].keys()), "each rank holds one stage"
    for out in ranks:  # a resumed run saving an older step: refused, unless it asks to replace the newer one
        assert f"step {SAVE_AT - 1} is not after the newest committed checkpoint" in out["older"]
        assert out["after_replace"] == [SAVE_AT - 1]


# ----------------------------------------------------------------------------- saves refused on every rank
class _BrokenState:
    """A Stateful whose ``state_dict`` fails on one rank only."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict:
        if self.fail:
            raise ValueError("state of this rank cannot be read (injected)")
        return {"x": torch.ones(2)}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def _refused_saves(rank, world, url):
    out = {}
    with Checkpointer(url) as ckpt:
        started = time.monotonic()
        try:
            ckpt.save({"broken": _BrokenState(fail=rank == 1)}, step=1)
        except Exception as exc:  # the test compares what every rank raised
            out["broken"] = (type(exc).__name__, str(exc), time.monotonic() - started)
        ckpt.save({"w": torch.full((4,), 200.0)}, step=200)
        try:
            ckpt.save({"w": torch.full((4,), 110.0)}, step=110)
        except ValueError as exc:
            out["older"] = str(exc)
        out["latest"] = ckpt.latest().step
    return out


def test_a_save_that_cannot_go_ahead_fails_on_every_rank_before_any_upload(ranks):
    """One rank's state_dict() raising, or a step older than the newest committed one: every rank raises at
    once (no rank left waiting in a collective) and nothing is written."""
    root, per_rank = ranks
    for rank, out in enumerate(out["refused"] for out in per_rank):
        kind, message, seconds = out["broken"]
        assert kind == "ValueError" and "cannot be read (injected)" in message, out["broken"]
        assert rank == 1 or "rank 1" in message, message  # the others name the failing rank
        assert seconds < 20, f"rank {rank} waited {seconds:.0f} s"
        assert "step 110 is not after the newest committed checkpoint" in out["older"]
        assert "step_0000000200" in out["older"] and "replace=True" in out["older"]
        assert out["latest"] == 200
    assert sorted(p.name for p in (root / "refused").iterdir()) == ["step_0000000200"]
    assert latest(f"file://{root}/refused").step == 200
