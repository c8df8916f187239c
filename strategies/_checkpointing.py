"""Lightning checkpoints through multidc's :class:`~multidc.plugins.Checkpointer`, for both multidc strategies.

A Lightning checkpoint path ``P`` (``ModelCheckpoint``'s ``<dirpath>/<name>.ckpt``, or ``trainer.save_checkpoint(P)``;
``s3://...``, ``file://...``, a local path, any fsspec URL) is a *directory* checkpoint, as Lightning's
``ModelParallelStrategy`` writes for sharded state. ``P`` is a Checkpointer root that keeps one committed
checkpoint, named by the global step::

    <dirpath>/last.ckpt/step_0000000008/data/rank00000.distcp ...   every rank's share (replicas striped)
    <dirpath>/last.ckpt/step_0000000008/COMMIT.json                  written last: makes it loadable

Saving ``P`` again (``last.ckpt`` every few steps) writes a new step folder and deletes the previous one only
after the new one committed, so a crash mid-save leaves the previous checkpoint loadable. That holds for any
step: the same step again is replaced in place (new shard objects, then a new ``COMMIT.json``), and a lower one
(a run resumed from an older checkpoint) supersedes the higher one after it committed (``Checkpointer.save(...,
replace=True)``). What is stored:
the model and optimizer states as this rank holds them (DTensor shards under FSDP2/TP, the local stages under
pipeline parallelism; FQN keys, so any later layout reshards them), every rank's RNG streams, and rank 0's
remaining Lightning dict (loops, callbacks, LR schedulers, hyper-parameters) as one blob read back with torch's
safe unpickler.

``trainer.fit(ckpt_path="last")`` with a multidc strategy resolves to the newest committed checkpoint under each
``ModelCheckpoint`` directory (half-written ones have no ``COMMIT.json`` and are never candidates; see
``multidc.plugins.lightning_checkpoint_io.install_last_resolution``).

Region-local: a path with ``{site}`` (or a mapping site -> URL, see ``_checkpoint_paths``) names one store per site;
every site writes its ranks' shards to its own region and loads from it (``multidc.plugins.checkpoint.regions``).
``"last"`` then waits for the strategy's set-up and is the newest step committed in every region; removing a
checkpoint (``save_top_k``) removes every region's part. ``checkpoint_replicas`` also writes each site's own state
(its DiLoCo model) to that many other regions (``Checkpointer(replicas=...)``).
"""

from __future__ import annotations

import datetime
import io
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from multidc.plugins import Checkpointer, RNGState, SaveHandle
from multidc.plugins.checkpoint.comm import Comm, default_timeout_s
from multidc.plugins.checkpoint.regions import env_storage_options, is_regional
from multidc.plugins.checkpoint.retention import clear_file, delete_committed
from multidc.plugins.checkpoint.state import load_optimizer_state_dict, site_key
from multidc.plugins.checkpoint.state import optimizer_state_dict as _optimizer_state_dict

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "multidc's Lightning strategies need Lightning: pip install 'multidc[lightning]' (lightning>=2.5,<2.7)."
    ) from exc

from multidc.plugins.lightning_checkpoint_io import find_last, install_last_resolution  # needs Lightning (above)
from multidc.strategies._checkpoint_paths import (  # noqa: E402
    exists_anywhere,
    locate,
    newest_committed,
    options_setting,
    path_key,
    refuse_single_file,
    regions_of,
    site_leader,
    stores,
    url_of,
)

_MODEL, _OPTIMIZERS, _RNG, _LIGHTNING = "state_dict", "optimizer_states", "rng", "lightning"
_DILOCO = "diloco"
_OPEN_ROOTS = 3  # Checkpointers kept open (each holds a gloo group): ModelCheckpoint alternates few paths


def model_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """The model state as this rank holds it (DTensor shards stay shards), keyed by fully qualified names."""
    return get_model_state_dict(module)


