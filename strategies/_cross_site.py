"""Elastic sites under Lightning: ``elastic=True`` on ``HierarchicalDDPStrategy``, ``DiLoCoStrategy`` and
``Parallel3DStrategy`` (env ``MULTIDC_ELASTIC=1``). Each site is its own Lightning job (its own launch, its own
rendezvous; ``devices`` / ``num_nodes`` count that site's ranks); DDP or FSDP2 reduce inside the site, and the
job's elastic sync (``multidc.hierarchical.elastic.steps.elastic_sync``: a quorum per step, or per DiLoCo round)
crosses the WAN. ``optimizer_step`` calls it at the points of ``multidc.hierarchical.cross_site.CrossSite``:

1. ``before_step()``: the quorum of sites present (per-step sites; DiLoCo: the first round); a (re)started site
   receives the model, optimizer and LR scheduler states from a live site here (not from storage);
2. the training step and backward (Lightning's closure), then ``after_backward``: the average over the sites;
3. ``commit()``: the optimizer and the LR schedulers step only if the step commits; a discarded step changes no
   weight, optimizer or scheduler state (its batch is consumed, not retried);
4. after the LR schedulers stepped, ``after_step()``: a DiLoCo round that ended starts the next one's quorum.

The Trainer's ``global_step`` follows the job's steps, so ``max_steps`` ends every site at the same step and a
rejoined site continues the job's count. Checkpoints (``ModelCheckpoint`` on every site, as usual) are written by one
site, also in a degraded quorum, so each save happens once: saves come at the batch end, after the commit, through
``save_once`` (who writes: ``multidc.hierarchical.elastic.writer``). ``fit(ckpt_path=...)`` on one site or all
resumes the job at the checkpoint's step (the first quorum gives that state to sites that start without one). A
``monitor``-ed top-k follows the leader's metrics. Refused, with a clear error: gradient accumulation with per-step
sites (a site receiving the live state mid-accumulation would mix gradients of two models), fp16 loss scaling (the
scale is not shared), and LR schedulers other than ``interval="step"``, ``frequency=1`` (epochs and batch counts
differ per site).
"""
from __future__ import annotations

from typing import Any

from multidc.plugins._lightning_patches import (
    set_optimizer_steps,
    unwrap_lr_scheduler_updates,
    wrap_lr_scheduler_updates,
)


