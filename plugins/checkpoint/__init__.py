"""The checkpoint engine: sharded, striped, async, atomic, verified checkpoints to any fsspec URL.

``Checkpointer`` (``checkpointer``; ``api``: the same by URL in one call) is what a training loop uses; the
Accelerate plugin and the Lightning strategies and ``CheckpointIO`` build on it. ``python -m
multidc.plugins.checkpoint ls|verify|rm URL`` (``cli``, ``verify``) inspects, checks and deletes checkpoints. The
private modules, one concern each:

* ``object_store``: ``ObjectStore``, one fsspec location with retries and secret-free errors; ``s3_multipart``:
  the parallel multipart upload of one S3 object.
* ``format``: names and the JSON commit record; ``planner``: striped saving and unpickling-free loading;
  ``storage``: DCP's writer over the object store; ``retention``: listing, ``latest`` and deletion.
* ``reader``: DCP's reader; ``read_plan``: who GETs which byte ranges and in which rounds they are exchanged;
  ``striped_read``: one rank's reads and exchanges; ``ranged_read``: one streamed ranged GET; ``crc``: combining
  CRC-32s of slices.
* ``comm``: the checkpoint's collectives, raised on every rank; ``handle``: the outcome of an (async) save;
  ``state``: ``ModelState`` and ``RNGState``.

Messages go to the ``multidc.plugins.checkpoint`` and ``multidc.plugins.object_store`` loggers.
"""

from multidc.plugins.checkpoint.api import latest, list_checkpoints, load, save, wait
from multidc.plugins.checkpoint.checkpointer import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointInfo,
    CheckpointSaveError,
    SaveHandle,
)
from multidc.plugins.checkpoint.object_store import (
    ObjectStore,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreNotFoundError,
    RetryPolicy,
)
from multidc.plugins.checkpoint.reader import ReadConfig
from multidc.plugins.checkpoint.regions import CheckpointRegionUnavailableError
from multidc.plugins.checkpoint.state import ModelState, RNGState

__all__ = [
    "CheckpointCorruptError",
    "CheckpointInfo",
    "CheckpointRegionUnavailableError",
    "CheckpointSaveError",
    "Checkpointer",
    "ModelState",
    "ObjectStore",
    "ObjectStoreAuthError",
    "ObjectStoreError",
    "ObjectStoreNotFoundError",
    "RNGState",
    "ReadConfig",
    "RetryPolicy",
    "SaveHandle",
    "latest",
    "list_checkpoints",
    "load",
    "save",
    "wait",
]
