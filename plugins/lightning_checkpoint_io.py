"""``ObjectStoreCheckpointIO``: Lightning ``CheckpointIO`` that writes checkpoints to any fsspec URL (s3://...).

For users of Lightning strategies that save from global rank 0 only (``ddp``, ``single_device``...): pass
``Trainer(plugins=[ObjectStoreCheckpointIO()], default_root_dir="s3://bucket/run")``. Each Lightning
checkpoint path (``.../epoch=0-step=100.ckpt``) becomes a folder in the multidc checkpoint format (see
:mod:`multidc.plugins.checkpoint`): tensors as raw bytes with CRC-32, parallel multipart upload, an atomic
``COMMIT.json`` written last, optional async upload (training blocks only for the host copy), and safe loading.
Lightning's ``ModelCheckpoint`` keeps deciding names and ``save_top_k``; ``trainer.fit(ckpt_path="last")`` resolves
to the newest committed checkpoint under its directory (importing this module wraps
``ModelCheckpoint._find_last_checkpoints`` for Trainers whose strategy writes multidc checkpoints, see
:func:`install_last_resolution`; Lightning's own rule cannot list ``s3://`` directories).

The checkpoint dict's structure (everything but tensors: loop state, callback state, hyper-parameters) is stored
as one ``torch.save`` blob and read back with ``weights_only=True`` unless Lightning asks for
``weights_only=False`` (trusted store).

Saving a path that holds a committed checkpoint (Lightning overwrites ``last.ckpt``) replaces it in place without
a moment where neither is loadable: the new shards go up under fresh object names, the new ``COMMIT.json``
replaces the old one in one atomic write, and only then are the old shards deleted. A save that fails or
crashes leaves the previous checkpoint at that path loadable (its leftovers go with the next successful save).
A plain file at the path (a checkpoint in another format) is deleted first: a folder cannot take its place
while it exists.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch

from multidc.plugins.checkpoint.comm import Comm
from multidc.plugins.checkpoint.format import COMMIT, decode_commit
from multidc.plugins.checkpoint.object_store import ObjectStore, RetryPolicy
from multidc.plugins.checkpoint.planner import SafeRebuildLoadPlanner, StripedSavePlanner, safe_load_bytes
from multidc.plugins.checkpoint.retention import claim_folder, remove_replaced
from multidc.plugins.checkpoint.storage import ObjectStoreReader, ObjectStoreWriter, byte_view, stage, upload

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:  # pragma: no cover - exercised only without the extra
    raise ImportError("ObjectStoreCheckpointIO needs Lightning: pip install 'multidc[lightning]'") from None

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
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _split(self, path) -> tuple[ObjectStore, str]:
        text = str(path).rstrip("/").removesuffix(f"/{COMMIT}")  # "last" resolves to the commit record
        root, _, name = text.rpartition("/")
        if not name:
            raise ValueError(f"checkpoint path {text!r} has no file name.")
        store = ObjectStore(root or ".", storage_options=self.storage_options, retry=self.retry,
                            part_size_mb=self.part_size_mb)
        return store, name

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ObjectStoreCheckpointIO takes storage options in its constructor, not per save.")
        self.wait()
        store, name = self._split(path)
        store.check_access()
        if store.fs.isfile(store.path(name)):
            store.delete(name)  # a single-file checkpoint in another format: the folder cannot coexist with it
        tag = claim_folder(store, name)  # a committed checkpoint here stays loadable until the new one commits
        skeleton, tensors = _split_tensors(checkpoint)
        state = {"skeleton": skeleton, "tensors": tensors}
        planner = StripedSavePlanner()
        writer = ObjectStoreWriter(store, name, step=int(checkpoint.get("global_step", 0) or 0), shard_tag=tag)
        planner.set_up_planner(state, is_coordinator=True)
        writer.set_up_storage_writer(True)
        plan = Comm(None, 0, 1).plan(writer.prepare_local_plan(planner.create_local_plan()),
                                     lambda plans: writer.prepare_global_plan(planner.create_global_plan(plans)[0]))
        staged = stage(planner.finish_plan(plan), planner, plan.storage_data)

        def finish() -> None:
            results = upload(staged, store, name)
            writer.finish(planner.metadata, [results])
            remove_replaced(store, name, {r.storage_data.file for r in results})  # logs, never raises

        if not self.async_save:
            return finish()
        self._thread = threading.Thread(target=self._run, args=(finish,), name=f"multidc-ckptio-{name}", daemon=True)
        self._thread.start()
        return None

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            self._error = exc

    def wait(self) -> None:
        """Wait for the background upload, raising its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        self.wait()
        store, name = self._split(path)
        commit = decode_commit(store.get(f"{name}/{COMMIT}"), store.where(f"{name}/{COMMIT}"))
        trusted = weights_only is False
        planner = SafeRebuildLoadPlanner(trusted=trusted)
        Comm(None, 0, 1).dcp_load({}, ObjectStoreReader(store, name, commit), planner)
        state = planner.original_state_dict  # the planner rebuilt the saved structure from the commit record
        blob = io.BytesIO(bytes(byte_view(state["skeleton"].contiguous())))
        skeleton = torch.load(blob, weights_only=False) if trusted else safe_load_bytes(blob)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        return _join_tensors(skeleton, state.get("tensors", {}), device)

    def remove_checkpoint(self, path) -> None:
        self.wait()
        store, name = self._split(path)
        store.delete(f"{name}/{COMMIT}")  # first: a half-deleted checkpoint never looks committed
        store.delete_tree(name)

    def teardown(self) -> None:
        self.wait()

    def find_last(self, dirpath) -> set[str]:
        """The ``COMMIT.json`` of the newest committed checkpoint under ``dirpath`` (commit time, then step), as a
        one-element set, or an empty set. Half-written checkpoints have no ``COMMIT.json``."""
        directory = ObjectStore(dirpath, storage_options=self.storage_options, retry=self.retry)
        keys = [f"{name}/{COMMIT}" for name in directory.list_dirs() if directory.exists(f"{name}/{COMMIT}")]
        newest = newest_commit(directory, keys, lambda key: decode_commit(directory.get(key), key).step)
        return {f"{directory.url}/{newest}"} if newest else set()


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


