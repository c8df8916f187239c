"""Every use of a private Lightning API in multidc, in one place; checked against Lightning ``CHECKED_AGAINST``.

``tests/e2e/test_patches.py`` fails when one of these attributes disappears or changes its signature. Nothing here
runs at import: importing multidc changes nothing in Lightning for a Trainer that uses no multidc strategy.

* ``install_last_resolution``: ``ModelCheckpoint._find_last_checkpoints``, so ``ckpt_path="last"`` finds committed
  multidc checkpoints (installed when a multidc strategy or ``ObjectStoreCheckpointIO`` is built; the original runs
  for every other Trainer). ``checkpoint_dir`` reads ``ModelCheckpoint``'s private directory rule.
* ``install_regional_checkpoints``: for a ``ModelCheckpoint`` directory with ``{site}`` or a mapping site -> URL
  (one store per site), the places where Lightning would touch that path with its own filesystem (which has
  neither the sites nor their credentials): ``_CheckpointConnector._parse_ckpt_path`` (``"last"`` is deferred until
  the strategy is set up), ``_CheckpointConnector.resume_start`` (where the deferred ``"last"`` is resolved,
  collectively), ``ModelCheckpoint.file_exists`` and ``ModelCheckpoint.__warn_if_dir_not_empty``; and for a
  mapping, ``ModelCheckpoint.__init_ckpt_dir`` and ``ModelCheckpoint.setup`` (Lightning opens the directory with
  ``get_filesystem``, which takes one URL): the mapping becomes its text (``checkpoint.regions.path_key``), to
  which Lightning joins its file names. A ``ModelCheckpoint`` given a mapping must be built after the multidc
  strategy (which installs these).
* ``wrap_lr_scheduler_updates`` / ``unwrap_lr_scheduler_updates``: one Trainer's epoch loop
  ``update_lr_schedulers`` (elastic: the schedulers step on committed steps only; elastic DiLoCo: a round's quorum
  once they stepped).
* ``set_optimizer_steps``: the automatic optimization's step counter behind ``global_step`` (elastic: the job's).
* ``site_sigterm_broadcast`` / ``undo_site_sigterm_broadcast``: one Trainer's epoch loop ``_broadcast_sigterm_tensor``
  (DiLoCo with rounds by time: the sites run different step counts, so a per-batch broadcast over every rank would
  pair one site's step with another's and deadlock against DiLoCo's syncs; it runs inside the site instead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

try:
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "multidc's Lightning strategies need Lightning: pip install 'multidc[lightning]' (lightning>=2.5,<2.7)."
    ) from exc

from multidc.plugins.checkpoint.regions import is_regional, path_key  # noqa: E402

CHECKED_AGAINST = "lightning 2.6"


def install_last_resolution(find: Callable[[ModelCheckpoint, object], set[str] | None]) -> None:
    """Make ``ModelCheckpoint._find_last_checkpoints(trainer)`` return ``find(callback, trainer)`` unless that is
    ``None`` (then Lightning's own rule runs). Idempotent: installing again replaces ``find``.

    Why a patch: Lightning 2.6 resolves ``"last"`` in ``_CheckpointConnector._parse_ckpt_path`` by asking each
    ``ModelCheckpoint`` for ``_find_last_checkpoints``, which lists the directory with ``os.path.normpath`` paths and
    keeps ``last*.ckpt`` names: an ``s3://`` URL is mangled and a half-written folder would match. Neither the
    strategy nor the ``CheckpointIO`` is consulted, so there is no hook to answer instead."""
    current = ModelCheckpoint._find_last_checkpoints
    original = getattr(current, "__multidc_original__", current)

    def _find_last_checkpoints(self: ModelCheckpoint, trainer) -> set[str]:
        found = find(self, trainer)
        return original(self, trainer) if found is None else found

    _find_last_checkpoints.__multidc_original__ = original
    _find_last_checkpoints.__doc__ = original.__doc__
    ModelCheckpoint._find_last_checkpoints = _find_last_checkpoints


class DeferredLast(str):
    """``ckpt_path="last"`` waiting for the strategy's set-up: a multidc strategy resolves it in ``resume_start``
    (the newest checkpoint committed in every region needs the job's sites). ``dirs``: every ``ModelCheckpoint``
    directory, as configured."""

    dirs: tuple[str, ...] = ()

    def __new__(cls, dirs) -> DeferredLast:
        text = super().__new__(cls, "last (the newest committed checkpoint under " + ", ".join(dirs) + ")")
        text.dirs = tuple(dirs)
        return text


def install_regional_checkpoints(answers: Callable[[object], object | None]) -> None:
    """Route Lightning's own filesystem calls on regional checkpoint paths to ``answers(trainer)``: an object with
    ``is_regional(path)``, ``resolve_last(dirs)`` (collective: a ``ckpt_path`` or ``None``) and ``exists(path)``
    (rank 0), or ``None`` for a Trainer that writes no multidc checkpoints (Lightning's own rule then). Idempotent.

    Why patches: Lightning 2.6 resolves ``"last"`` in ``_parse_ckpt_path`` before the strategy is set up and then
    checks the candidates with ``get_filesystem(path).exists``; ``ModelCheckpoint`` checks its directory and each
    name with its own ``self._fs``. Neither knows the sites a ``{site}`` path names nor their credentials."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    def wrap(owner, attribute: str, make) -> None:
        current = getattr(owner, attribute)
        original = getattr(current, "__multidc_original__", current)
        patched = make(original)
        patched.__multidc_original__ = original
        patched.__doc__ = original.__doc__
        setattr(owner, attribute, patched)

    def regional(trainer, path):
        found = answers(trainer)
        return found if found is not None and path is not None and found.is_regional(path) else None

    def parse(original):
        def _parse_ckpt_path(self, state_fn, ckpt_path, model_provided, model_connected):
            if ckpt_path == "last":
                dirs = [checkpoint_dir(cb, self.trainer) for cb in self.trainer.checkpoint_callbacks
                        if isinstance(cb, ModelCheckpoint)]
                if any(regional(self.trainer, d) is not None for d in dirs):
                    return DeferredLast(dirs)
            return original(self, state_fn, ckpt_path, model_provided, model_connected)
        return _parse_ckpt_path

    def resume(original):
        def resume_start(self, checkpoint_path=None, weights_only=None):
            if isinstance(checkpoint_path, DeferredLast):
                checkpoint_path = answers(self.trainer).resolve_last(checkpoint_path.dirs)
            return original(self, checkpoint_path, weights_only)
        return resume_start

    def exists(original):
        def file_exists(self, filepath, trainer) -> bool:
            found = regional(trainer, filepath)
            if found is None:
                return original(self, filepath, trainer)
            return found.exists(filepath)  # collective: every rank gets rank 0's answer or its error
        return file_exists

    def warn(original):
        def warn_if_dir_not_empty(self, dirpath) -> None:  # no trainer here: a warning only, skipped for regions
            if not is_regional(str(dirpath)):
                original(self, dirpath)
        return warn_if_dir_not_empty

    def init_dir(original):
        def init_ckpt_dir(self, dirpath, filename) -> None:
            original(self, None if isinstance(dirpath, Mapping) else dirpath, filename)
            if isinstance(dirpath, Mapping):  # its text: Lightning joins file names to it as to a directory
                self.dirpath = path_key(dirpath)
        return init_ckpt_dir

    def setup(original):
        def setup(self, trainer, pl_module, stage) -> None:
            if not (isinstance(self.dirpath, str) and self.dirpath.startswith('{"')):
                return original(self, trainer, pl_module, stage)
            # a mapping's text: Lightning's setup would open it with get_filesystem; of the rest it does for a
            # given dirpath, the regional calls above take the checks, and this keeps rank 0's directory
            self.dirpath = trainer.strategy.broadcast(self.dirpath)
            if self.save_last == "link":  # Lightning refuses it for every path that is not local
                raise ValueError(f"`ModelCheckpoint(save_last='link')` is only supported for local file paths, got a "
                                 f"mapping of regional paths: dirpath={self.dirpath}. Use save_last=True.")
            return None
        return setup

    wrap(_CheckpointConnector, "_parse_ckpt_path", parse)
    wrap(_CheckpointConnector, "resume_start", resume)
    wrap(ModelCheckpoint, "file_exists", exists)
    wrap(ModelCheckpoint, "_ModelCheckpoint__warn_if_dir_not_empty", warn)
    wrap(ModelCheckpoint, "_ModelCheckpoint__init_ckpt_dir", init_dir)
    wrap(ModelCheckpoint, "setup", setup)


def checkpoint_dir(callback: ModelCheckpoint, trainer) -> str:
    """The directory ``ModelCheckpoint`` saves into (its ``dirpath``, else derived from loggers / root dir)."""
    resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)  # Lightning's own rule when present
    if resolve is not None:
        return str(resolve(trainer))
    return str(callback.dirpath or f"{trainer.default_root_dir}/checkpoints")


def wrap_lr_scheduler_updates(trainer, wrap: Callable[[Callable[[str, bool], None], str, bool], None]) -> None:
    """Route this Trainer's ``fit_loop.epoch_loop.update_lr_schedulers(interval, update_plateau_schedulers)``
    through ``wrap(original, interval, update_plateau_schedulers)``; on this loop only, until
    ``unwrap_lr_scheduler_updates``."""
    loop = trainer.fit_loop.epoch_loop
    original = loop.update_lr_schedulers

    def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
        wrap(original, interval, update_plateau_schedulers)

    loop.update_lr_schedulers = update_lr_schedulers


def unwrap_lr_scheduler_updates(trainer) -> None:
    """Undo ``wrap_lr_scheduler_updates`` (nothing if it was not done)."""
    loop = trainer.fit_loop.epoch_loop
    if "update_lr_schedulers" in vars(loop):
        del loop.update_lr_schedulers


def set_optimizer_steps(trainer, step: int) -> None:
    """Make ``trainer.global_step`` ``step`` (automatic optimization: the optimizer steps counted)."""
    total = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    total.completed = step
    total.ready = step + 1


def site_sigterm_broadcast(trainer, group, src: int) -> None:
    """Make this Trainer's per-batch SIGTERM broadcast (Lightning 2.6 ``_TrainingEpochLoop._broadcast_sigterm_tensor``,
    over every rank) run over ``group`` from global rank ``src`` (a site's ranks: a SIGTERM then stops that site,
    and the others fail at their next sync); on this loop only, until ``undo_site_sigterm_broadcast``. ``group``
    None: nothing is broadcast (a one-rank site)."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    loop = trainer.fit_loop.epoch_loop

    def _broadcast_sigterm_tensor() -> None:
        flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0],
                            device=trainer.strategy.root_device)
        if group is not None:
            dist.broadcast(flag, src=src, group=group)
        if flag.item() == 1:
            if group is not None:
                dist.barrier(group=group)
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = _broadcast_sigterm_tensor


def undo_site_sigterm_broadcast(trainer) -> None:
    """Undo ``site_sigterm_broadcast`` (nothing if it was not done)."""
    loop = trainer.fit_loop.epoch_loop
    if "_broadcast_sigterm_tensor" in vars(loop):
        del loop._broadcast_sigterm_tensor
