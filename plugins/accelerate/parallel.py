"""What ``MultiDCAccelerator`` needs beyond Accelerate for a parallel layout: how the processes were launched, data
loaders sharded by data-parallel replica, and schedulers stepped once per replica.

Private: ``multidc.plugins.accelerate`` is the public face.
"""

from __future__ import annotations

import os

import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.scheduler import AcceleratedScheduler


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun (``accelerate launch``); 1 when unset or not a number."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched_without_device() -> bool:
    """True when torchrun (``accelerate launch --multi_gpu`` / a ``MULTI_GPU`` config) started several processes on
    a machine with no accelerator device.

    Accelerate 1.15's torchrun launcher does not pass ``use_cpu`` / ``--cpu`` on to the processes (and ``--cpu``
    selects the one-process launcher, which needs ``mpirun`` for more); each process would then train alone. On
    such a machine gloo on the CPU is the only way the processes can train together.
    """
    if "LOCAL_RANK" not in os.environ or launched_world_size() < 2:
        return False
    accelerator = getattr(torch, "accelerator", None)
    return not (accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


def check_launch(num_processes: int, distributed_type) -> None:
    """ValueError when the launcher started several processes but Accelerate runs this one alone."""
    world = launched_world_size()
    if world > 1 and num_processes == 1:
        raise ValueError(
            f"the launcher started {world} processes (WORLD_SIZE={world}) but Accelerate runs this one alone "
            f"(distributed_type={distributed_type}), so they would not train together. On CPUs set "
            f"ACCELERATE_USE_CPU=1 or leave `cpu` unset (MultiDCAccelerator then picks gloo on the CPU)."
        )


def shard_data_loader(accelerator, data_loader, index: int, size: int, device_placement, slice_fn):
    """Accelerate's ``prepare_data_loader`` with the data-parallel replica ``(index, size)`` in place of the process:
    the tensor- and pipeline-parallel peers of one replica get the same batches."""
    if accelerator.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True sends every process its own slice of rank 0's batch, but with a parallel layout "
            "the tensor/pipeline peers of a replica need the same batch; use dispatch_batches=False."
        )
    return prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=size,
        process_index=index,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        slice_fn_for_dispatch=slice_fn,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )


class ReplicaScheduler(AcceleratedScheduler):
    """An ``AcceleratedScheduler`` that, without ``split_batches``, steps once per data-parallel replica per optimizer
    step (Accelerate steps once per process: with tensor/pipeline parallelism that overcounts the batch)."""

    def __init__(self, scheduler, optimizers, *, replicas: int, step_with_optimizer: bool, split_batches: bool):
        super().__init__(scheduler, optimizers, step_with_optimizer=step_with_optimizer, split_batches=True)
        self.repeats = 1 if split_batches else replicas

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer or not self.gradient_state.sync_gradients:
            return super().step(*args, **kwargs)
        for _ in range(self.repeats):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                return None
            super().step(*args, **kwargs)
        return None
