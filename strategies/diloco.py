"""``DiLoCoStrategy``: Lightning's DDP inside each site, DiLoCo / streaming DiLoCo across sites.

``Trainer(strategy="diloco")`` (or ``"diloco_spawn"``) takes every setting from the environment
(``MULTIDC_NUM_SITES`` / ``MULTIDC_SITE``, ``MULTIDC_WAN_*``, ``MULTIDC_DILOCO_*``; ``MULTIDC_DILOCO_SYNC_EVERY``
is required); ``DiLoCoStrategy(diloco=DiLoCoConfig(...))`` takes them as arguments. See
``multidc.hierarchical.DiLoCo`` for the algorithm and docs/guides/diloco.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.diloco import DiLoCoConfig
from multidc.plugins._lightning_patches import site_sigterm_broadcast, undo_site_sigterm_broadcast
from multidc.strategies._registry import register as _register
from multidc.strategies._registry import register_all
from multidc.strategies.hierarchical_ddp import HierarchicalDDPStrategy

if TYPE_CHECKING:  # Lightning is imported (with a clear ImportError) by hierarchical_ddp above
    import lightning.pytorch as pl


class DiLoCoStrategy(HierarchicalDDPStrategy):
    """Lightning ``DDPStrategy`` whose gradients are averaged inside each site only; every ``sync_every``
    optimizer steps DiLoCo averages the sites' pseudo-gradients over the WAN and steps its outer optimizer.

    The training loop is unchanged: DiLoCo runs after each optimizer step (a step post-hook), so gradient
    accumulation (``accumulate_grad_batches``: one inner step per optimizer step) and gradient clipping behave
    as under DDP. ``configure_optimizers`` must return exactly one optimizer (DiLoCo's inner optimizer);
    LR schedulers work as usual. Logged once per optimizer step: ``wan/bytes_sent``, ``wan/outer_syncs`` and
    ``wan/exposed_s`` (seconds the step waited for a sync), this rank's.

    Checkpoints (multidc's sharded, committed ones; see ``HierarchicalDDPStrategy``) hold each site's model and
    optimizer states under ``site_<k>`` and the DiLoCo state (float32 global parameters, outer momentum, the
    step count and a sync in flight) once, and with ``compression="topk"`` every rank's own residuals: resuming
    with the same ranks continues as an unbroken run would, and resuming with sites the checkpoint lacks raises a
    ``ValueError`` naming them (residuals missing for a rank restart at zero: docs/guides/diloco.md#checkpoints).
    ``trainer.validate`` / ``test`` evaluate this site's parameters; ``strategy.diloco.global_parameters()`` swaps
    in the global ones (while fitting).

    ``elastic=True`` (env ``MULTIDC_ELASTIC=1``; see ``HierarchicalDDPStrategy``): each site is its own job and
    each outer sync has its own quorum of the sites present (``multidc.hierarchical.elastic.ElasticDiLoCo``); a
    restarted site receives the global parameters, the outer and inner optimizer states, the LR schedulers and the
    job's inner step from a live site. ``ModelCheckpoint`` runs on every site as usual and the first site of the
    round's quorum writes each checkpoint, once, also in a degraded round: its model and inner optimizer (as site 0)
    and the DiLoCo state with the job's round. ``fit(ckpt_path=...)`` on one site or all resumes the job there.
    In plain DiLoCo without overlap, save at round ends (``every_n_train_steps`` a multiple of ``sync_every``) for
    a resume that continues as an unbroken run; any other checkpoint (and every one in streaming or overlapped
    DiLoCo) resumes every site from the saving site's parameters. Streaming DiLoCo (``fragments > 1``) has a
    quorum per fragment sync; with ``overlap_steps`` a round ends when its sync's result merges.

    Args:
        diloco: ``DiLoCoConfig``; default ``DiLoCoConfig()`` from ``MULTIDC_DILOCO_*``, built here, so a missing
            ``sync_every`` fails at construction.
        num_sites: as for ``HierarchicalDDPStrategy``.
        site: as for ``HierarchicalDDPStrategy``.
        wan: as for ``HierarchicalDDPStrategy``; it carries the syncs (its ``compression`` is replaced by
            ``diloco.compression``).
        checkpoint_async: as for ``HierarchicalDDPStrategy``.
        checkpoint_storage_options: as for ``HierarchicalDDPStrategy``.
        checkpoint_replicas: as for ``HierarchicalDDPStrategy``: with one store per site, each site's model (and
            per-rank residuals) is also written to that many other regions.
        **ddp_kwargs: as for ``HierarchicalDDPStrategy``.

    Raises:
        ValueError: bad settings, at construction; not exactly one optimizer, or differing settings or models
            across ranks, on every rank at setup, before training.
    """

    strategy_name = "diloco"

    def __init__(
        self,
        *,
        diloco: DiLoCoConfig | None = None,
        num_sites: int | None = None,
        site: int | str | None = None,
        wan: WanConfig | None = None,
        checkpoint_async: bool = False,
        checkpoint_storage_options: dict | None = None,
        checkpoint_replicas: int | None = None,
        elastic: bool | None = None,
        lighthouse: str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if diloco is not None and not isinstance(diloco, DiLoCoConfig):
            raise ValueError(f"diloco must be a multidc.hierarchical.DiLoCoConfig, not {type(diloco).__name__}.")
        self._diloco_arg = diloco if diloco is not None else DiLoCoConfig()
        ddp_kwargs.setdefault("broadcast_buffers", False)  # each site keeps its own buffers: none cross the WAN
        super().__init__(num_sites=num_sites, site=site, wan=wan, checkpoint_async=checkpoint_async,
                         checkpoint_storage_options=checkpoint_storage_options,
                         checkpoint_replicas=checkpoint_replicas, elastic=elastic,
                         lighthouse=lighthouse, **ddp_kwargs)

    def setup(self, trainer: pl.Trainer) -> None:
        """As ``HierarchicalDDPStrategy.setup`` (with rounds by time, first ``refuse_time_round_hazards``); then DiLoCo
        learns where training ends (``trainer.max_steps``, ``DiLoCo.finish_at``): with rounds by time
        (``DiLoCoConfig.sync_every_s``) the sites agree on a last round from it, and this strategy sets
        ``trainer.should_stop`` once ``DiLoCo.should_stop`` says so."""
        if self._diloco_arg.sync_every_s is not None:
            refuse_time_round_hazards(trainer)  # every rank alike, before any collective
        super().setup(trainer)
        if self.diloco is None:
            return
        self.diloco.finish_at(trainer.max_steps if trainer.max_steps >= 0 else None)
        if self.diloco.config.sync_every_s is not None:  # the sites' step counts differ: no per-batch collective
            topo = self.diloco.topology
            site_sigterm_broadcast(trainer, topo.intra_group if topo.site_size > 1 else None,
                                   topo.layout.site_ranks[topo.site][0])

    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            undo_site_sigterm_broadcast(trainer)
        super().teardown()

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.diloco is not None and self.diloco.should_stop:  # every rank after the same sync (rounds by time)
            self.lightning_module.trainer.should_stop = True
        return output

    def _sharded_checkpoints(self) -> bool:
        return True

    @property
    def checkpoint_io(self):
        return HierarchicalDDPStrategy.checkpoint_io.fget(self)

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        if io is not None:
            raise ValueError(
                f"DiLoCoStrategy cannot use {type(io).__name__}: its checkpoints hold every site's own model and the "
                "DiLoCo state, which a single-file CheckpointIO cannot; drop the plugin (checkpoints go to any fsspec "
                "URL, s3:// included, through multidc's writer)."
            )

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("diloco", "popen"), ("diloco_spawn", "spawn")):
            description = f"multidc DiLoCo: DDP inside each site, DiLoCo across sites (start_method={start_method!r})"
            _register(strategy_registry, name, cls, description=description, start_method=start_method)


def refuse_time_round_hazards(trainer: pl.Trainer) -> None:
    """With rounds by time each site reaches a step count, an epoch's end or a time limit at its own moment: refuse
    the Trainer settings that would then wait for each other across sites (or stop one site alone) and hang.

    Raises:
        ValueError: naming the Trainer setting and the fix.
    """
    from lightning.pytorch.callbacks import EarlyStopping, Timer
    from lightning.pytorch.utilities.model_helpers import is_overridden

    why = "DiLoCoConfig.sync_every_s is set: each site runs its own number of steps, so"
    if trainer.max_steps is None or trainer.max_steps < 0:
        raise ValueError(f"{why} training must end by Trainer(max_steps=N) (the sites agree on a last round from "
                         f"it); set max_steps, or unset sync_every_s / MULTIDC_DILOCO_SYNC_EVERY_S.")
    if trainer.max_epochs not in (None, -1) or any(isinstance(cb, Timer) for cb in trainer.callbacks):
        raise ValueError(f"{why} epochs and time limits end at different moments on different sites (Trainer("
                         f"max_epochs={trainer.max_epochs}) or max_time): leave max_epochs and max_time unset and end "
                         f"by max_steps.")
    if trainer.checkpoint_callbacks:
        raise ValueError(f"{why} a ModelCheckpoint (Lightning adds one by default, saving at each epoch's end) would "
                         f"save at different moments on different sites and wait for the others: pass "
                         f"Trainer(enable_checkpointing=False) and no ModelCheckpoint callback.")
    if trainer.min_steps not in (None, -1, 0):
        raise ValueError(f"{why} Trainer(min_steps={trainer.min_steps}) would keep a site training past the sites' "
                         f"last round, while the others stop: leave min_steps unset.")
    if any(isinstance(cb, EarlyStopping) for cb in trainer.callbacks):
        raise ValueError(f"{why} EarlyStopping decides at each epoch's end with a collective over every rank, which "
                         f"the sites reach at different moments: remove the EarlyStopping callback.")
    if trainer.ckpt_path is not None:
        raise ValueError(f"{why} Lightning's one global_step cannot hold every site's step count: fit(ckpt_path="
                         f"{trainer.ckpt_path!r}) is not supported with rounds by time yet: start anew (no ckpt_path), "
                         f"or train with fixed rounds (sync_every_s unset) to resume.")
    module = trainer.lightning_module
    if trainer.limit_val_batches != 0 and module is not None and is_overridden("validation_step", module):
        raise ValueError(f"{why} validation inside fit would run at different moments on different sites (its "
                         f"dataloader set-up is a barrier over every rank): pass Trainer(limit_val_batches=0) and "
                         f"call trainer.validate after fit.")


register_all()  # the names, also when this module's own import of Lightning came first (see _registry)
