"""``ObjectStoreCheckpointIO``: Lightning ``CheckpointIO`` that writes checkpoints to any fsspec URL (s3://...).

For users of Lightning strategies that save from global rank 0 only (``ddp``, ``single_device``...): pass
``Trainer(plugins=[ObjectStoreCheckpointIO()], default_root_dir="s3://bucket/run")``. Each Lightning
checkpoint path (``.../epoch=0-step=100.ckpt``) becomes a folder in the multidc checkpoint format (see
:mod:`multidc.plugins.checkpoint`): tensors as raw bytes with CRC-32, parallel multipart upload, an atomic
``COMMIT.json`` written last, optional async upload (training blocks only for the host copy), and safe loading.
Lightning's ``ModelCheckpoint`` keeps deciding names and ``save_top_k``; ``trainer.fit(ckpt_path="last")`` resolves
to the newest committed checkpoint under its directory (building an ``ObjectStoreCheckpointIO`` or a multidc
strategy wraps ``ModelCheckpoint._find_last_checkpoints`` for Trainers whose strategy writes multidc checkpoints,
see :func:`install_last_resolution`; Lightning's own rule cannot list ``s3://`` directories).

The checkpoint dict's structure (everything but tensors: loop state, callback state, hyper-parameters) is stored
as one ``torch.save`` blob and read back with ``weights_only=True`` unless Lightning asks for
``weights_only=False`` (trusted store).

Saving a path that holds a committed checkpoint (Lightning overwrites ``last.ckpt``) replaces it in place without
a moment where neither is loadable: the new shards go up under fresh object names, the new ``COMMIT.json``
replaces the old one in one atomic write, and only then are the old shards deleted. A save that fails raises
``CheckpointSaveError`` naming the cause (the engine is :class:`~multidc.plugins.Checkpointer`'s, for this
process alone); one that fails or crashes leaves the previous checkpoint at that path loadable (its leftovers go
with the next successful save).
A plain file at the path (a checkpoint in another format) is deleted first: a folder cannot take its place
while it exists.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from multidc.plugins.checkpoint import Checkpointer
from multidc.plugins.checkpoint.comm import THIS_PROCESS
from multidc.plugins.checkpoint.format import COMMIT, decode_commit, parse_step
from multidc.plugins.checkpoint.object_store import ObjectStore, RetryPolicy
from multidc.plugins.checkpoint.planner import safe_load_bytes
from multidc.plugins.checkpoint.regions import SITE, is_regional
from multidc.plugins.checkpoint.retention import committed, delete_committed
from multidc.plugins.checkpoint.storage import byte_view

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError("ObjectStoreCheckpointIO needs Lightning: pip install 'multidc[lightning]'") from None

from multidc.plugins._lightning_patches import (  # noqa: E402  (needs Lightning, checked above)
    checkpoint_dir,
    install_regional_checkpoints,
)
from multidc.plugins._lightning_patches import install_last_resolution as install_last_resolution_patch  # noqa: E402

_TENSOR = "__multidc_tensor__"


class ObjectStoreCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing multidc-format checkpoints to fsspec URLs. Not collective.

    Args:
        storage_options: fsspec / s3fs options (``endpoint_url``, ``key``, ``secret``...); default: the standard
            AWS environment / config. Never logged.
        async_save: upload in a background thread; the next save, ``teardown`` or load waits for it and
            raises its error.
        retry: retry policy for transient storage errors. ``part_size_mb``: S3 multipart part size (MiB).
    """

    def __init__(self, *, storage_options: dict | None = None, async_save: bool = False,
                 retry: RetryPolicy | None = None, part_size_mb: float = 16) -> None:
        self.storage_options, self.async_save = storage_options, async_save
        self.retry, self.part_size_mb = retry, part_size_mb
        self._pending: Checkpointer | None = None  # the one whose async save may still be uploading
        install_last_resolution()

    def __setstate__(self, state: dict) -> None:  # spawn launchers unpickle it in each rank, where "last" resolves
        self.__dict__.update(state)
        install_last_resolution()

    def _checkpointer(self, path) -> tuple[Checkpointer, str]:
        """A Checkpointer of this process alone (Lightning calls a CheckpointIO on rank 0 only) over the folder
        holding ``path``, and ``path``'s name in it."""
        text = str(path).rstrip("/").removesuffix(f"/{COMMIT}")  # "last" resolves to the commit record
        if is_regional(text):  # one process, no topology: it would see one site and write one region only
            raise ValueError(
                f"checkpoint path {text!r} names one store per site ({SITE}, or a mapping site -> URL), which "
                "ObjectStoreCheckpointIO cannot "
                "write: Lightning calls it on rank 0 alone, which knows no sites and would send every region's copy "
                "over the WAN. Use a multidc strategy (strategy='hierarchical_ddp', 'diloco' or 'parallel_3d' take "
                "{site} paths, each site writing its own region) or Checkpointer(url, topology=...), or one URL here "
                "(see the checkpoints guide, 'One store per site').")
        root, _, name = text.rpartition("/")
        if not name:
            raise ValueError(f"checkpoint path {text!r} has no file name.")
        ckpt = Checkpointer(root or ".", process_group=THIS_PROCESS, storage_options=self.storage_options,
                            retry=self.retry, part_size_mb=self.part_size_mb, async_save=self.async_save)
        return ckpt, name

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ObjectStoreCheckpointIO takes storage options in its constructor, not per save.")
        self.wait()
        ckpt, name = self._checkpointer(path)
        skeleton, tensors = _split_tensors(checkpoint)
        step = int(checkpoint.get("global_step", 0) or 0)
        ckpt._save_folder({"skeleton": skeleton, "tensors": tensors}, name, step=step)
        self._pending = ckpt if self.async_save else None

    def wait(self) -> None:
        """Wait for the background upload, raising its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.close()

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        self.wait()
        ckpt, name = self._checkpointer(path)
        trusted = weights_only is False
        state = ckpt._load_folder(name, trusted=trusted)
        blob = io.BytesIO(bytes(byte_view(state["skeleton"].contiguous())))
        skeleton = torch.load(blob, weights_only=False) if trusted else safe_load_bytes(blob)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        return _join_tensors(skeleton, state.get("tensors", {}), device)

    def remove_checkpoint(self, path) -> None:
        self.wait()
        ckpt, name = self._checkpointer(path)
        delete_committed(ckpt.store, name)

    def teardown(self) -> None:
        self.wait()

    def find_last(self, dirpath) -> set[str]:
        """See :func:`find_last`."""
        return find_last(dirpath, storage_options=self.storage_options, retry=self.retry, step_folders=False)


def _split_tensors(obj) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(torch.save'd structure with tensors replaced by markers, as a uint8 tensor; {"<n>": tensor})."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value):
        if isinstance(value, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = value.detach()
            return {_TENSOR: key}
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items()) if type(value) is not dict else {
                k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return value

    buffer = io.BytesIO()
    torch.save(walk(obj), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8), tensors


def _join_tensors(skeleton, tensors: dict[str, torch.Tensor], device):
    def walk(value):
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                tensor = tensors[value[_TENSOR]]
                return tensor.to(device) if device is not None else tensor
            return type(value)((k, walk(v)) for k, v in value.items()) if type(value) is not dict else {
                k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(walk(v) for v in value)
        return value

    return walk(skeleton)


def find_last(dirpath, *, storage_options: dict | None = None, retry: RetryPolicy | None = None,
              step_folders: bool) -> set[str]:
    """The commit record URL of the newest committed checkpoint under ``dirpath`` as a one-element set, or an empty
    set (what ``ModelCheckpoint._find_last_checkpoints`` returns). Newest: the latest commit, then (S3 stamps have
    1 s resolution) the highest step. Half-written checkpoints have no commit record. Not collective.

    ``step_folders``: each Lightning path is a Checkpointer root of step folders (the multidc strategies; then
    ``dirpath`` itself may be one too), not one checkpoint folder (``ObjectStoreCheckpointIO``).
    """
    directory = ObjectStore(dirpath, storage_options=storage_options, retry=retry)
    if step_folders:
        roots = ["", *(f"{name}/" for name in directory.list_dirs())]
        keys = [f"{root}{name}/{COMMIT}" for root in roots for _, name in
                committed(ObjectStore(f"{directory.url}/{root}", storage_options=storage_options, retry=retry))]
    else:
        keys = [f"{name}/{COMMIT}" for name in directory.list_dirs() if directory.exists(f"{name}/{COMMIT}")]
    if not keys:
        return set()
    stamps = {key: directory.fs.modified(directory.path(key)) for key in keys}
    newest = [key for key in keys if stamps[key] == max(stamps.values())]
    return {f"{directory.url}/{max(newest, key=lambda key: _step(directory, key))}"}


def _step(directory: ObjectStore, key: str) -> int:
    """The step of the checkpoint whose commit record is ``key``: its folder's name says it, or its record does."""
    step = parse_step(key.split("/")[-2])
    return step if step is not None else decode_commit(directory.get(key), directory.where(key)).step