def optimizer_state_dict(module: torch.nn.Module, optimizer) -> dict[str, Any]:
    """The optimizer state as this rank holds it, flattened to per-parameter keys (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``), so stages and shards of different ranks never write the same key. The same code
    path as ``multidc.plugins.ModelState``."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    return _optimizer_state_dict(module, optimizer)


class LightningCheckpoints:
    """Save, load, remove and find Lightning checkpoints as multidc checkpoints. Framework-thin: the strategy
    passes in what it holds. ``save``/``load``/``remove``/``wait``/``close`` are collective (every rank calls them);
    ``find_last`` is not. As with Lightning's ``broadcast``, rank 0's path is the one saved, loaded or removed on
    every rank; the ranks agree on it in a checkpoint collective of their own, so a rank that does not come (hung in
    a callback, dead, cut off) fails every other within the topology's ``WanConfig.timeout_s`` (a ``WanError``
    naming the sites), not the default group's 30 minutes.

    Args:
        async_save: upload in the background; training blocks only for the host-memory snapshot. The next save,
            load, removal or ``close`` (strategy teardown) waits for it and raises its error.
        storage_options: fsspec / s3fs options (``endpoint_url``, ``key``, ``secret``...), or for paths with
            ``{site}`` a mapping site -> options (each region its endpoint and credentials); default
            ``MULTIDC_CKPT_STORAGE_OPTIONS`` (a JSON object), else the standard AWS environment / config. Never logged.
        replicas: for paths with ``{site}`` (or a mapping), how many other regions also hold each site's own state
            (``multidc.plugins.Checkpointer``'s ``replicas``); default ``MULTIDC_CKPT_REPLICAS``, else 0.
    """

    def __init__(self, *, async_save: bool = False, storage_options: dict | None = None,
                 replicas: int | None = None) -> None:
        if not isinstance(async_save, bool):
            raise ValueError(f"checkpoint_async={async_save!r} must be True or False.")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ValueError(
                f"checkpoint_storage_options must be a dict of fsspec options, not {type(storage_options).__name__}."
            )
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
            raise ValueError(f"checkpoint_replicas={replicas!r} must be an int >= 0 (other regions that also hold "
                             "each site's own state) or None.")
        self.async_save, self.replicas = async_save, replicas
        self.storage_options = storage_options if storage_options is not None else env_storage_options()
        self._setting = options_setting(storage_options)  # named when a region refuses its credentials
        self._open: OrderedDict[str, Checkpointer] = OrderedDict()
        self._pending: SaveHandle | None = None
        self._deferred: list[str] = []  # removals waiting for the pending save to commit
        self._paths: Comm | None = None  # the group the ranks agree on paths in (opened at the first call)
        # The job's multidc.hierarchical.Topology (None: one site), which the strategy builds at setup and hands
        # over before each call: checkpoint collectives then wait its WanConfig.timeout_s and name its sites.
        self.topology = None

    def __getstate__(self) -> dict:  # spawn launchers pickle the strategy: nothing is open before launch
        return {**self.__dict__, "_open": OrderedDict(), "_pending": None, "_deferred": [], "topology": None,
                "_paths": None}

    def __setstate__(self, state: dict) -> None:  # a spawned rank resolves ckpt_path="last" too
        self.__dict__.update(state)
        install_last_resolution()

    def _agree(self, path, what: str) -> str:
        """Rank 0's ``path`` (``/``-stripped) on every rank. Collective; the first call opens the group, under the
        same bounded wait (an unresponsive rank fails the others within the timeout, naming it as a WAN failure
        in a multi-site job)."""
        text = path_key(path)
        what = f"agreeing on the checkpoint path to {what} ({text})"
        return self._comm(what).all_gather(text, what=what)[0]

    def _comm(self, what: str) -> Comm:
        if self._paths is None:
            timeout = datetime.timedelta(seconds=default_timeout_s(self.topology))
            self._paths = Comm.create(None, timeout=timeout, topology=self.topology, data=False, what=what)
        self._paths.check_usable()
        return self._paths

    # ------------------------------------------------------------------ save
    def save(self, checkpoint: dict[str, Any], path, *, site: int | None = None, diloco=None) -> None:
        """Save a Lightning checkpoint dict whose ``state_dict`` / ``optimizer_states`` came from
        :func:`model_state_dict` / :func:`optimizer_state_dict`, as checkpoint ``global_step`` under ``path``.
        With ``site`` (DiLoCo: sites differ between syncs) the model and optimizer states go under this site's key
        (``site_<k>``), and the state of ``diloco`` (a ``multidc.hierarchical.DiLoCo``, or its ``DiLoCoShardState``
        under a layout) under ``"diloco"``: the outer state, the same on every site, and with a top-k codec each
        rank's own error-feedback residuals, keyed by its global rank (see docs/guides/diloco.md#checkpoints)."""
        self.wait()
        root = self._agree(path, "save")
        step = int(checkpoint.get("global_step") or 0)
        ckpt = self._checkpointer(root)
        # a single-file checkpoint (another strategy's) at this path goes: a folder cannot coexist with it
        ckpt.comm.from_rank0(lambda: [clear_file(store) for store in stores(ckpt)], what=f"preparing {ckpt.url}",
                             error_type=None)
        optimizers = checkpoint.get(_OPTIMIZERS) or []
        state = _per_site({_MODEL: checkpoint[_MODEL], _OPTIMIZERS: {str(i): s for i, s in enumerate(optimizers)}},
                          site, diloco)
        state[_RNG] = RNGState()
        if site_leader(ckpt):  # like Lightning's DDP: rank 0's loops / callbacks / hyper-parameters (regions: each
            # site's first rank's, so every region holds them and a site reads its own)
            rest = {k: v for k, v in checkpoint.items() if k not in (_MODEL, _OPTIMIZERS)}
            buffer = io.BytesIO()
            torch.save({"checkpoint": rest, "optimizers": len(optimizers)}, buffer)
            state[_LIGHTNING] = buffer.getvalue()
        # replace: the same step saved again, or a run rewound to an earlier checkpoint, must become what this
        # path holds; the committed checkpoint it supersedes is deleted only after this one committed.
        handle = ckpt.save(state, step=step, async_save=self.async_save, replace=True)  # sync: committed here
        self._pending = handle if self.async_save else None

    # ------------------------------------------------------------------ load
    def load(self, path, *, module: torch.nn.Module, optimizers: list, fitting: bool, strict: bool = True,
             trusted: bool = False, site: int | None = None, diloco=None) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``module`` and (when ``fitting``) ``optimizers`` and this rank's
        RNG streams, resharding to this layout; return the rest of the Lightning dict.

        ``path``: a Lightning checkpoint path (its newest committed step), a step folder, or its ``COMMIT.json``.
        ``site`` / ``diloco``: read this site's model and optimizer states and restore the DiLoCo state (see
        ``save``); a checkpoint without this site's key raises a ``ValueError`` naming the sites it holds. Top-k
        residuals the checkpoint lacks for this rank (saved without top-k, or by other ranks) restart at zero,
        logged (``multidc.plugins.checkpoint.planner.SafeLoadPlanner``); every other key loads strictly.
        """
        self.wait()
        root, which = locate(self._agree(path, "load"))
        ckpt = self._checkpointer(root)
        ckpt.comm.from_rank0(lambda: refuse_single_file(ckpt), what=f"reading {ckpt.url}", error_type=None)
        header = {_LIGHTNING: b""}
        info = ckpt.load(header, which, trusted=trusted)
        saved = _safe_load(header[_LIGHTNING], trusted, ckpt.store.where(info.name))
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers] if fitting else []
        if optimizers and saved["optimizers"] and saved["optimizers"] != len(optimizers):
            raise ValueError(
                f"checkpoint {info.url} holds {saved['optimizers']} optimizer states but configure_optimizers "
                f"returned {len(optimizers)} optimizers; resume with the optimizers it was saved with."
            )
        optimizers = optimizers if saved["optimizers"] else []  # a weights-only checkpoint: Lightning says so
        held = {_MODEL: model_state_dict(module),
                _OPTIMIZERS: {str(i): optimizer_state_dict(module, o) for i, o in enumerate(optimizers)}}
        state = _per_site(held, site, diloco if fitting else None)  # evaluating: this site's weights only
        if fitting:
            state[_RNG] = RNGState()
        ckpt.load(state, info, trusted=trusted, allow_partial=not strict)
        set_model_state_dict(module, held[_MODEL], options=StateDictOptions(strict=strict))
        for i, optimizer in enumerate(optimizers):
            load_optimizer_state_dict(module, optimizer, held[_OPTIMIZERS][str(i)])
        return saved["checkpoint"]

    # ------------------------------------------------------------------ remove / find
    def remove(self, path) -> None:
        """Delete the checkpoint at ``path`` (rank 0). While a save is uploading, the removal waits for its commit,
        so ``save_top_k`` never deletes the previous checkpoint before the new one is loadable."""
        root = self._agree(path, "remove")
        if self._pending is not None:
            self._deferred.append(root)
            return
        self._remove_now([root])

    def _remove_now(self, roots: list[str]) -> None:
        for root in roots:  # collective: every rank removes the same roots in the same order
            ckpt = self._checkpointer(root)
            try:
                ckpt.comm.from_rank0(lambda: [delete_committed(s) for s in stores(ckpt)],  # noqa: B023
                                     what=f"removing {ckpt.url}", error_type=None)
            finally:
                del self._open[root]
                ckpt.close()

    def find_last(self, dirpath) -> set[str]:
        """See ``multidc.plugins.lightning_checkpoint_io.find_last`` (one store; ``"last"`` under a ``{site}``
        directory is :meth:`resolve_last`'s)."""
        return find_last(dirpath, storage_options=self.storage_options, step_folders=True)

    # ------------------------------------------------------------------ regional paths (Lightning's own calls)
    def is_regional(self, path) -> bool:
        """Whether ``path`` names one store per site (``{site}``, a mapping, or a mapping's text with a suffix)."""
        return is_regional(url_of(path_key(path)))

    def resolve_last(self, dirs) -> str | None:
        """``ckpt_path="last"`` under the ``ModelCheckpoint`` directories ``dirs``, after set-up: the newest
        checkpoint committed in every region (``_checkpoint_paths.newest_committed``), or ``None`` (warned, as
        Lightning does). Collective: rank 0 looks, every rank gets its answer or its error."""
        what = f"finding the last checkpoint under {', '.join(map(str, dirs))}"
        comm = self._comm(what)
        found = comm.from_rank0(lambda: newest_committed(dirs, self.storage_options, self.topology,
                                                         setting=self._setting), what=what, error_type=None)
        if found is None:
            rank_zero_warn(f'ckpt_path="last" is set, but no checkpoint is committed in every region under '
                           f"{', '.join(map(str, dirs))}. No checkpoint will be loaded.")
        return found

    def exists(self, path) -> bool:
        """Whether any region holds something at the regional ``path`` (``ModelCheckpoint.file_exists``).
        Collective: rank 0 looks, every rank gets its answer or its error."""
        what = f"checking whether {path} exists"
        return bool(self._comm(what).from_rank0(
            lambda: exists_anywhere(regions_of(path_key(path), self.storage_options, self.topology,
                                               setting=self._setting)), what=what, error_type=None))

    # ------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Wait for the pending save (raising its error), then run the removals that waited for it."""
        pending, self._pending = self._pending, None
        deferred, self._deferred = self._deferred, []
        if pending is not None:
            pending.wait()  # on failure the deferred removals are dropped: the old checkpoints stay
        if deferred:
            self._remove_now(deferred)

    def close(self) -> None:
        """Wait for the pending save (raising its error) and release every Checkpointer's process group."""
        try:
            self.wait()
        finally:
            while self._open:
                self._open.popitem(last=False)[1].close()
            paths, self._paths = self._paths, None
            if paths is not None:
                paths.close()

    def _checkpointer(self, root: str) -> Checkpointer:
        ckpt = self._open.pop(root, None)
        if ckpt is None:  # collective: every rank opens the same roots in the same order
            url = url_of(root)
            if is_regional(url):
                regions_of(root, self.storage_options, self.topology)  # no sites: say so in Lightning's words
            elif self.replicas:
                raise ValueError(f"checkpoint_replicas={self.replicas} copies each site's own state to other regions, "
                                 f"but checkpoint path {url!r} names one store: put {{site}} in it (or give a mapping "
                                 "site -> URL), or leave checkpoint_replicas unset.")
            ckpt = Checkpointer(url, storage_options=self.storage_options, keep_last_k=1, replicas=self.replicas,
                                async_save=self.async_save, topology=self.topology)
            if ckpt.regions is not None:  # errors name what the user set: this argument, or the variable
                ckpt.regions.setting = self._setting
        self._open[root] = ckpt
        while len(self._open) > _OPEN_ROOTS:
            self._open.popitem(last=False)[1].close()
        return ckpt


def _per_site(state: dict, site: int | None, diloco) -> dict:
    """``state`` as saved / loaded: under this site's key (next to the DiLoCo state), or as it is."""
    if site is None:
        return dict(state)
    return {site_key(site): state, **({_DILOCO: diloco} if diloco is not None else {})}


def _safe_load(blob: bytes, trusted: bool, where: str) -> dict:
    try:
        return torch.load(io.BytesIO(blob), weights_only=not trusted, map_location="cpu")
    except Exception as exc:
        raise ValueError(
            f"the Lightning state of checkpoint {where} holds objects torch's safe loading refuses ({exc}). If you "
            "trust this store, allow their classes with torch.serialization.add_safe_globals([...])."
        ) from exc


class CheckpointingMixin:
    """The Lightning ``Strategy`` side: put it before the Lightning base class. Call ``_init_checkpointing`` in
    ``__init__``; the strategy provides ``topology`` (``None`` before setup or with one site).
    ``_sharded_checkpoints()`` ``False`` falls back to the base class's checkpointing."""

    def _init_checkpointing(self, checkpoint_async: bool, checkpoint_storage_options: dict | None,
                            checkpoint_replicas: int | None = None) -> None:
        install_last_resolution()  # ckpt_path="last": the newest committed multidc checkpoint
        self._multidc_checkpoints = LightningCheckpoints(
            async_save=checkpoint_async, storage_options=checkpoint_storage_options, replicas=checkpoint_replicas
        )

    def _sharded_checkpoints(self) -> bool:
        return True

    def _checkpoint_sites(self) -> dict[str, Any]:
        """``{}``, or under DiLoCo ``{"site": this site, "diloco": the DiLoCo (None when not fitting)}``:
        checkpoints then hold per-site model / optimizer states and the DiLoCo state. DiLoCo strategies override
        it."""
        return {}

    def _checkpoints(self) -> LightningCheckpoints:
        """The checkpoint writer, handed this strategy's topology first: it is built at setup, after ``__init__``."""
        self._multidc_checkpoints.topology = self.topology
        return self._multidc_checkpoints

    @property
    def multidc_checkpoints(self) -> LightningCheckpoints | None:
        """The checkpoint writer, or ``None`` when the strategy writes Lightning's own format."""
        return self._multidc_checkpoints if self._sharded_checkpoints() else None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Loading reshards into the layout, so the model must be in it (and the optimizers exist) first.
        return True if self._sharded_checkpoints() else super().restore_checkpoint_after_setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False if self._sharded_checkpoints() else super().lightning_restore_optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._sharded_checkpoints():
            return super().lightning_module_state_dict()
        return model_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self._sharded_checkpoints():
            return super().optimizer_state(optimizer)
        return optimizer_state_dict(self.lightning_module, optimizer)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._sharded_checkpoints():
            super().load_model_state_dict(checkpoint, strict=strict)
        # else: load_checkpoint loaded the weights in place already

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self._sharded_checkpoints():
            super().load_optimizer_state_dict(checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self._sharded_checkpoints():
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes storage options once, as checkpoint_storage_options=..., not per save."
            )
        self._checkpoints().save(checkpoint, filepath, **self._checkpoint_sites())
        return None

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if not self._sharded_checkpoints():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = self.lightning_module.trainer
        return self._checkpoints().load(
            checkpoint_path, module=self.lightning_module, optimizers=list(self.optimizers),
            fitting=trainer.state.fn == TrainerFn.FITTING, strict=self.lightning_module.strict_loading,
            trusted=weights_only is False, **self._checkpoint_sites(),
        )

    def remove_checkpoint(self, filepath) -> None:
        if not self._sharded_checkpoints():
            return super().remove_checkpoint(filepath)
        self._checkpoints().remove(filepath)
        return None

    def teardown(self) -> None:
        try:
            self._checkpoints().close()  # the last async upload: its error surfaces here
        finally:
            super().teardown()

