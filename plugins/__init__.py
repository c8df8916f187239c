"""Checkpoints to object storage, and the framework plugins that use them.

* ``multidc.plugins.checkpoint``: the checkpoint engine (``Checkpointer``, ``ObjectStore``, ``ModelState``, ...).
* ``multidc.plugins.accelerate``: ``MultiDCAccelerator`` and ``MultiDCPlugin`` for Hugging Face Accelerate.
* ``multidc.plugins.lightning_checkpoint_io``: ``ObjectStoreCheckpointIO``, a Lightning ``CheckpointIO``.

The Accelerate and Lightning names are imported when first used, so this package needs neither installed.
"""

from multidc.plugins.checkpoint import (
    CheckpointCorruptError,
    CheckpointInfo,
    Checkpointer,
    CheckpointSaveError,
    ModelState,
    ObjectStore,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    RetryPolicy,
    RNGState,
    SaveHandle,
    latest,
    list_checkpoints,
    load,
    save,
    wait,
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
