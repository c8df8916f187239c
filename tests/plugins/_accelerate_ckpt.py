"""Rank functions for test_accelerate_3d.py: a fresh ``MultiDCAccelerator`` per case on already-running gloo
ranks, and the save_state / load_state runs (train, save, keep training; elsewhere load and train on).

Every run trains ``TinyGPT`` on the global batches of ``tests._tiny_models.batch`` (SGD with momentum, a LambdaLR
stepped once per optimizer step), sharded over the data-parallel replicas by Accelerate's data loader.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from tests._tiny_models import TinyGPT, _optimizer, batch, loss_fn

GLOBAL_BATCH = 8


@contextmanager
def fresh_accelerator(env: dict | None = None, plugin: dict | None = None, **accelerator_kwargs):
    """A ``MultiDCAccelerator`` built with ``env`` set; afterwards Accelerate's singletons are reset so the next
    case builds its own on the same process group (which stays up: no ``end_training``)."""
    from accelerate.state import AcceleratorState, GradientState

    from multidc.plugins import MultiDCAccelerator, MultiDCPlugin

    env = env or {}
    os.environ.update(env)
    accelerator = None
    try:
        accelerator = MultiDCAccelerator(multidc_plugin=MultiDCPlugin(**(plugin or {})), **accelerator_kwargs)
        yield accelerator
    finally:
        for key in env:
            del os.environ[key]
        if accelerator is not None:
            accelerator._close_checkpointers()
            if accelerator.topology is not None:
                accelerator.topology.close()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def prepared(accelerator, steps: range):
    """Model, optimizer, scheduler and a loader over the global batches of ``steps``, prepared."""
    from torch.utils.data import DataLoader, TensorDataset

    from multidc.hierarchical.parallel import data_parallel_coordinate

    torch.manual_seed(0)
    model = TinyGPT(2)
    opt, sched = _optimizer(model.parameters())
    dp = data_parallel_coordinate(accelerator.device_mesh)[1] if accelerator.device_mesh is not None \
        else accelerator.num_processes
    x, y = zip(*(batch(step, GLOBAL_BATCH) for step in steps))
    loader = DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), batch_size=GLOBAL_BATCH // dp)
    blocks = model.blocks() if accelerator.device_mesh is not None else None
    return accelerator.prepare(model, opt, loader, sched, blocks=blocks)


def train(accelerator, model, opt, loader, sched, *, save_at: dict | None = None, first_step: int = 0) -> dict:
    """Train over ``loader``; ``save_at = {step: (url, async) or [(url, async), ...]}`` saves before that step
    (url ``None``: ``MULTIDC_CKPT_URL``). Returns the mean loss
    per step, this rank's RNG draw right after each save, and the full values of this rank's parameters."""
    from torch.distributed.tensor import DTensor

    out = {"losses": [], "draws": {}}
    for step, (x, y) in enumerate(loader, start=first_step):
        if save_at and step in save_at:
            for url, async_save in save_at[step] if isinstance(save_at[step], list) else [save_at[step]]:
                out.setdefault("saved", []).append(accelerator.save_state(url, step=step, async_save=async_save))
            out["draws"][step] = torch.rand(3)
        loss = accelerator.pipeline_step(model, x, y, loss_fn)
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"].append(accelerator.gather(loss.reshape(1)).mean().item())
    out["committed"] = [info.step for info in accelerator.wait_for_checkpoint()]
    params = accelerator.unwrap_model(model).named_parameters()
    out["params"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params}
    return out


def save_runs(rank, world, s3_url, options, file_url, template):
    """4 ranks: DDP over 2 sites saving to S3 before steps 2 (sync) and 4 (async), and before step 4 also
    region-local to ``template`` (``{site}``: a bucket per site) given as ``MULTIDC_CKPT_URL``; pp 2 x dp_shard 2
    saving to file:// before step 2. Both keep training: the unbroken runs."""
    results = {}
    with fresh_accelerator({"MULTIDC_NUM_SITES": "2", "MULTIDC_CKPT_URL": template}, dict(storage_options=options),
                           step_scheduler_with_optimizer=False) as acc:
        results["ddp"] = train(acc, *prepared(acc, range(6)),
                               save_at={2: (s3_url, False), 4: [(s3_url, True), (None, False)]})
    with fresh_accelerator(None, dict(pipeline_parallel_size=2, microbatches=2),
                           step_scheduler_with_optimizer=False) as acc:
        results["pp"] = train(acc, *prepared(acc, range(4)), save_at={2: (file_url, False)})
    return results


def resume_runs(rank, world, s3_url, options, file_url, local_dir, template):
    """2 ranks, one site, plain DDP: resume both unbroken runs from their latest checkpoints and finish them (the
    DDP run from the S3 URL, its model then zeroed and RNG advanced, then again from the region-local copy, given as
    a mapping site -> URL: this site's region "0" and region "1", which this job has no site for); then where local
    directories go."""
    results = {}
    with fresh_accelerator(None, dict(storage_options=options), step_scheduler_with_optimizer=False) as acc:
        model, opt, loader, sched = prepared(acc, range(4, 6))
        info = acc.load_state(s3_url)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        torch.rand(5)
        regional = acc.load_state({site: template.replace("{site}", site) for site in ("0", "1")})
        results["regional"] = (regional.step, regional.url)
        draws = torch.rand(3)
        results["ddp"] = {**train(acc, model, opt, loader, sched, first_step=4), "info": (info.step, info.world_size),
                          "draw": draws, "iteration": acc.save_iteration, "lr": sched.get_last_lr()}
        older = acc.load_state(s3_url, step=2)
        results["older"] = (older.step, acc.save_iteration)
    with fresh_accelerator(None, None, step_scheduler_with_optimizer=False) as acc:
        model, opt, loader, sched = prepared(acc, range(2, 4))
        info = acc.load_state(file_url)
        results["pp"] = {**train(acc, model, opt, loader, sched, first_step=2), "info": (info.step, info.world_size)}
    results["local"] = _local_directories(local_dir)
    return results


def _local_directories(local_dir) -> dict:
    """A plain local directory keeps Accelerate's format unless opted in; a multidc one is recognised on load."""
    from multidc.plugins import list_checkpoints

    plain, sharded = os.path.join(local_dir, "plain"), os.path.join(local_dir, "sharded")
    with fresh_accelerator() as acc:
        prepared(acc, range(1))
        acc.save_state(plain)
    with fresh_accelerator(None, dict(shard_local_checkpoints=True)) as acc:
        prepared(acc, range(1))
        where = acc.save_state(sharded)  # step: Accelerate's save iteration, 0
    with fresh_accelerator() as acc:
        prepared(acc, range(1))
        found = acc.load_state(sharded).step  # no opt-in: recognised by its committed checkpoints
    return {"plain_files": sorted(os.listdir(plain)), "sharded": [c.step for c in list_checkpoints(sharded)],
            "where": where, "found": found}
