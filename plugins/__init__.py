"""Accelerate integration and object-store checkpoint I/O (see the project issues)."""

from multidc.plugins._checkpoint_state import ModelState, RNGState
from multidc.plugins.checkpoint import (
    CheckpointCorruptError,
    CheckpointInfo,
    Checkpointer,
    CheckpointSaveError,
    SaveHandle,
    latest,
    list_checkpoints,
    load,
    save,
    wait,
)
from multidc.plugins.object_store import (
    ObjectStore,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    RetryPolicy,
)

__all__: list[str] = [
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointSaveError",
    "Checkpointer",
    "ModelState",
    "MultiDCAccelerator",
    "MultiDCPlugin",
    "ObjectStore",
    "ObjectStoreAuthError",
    "ObjectStoreCheckpointIO",
    "ObjectStoreError",
    "ObjectStoreNotFoundError",
    "RNGState",
    "RetryPolicy",
    "SaveHandle",
    "latest",
    "list_checkpoints",
    "load",
    "save",
    "wait",
]


def __getattr__(name: str):
    if name == "ObjectStoreCheckpointIO":  # imports Lightning: only when asked for
        from multidc.plugins.lightning_checkpoint_io import ObjectStoreCheckpointIO

        return ObjectStoreCheckpointIO
    if name in ("MultiDCAccelerator", "MultiDCPlugin"):  # imports Accelerate (an optional extra): only when asked for
        from multidc.plugins import accelerate

        return getattr(accelerate, name)
    raise AttributeError(f"module 'multidc.plugins' has no attribute {name!r}")
