"""``DiLoCoStrategy``: Lightning's DDP inside each site, DiLoCo / streaming DiLoCo across sites.

``Trainer(strategy="diloco")`` (or ``"diloco_spawn"``) takes every setting from the environment
(``MULTIDC_NUM_SITES`` / ``MULTIDC_SITE``, ``MULTIDC_WAN_*``, ``MULTIDC_DILOCO_*``; ``MULTIDC_DILOCO_SYNC_EVERY``
is required); ``DiLoCoStrategy(diloco=DiLoCoConfig(...))`` takes them as arguments. See
``multidc.hierarchical.DiLoCo`` for the algorithm and README "Low-bandwidth sites: DiLoCo".
"""

from __future__ import annotations

from typing import Any

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.diloco import DiLoCo, DiLoCoConfig
from multidc.hierarchical.diloco.config import refuse_loss_scaling
from multidc.plugins._lightning_patches import wrap_lr_scheduler_updates
from multidc.strategies._registry import register as _register
from multidc.strategies._registry import register_all
from multidc.strategies._wan_metrics import WanMetricsCallback
from multidc.strategies.hierarchical_ddp import HierarchicalDDPStrategy, pl


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
    step count and a sync in flight) once: resuming continues as an unbroken run would, and resuming with sites
    the checkpoint lacks raises a ``ValueError`` naming them. ``trainer.validate`` / ``test`` evaluate this
    site's parameters; ``strategy.diloco.global_parameters()`` swaps in the global ones (while fitting).

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
        num_sites, site, wan, checkpoint_async, checkpoint_storage_options, **ddp_kwargs: as for
            ``HierarchicalDDPStrategy``; ``wan`` carries the syncs (its ``compression`` is replaced by
            ``diloco.compression``).

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
        elastic: bool | None = None,
        lighthouse: str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        if diloco is not None and not isinstance(diloco, DiLoCoConfig):
            raise ValueError(f"diloco must be a multidc.hierarchical.DiLoCoConfig, not {type(diloco).__name__}.")
        config = diloco if diloco is not None else DiLoCoConfig()
        ddp_kwargs.setdefault("broadcast_buffers", False)  # each site keeps its own buffers: none cross the WAN
        super().__init__(num_sites=num_sites, site=site, wan=wan, checkpoint_async=checkpoint_async,
                         checkpoint_storage_options=checkpoint_storage_options, elastic=elastic,
                         lighthouse=lighthouse, **ddp_kwargs)
        if self.elastic:
            from multidc.hierarchical.elastic.diloco import check_elastic_config

            check_elastic_config(config)
        self.gradient_sync.diloco_config = config

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

    @property
    def diloco_config(self) -> DiLoCoConfig:
        return self.gradient_sync.diloco_config

    @property
    def diloco(self) -> DiLoCo | None:
        """The running ``DiLoCo`` (stats, ``global_parameters()``), from setup of a fit to teardown; else None."""
        return self.gradient_sync.diloco

    def setup(self, trainer: pl.Trainer) -> None:
        refuse_loss_scaling(getattr(self.precision_plugin, "scaler", None))
        super().setup(trainer)  # DDP with the site-only hook, then the optimizers (when fitting)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if self.elastic and trainer.state.fn == "fit":
            self._start_elastic_diloco(optimizers)
        elif optimizers:  # before a checkpoint is restored into it: Lightning restores after setup
            self.gradient_sync.attach_optimizer(self.model, optimizers)

    def _start_elastic(self, trainer) -> None:
        """Elastic DiLoCo has its quorum per outer round (``ElasticDiLoCo``, built once the optimizer exists). A
        round's quorum starts between two steps, once the LR schedulers stepped: a live site's state then is what
        a joining site holds between steps (its schedulers included)."""
        def update_lr_schedulers(original, interval: str, update_plateau_schedulers: bool) -> None:
            original(interval, update_plateau_schedulers)
            diloco = self.diloco
            if interval == "step" and diloco is not None and diloco.round_pending:
                diloco.start_round()  # a site behind heals here, its count with it
                self._follow_job_step(diloco.inner_steps)

        wrap_lr_scheduler_updates(trainer, update_lr_schedulers)  # undone in teardown

    def _start_elastic_diloco(self, optimizers: list) -> None:
        from multidc.hierarchical.elastic import ElasticDiLoCo

        if len(optimizers) != 1:  # the same check and message as without elastic
            self.gradient_sync.attach_optimizer(self.model, optimizers)
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]

        def load_schedulers(state: dict) -> None:
            for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
                scheduler.load_state_dict(saved)

        # join=False: the first round's quorum waits for the first optimizer step, after Lightning restored a
        # checkpoint (ckpt_path), so the job resumes at the checkpoint's round
        diloco = ElasticDiLoCo(
            self.model, optimizers[0], self.diloco_config, wan=self.wan, start_rounds=False, join=False,
            state_dict=lambda: {"schedulers": [scheduler.state_dict() for scheduler in schedulers]},
            load_state_dict=load_schedulers, site=self._site_name(), lighthouse=self._lighthouse,
            sites=self._elastic_sites,
        )
        self.gradient_sync.adopt_diloco(diloco)
        WanMetricsCallback.add_to(self.lightning_module.trainer, self)  # now that the topology exists

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        diloco = self.diloco if self.elastic else None
        if diloco is not None and diloco.round_pending:  # the first round (after a checkpoint's restore)
            diloco.start_round()
            self._follow_job_step(diloco.inner_steps)  # training_step sees the job's step (a late site's too)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # the post-hook: DiLoCo's step
        if diloco is not None:  # a site that received the live state takes its count
            self._follow_job_step(diloco.inner_steps - 1)  # the loop adds 1 when this returns
        return output

    def _elastic_site_now(self):
        diloco = self.diloco if self.elastic else None
        return diloco.site if diloco is not None else None

    def _checkpoint_sites(self) -> dict[str, Any]:
        if self.elastic:  # the job's state, one site's copy (the round's leader writes it): read on every site
            return {"site": 0, "diloco": self.diloco}
        return {"site": self.topology.site, "diloco": self.diloco} if self.topology is not None else {}

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("diloco", "popen"), ("diloco_spawn", "spawn")):
            description = f"multidc DiLoCo: DDP inside each site, DiLoCo across sites (start_method={start_method!r})"
            _register(strategy_registry, name, cls, description=description, start_method=start_method)


register_all()  # the names, also when this module's own import of Lightning came first (see _registry)