def newest_commit(store: ObjectStore, keys: list[str], step_of) -> str | None:
    """Of commit record keys under ``store``, the newest commit; ties (S3 stamps have 1 s resolution) go to the
    highest ``step_of(key)``. ``None`` without keys."""
    if not keys:
        return None
    stamps = {key: store.fs.modified(store.path(key)) for key in keys}
    newest = max(stamps.values())
    return max((key for key in keys if stamps[key] == newest), key=step_of)


def _checkpoint_dir(callback: ModelCheckpoint, trainer) -> str:
    """The directory ``ModelCheckpoint`` saves into (its ``dirpath``, else derived from loggers / root dir)."""
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)  # Lightning's own rule when present
    if resolve is not None:
        return str(resolve(trainer))
    return str(callback.dirpath or f"{trainer.default_root_dir}/checkpoints")


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
    name, never a half-written one. Other Trainers keep Lightning's rule. Idempotent."""
    current = ModelCheckpoint._find_last_checkpoints
    original = getattr(current, "__multidc_original__", current)

    def _find_last_checkpoints(self: ModelCheckpoint, trainer) -> set[str]:
        finder = _last_finder(trainer.strategy)
        if finder is None:
            return original(self, trainer)
        return finder.find_last(_checkpoint_dir(self, trainer))

    _find_last_checkpoints.__multidc_original__ = original
    _find_last_checkpoints.__doc__ = original.__doc__
    ModelCheckpoint._find_last_checkpoints = _find_last_checkpoints


install_last_resolution()

__all__ = ["ObjectStoreCheckpointIO"]