class ElasticMixin:
    """Mixed into a Lightning strategy before it: with ``elastic``, ``optimizer_step`` drives the job's elastic
    ``CrossSite`` sync (``multidc.hierarchical.elastic.steps.elastic_sync``: a quorum per step, or per DiLoCo round)
    at the protocol's points, the same for every cross-site method and layout."""

    def _init_elastic(self, elastic: bool | None, lighthouse: str | None, sites: int | None) -> None:
        from multidc.hierarchical.elastic import resolve_elastic

        self.elastic = resolve_elastic(elastic, lighthouse)  # a missing or malformed address fails here
        self.elastic_sync = None
        """The running elastic ``CrossSite`` sync (elastic mode, during ``fit``), else None."""
        self.elastic_committed = False
        """Whether the last optimizer step committed (elastic mode)."""
        self._lighthouse, self._elastic_sites = lighthouse, sites

    @property
    def elastic_site(self):
        """The running ``ElasticSite`` (elastic mode, during ``fit``), else None."""
        return getattr(self.elastic_sync, "site", None)

    def _setup_elastic(self, trainer) -> None:
        """At the end of ``setup`` (the model wrapped, the optimizers built): the elastic sync, when fitting."""
        if not self.elastic or trainer.state.fn != "fit":  # validate / test / predict: no steps to agree on
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError("elastic=True needs automatic optimization (the strategy decides whether a step commits).")
        from multidc.hierarchical.diloco.config import refuse_loss_scaling
        from multidc.hierarchical.elastic.steps import elastic_sync

        refuse_loss_scaling(getattr(self.precision_plugin, "scaler", None), mode="elastic")
        refuse_per_epoch_schedulers(self.lr_scheduler_configs)
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]

        def load_schedulers(state: dict) -> None:
            for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
                scheduler.load_state_dict(saved)

        # a quorum in optimizer_step comes after the accumulated micro-batches: accumulation_steps refuses it there
        self.elastic_sync = elastic_sync(
            self.model, [getattr(o, "_optimizer", o) for o in self.optimizers], diloco=self._elastic_diloco(),
            wan=self.wan, accumulation_steps=trainer.accumulate_grad_batches,
            state_dict=lambda: {"schedulers": [scheduler.state_dict() for scheduler in schedulers]},
            load_state_dict=load_schedulers, replica_group=self._replica_group(), site=self._site_name(),
            lighthouse=self._lighthouse, sites=self._elastic_sites,
        )

        def update_lr_schedulers(original, interval: str, update_plateau_schedulers: bool) -> None:
            if self.elastic_committed:  # a discarded step leaves the schedulers (and their progress) as they are
                original(interval, update_plateau_schedulers)
            sync = self.elastic_sync
            if interval == "step" and sync is not None:  # between two steps, the schedulers stepped: a DiLoCo
                sync.after_step()  # round's quorum here gives a joining site the state it holds between steps
                self._follow_job_step(sync.job_step)

        wrap_lr_scheduler_updates(trainer, update_lr_schedulers)  # undone in teardown

    def _elastic_diloco(self):
        """The ``DiLoCoConfig`` of an elastic DiLoCo job; None: per-step sites."""
        return None

    def _replica_group(self):
        """The ranks of this site holding this rank's parameters (``ElasticSite(replica_group=)``); None: all (DDP)."""
        return None

    def _site_name(self) -> str | None:
        site = getattr(self, "site", None)
        return str(site) if site is not None else None

    def on_train_start(self) -> None:
        """The job's first quorum, before the first (micro-)batch, after Lightning restored a checkpoint
        (``ckpt_path``: the job's step is its step): a site that heals here computes its first gradients on the
        live state."""
        super().on_train_start()
        sync = self.elastic_sync
        if sync is not None:
            sync.resume(self.lightning_module.trainer.global_step)
            sync.before_step()
            self._follow_job_step(sync.job_step)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        sync = self.elastic_sync
        if sync is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        sync.before_step()  # the step's quorum (the first one formed at the train start)
        self._follow_job_step(sync.job_step)  # training_step sees the job's step (a rejoined site's too)
        result = closure()  # training_step + backward; DDP / FSDP2 reduce inside the site
        sync.after_backward(self.model)
        output, self.elastic_committed = result, sync.commit()
        if self.elastic_committed:
            output = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        self._follow_job_step(sync.job_step - 1)  # the loop adds 1 when this returns
        return output

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Elastic: one site writes (one copy of the identical state; collective over that site's ranks), so every
        site may run the same ``ModelCheckpoint`` (``CrossSite.save_once``; who writes:
        ``multidc.hierarchical.elastic.writer``)."""
        sync = self.elastic_sync
        if sync is None:  # not fitting: as the last step's leader decided (trainer.save_checkpoint after fit)
            if self._elastic_leader():
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return None
        from multidc.plugins.checkpoint.state import with_streams_of_now

        save = super().save_checkpoint  # Lightning built `checkpoint` now; the random streams are read at the save
        sync.save_once(with_streams_of_now(lambda: save(checkpoint, filepath, storage_options=storage_options)))
        return None

    def remove_checkpoint(self, filepath) -> None:
        """Elastic: only the leader site removes (what ``save_top_k`` drops), as only it writes."""
        if not self._elastic_leader():
            return None
        return super().remove_checkpoint(filepath)

    def _elastic_leader(self) -> bool:
        """Whether this site writes checkpoints: outside elastic mode always; while fitting, the leader of the step's
        quorum; after the fit, the leader of its last step (``trainer.save_checkpoint`` after ``fit``)."""
        sync = self.elastic_sync
        return sync.writes_checkpoints if sync is not None else getattr(self, "_was_leader", True)

    def _follow_job_step(self, step: int) -> None:
        """Make the Trainer's ``global_step`` the job's ``step``."""
        set_optimizer_steps(self.lightning_module.trainer, step)

    def _teardown_elastic(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            unwrap_lr_scheduler_updates(trainer)
        sync, self.elastic_sync = self.elastic_sync, None
        if sync is not None:
            self._was_leader = sync.writes_checkpoints
            sync.close()


def refuse_per_epoch_schedulers(configs) -> None:
    """Elastic sites step LR schedulers per optimizer step, on every site alike: refuse the others."""
    for config in configs:
        if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
            raise ValueError(
                f"elastic=True steps LR schedulers once per committed step; {type(config.scheduler).__name__} "
                f"has interval={config.interval!r}, frequency={config.frequency}"
                f"{', reduce_on_plateau' if config.reduce_on_plateau else ''}. Return it from configure_optimizers "
                f"with {{'interval': 'step', 'frequency': 1}} (epochs and batch counts differ between sites)."
            )
