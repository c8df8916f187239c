"""Checkpoints to object storage, and the framework plugins that use them.

* ``multidc.plugins.checkpoint``: the checkpoint engine (``Checkpointer``, ``ObjectStore``, ``ModelState``, ...).
* ``multidc.plugins.accelerate``: ``MultiDCAccelerator`` and ``MultiDCPlugin`` for Hugging Face Accelerate.
* ``multidc.plugins.lightning_checkpoint_io``: ``ObjectStoreCheckpointIO``, a Lightning ``CheckpointIO``.

The Accelerate and Lightning names are imported when first used, so this package needs neither installed.
"""

from multidc.plugins import checkpoint as _checkpoint
from multidc.plugins.checkpoint import *  # noqa: F403  (re-exports its __all__)

# The checkpoint engine's names, and the framework plugins' (imported when first used, see __getattr__).
__all__: list[str] = sorted([*_checkpoint.__all__, "MultiDCAccelerator", "MultiDCPlugin", "ObjectStoreCheckpointIO"])


def __getattr__(name: str):
    if name == "ObjectStoreCheckpointIO":  # imports Lightning: only when asked for
        from multidc.plugins.lightning_checkpoint_io import ObjectStoreCheckpointIO

        return ObjectStoreCheckpointIO
    if name in ("MultiDCAccelerator", "MultiDCPlugin"):  # imports Accelerate (an optional extra): only when asked for
        from multidc.plugins import accelerate

        return getattr(accelerate, name)
    raise AttributeError(f"module 'multidc.plugins' has no attribute {name!r}")