def _last_finder(strategy):
    """What answers ``find_last(dirpath)`` for this strategy: a multidc strategy's checkpoint writer, an
    ``ObjectStoreCheckpointIO``, or ``None`` (Lightning's rule)."""
    finder = getattr(strategy, "multidc_checkpoints", None)
    if finder is None:
        io = getattr(strategy, "_checkpoint_io", None)  # not the property: it would install a default CheckpointIO
        finder = io if isinstance(io, ObjectStoreCheckpointIO) else None
    return finder


def install_last_resolution() -> None:
    """Make ``ckpt_path="last"`` find committed multidc checkpoints when the Trainer writes them (a multidc
    strategy, or ``ObjectStoreCheckpointIO``): the newest commit under each ``ModelCheckpoint`` directory, any
    name, never a half-written one. Other Trainers keep Lightning's rule. Called when a multidc strategy or an
    ``ObjectStoreCheckpointIO`` is built; idempotent (see ``multidc.plugins._lightning_patches``). Also routes
    Lightning's own checks of ``{site}`` paths (one store per site) to a multidc strategy's checkpoint writer:
    ``"last"`` waits for the strategy's set-up (the job's sites), see ``multidc.strategies._checkpointing``."""
    install_last_resolution_patch(_find_last_for)
    install_regional_checkpoints(_regional_answers)


def _regional_answers(trainer):
    """A multidc strategy's checkpoint writer, handed the strategy's topology; ``None`` for other Trainers."""
    strategy = getattr(trainer, "strategy", None)
    if getattr(strategy, "multidc_checkpoints", None) is None:
        return None
    return strategy._checkpoints()


def _find_last_for(callback: ModelCheckpoint, trainer) -> set[str] | None:
    """The newest committed multidc checkpoint under ``callback``'s directory, or None: Lightning's rule."""
    finder = _last_finder(trainer.strategy)
    return None if finder is None else finder.find_last(checkpoint_dir(callback, trainer))


__all__ = ["ObjectStoreCheckpointIO"]
