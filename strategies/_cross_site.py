"""The one Lightning driver of a job's ``multidc.hierarchical.CrossSite`` sync (``CrossSiteMixin``), for
``HierarchicalDDPStrategy``, ``DiLoCoStrategy`` and ``Parallel3DStrategy`` whatever crosses the WAN.

Elastic sites under Lightning: ``elastic=True`` on any of them (env ``MULTIDC_ELASTIC=1``). Each site is its own
Lightning job (its own launch, its own rendezvous; ``devices`` / ``num_nodes`` count that site's ranks); DDP or FSDP2
reduce inside the site, and the job's elastic sync (``multidc.hierarchical.elastic.steps.ElasticSync``: a quorum per
step, or per DiLoCo round) crosses the WAN. ``optimizer_step`` calls it at the points of
``multidc.hierarchical.cross_site.CrossSite``:

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

from multidc.hierarchical._gradient_sync import HasGradientSync
from multidc.plugins._lightning_patches import (
    set_optimizer_steps,
    unwrap_lr_scheduler_updates,
    wrap_lr_scheduler_updates,
)


class CrossSiteMixin(HasGradientSync):
    """Mixed into a Lightning strategy before it: the one driver of the job's ``CrossSite`` sync
    (``self.gradient_sync``, from ``multidc.hierarchical.cross_site_sync``), the same for every cross-site method,
    elastic or not, and every layout. The strategy builds the topology and attaches DDP where Lightning sets them
    up; ``_attach_sync`` attaches the model and optimizers at the end of ``setup``; a sync that ``drives_steps``
    (elastic) runs its points from ``optimizer_step``."""

    def _attach_sync(self, trainer, parallel=None) -> None:
        """At the end of ``setup`` when fitting (the model wrapped, the optimizers built, before Lightning restores
        a checkpoint into them): attach the sync; one that drives the steps gets the LR scheduler hook."""
        if trainer.state.fn != "fit":  # validate / test / predict: nothing crosses the WAN
            return
        sync = self.gradient_sync
        if sync.drives_steps and not self.lightning_module.automatic_optimization:
            raise ValueError("elastic=True needs automatic optimization (the strategy decides whether a step commits).")
        if sync.drives_steps:
            refuse_per_epoch_schedulers(self.lr_scheduler_configs)
        # a quorum in optimizer_step comes after the accumulated micro-batches: accumulation_steps refuses it there
        sync.attach([self.model], [getattr(o, "_optimizer", o) for o in self.optimizers], parallel=parallel,
                    carry=[config.scheduler for config in self.lr_scheduler_configs],
                    accumulation_steps=trainer.accumulate_grad_batches,
                    scaler=getattr(self.precision_plugin, "scaler", None))
        if not sync.drives_steps:
            return

        def update_lr_schedulers(original, interval: str, update_plateau_schedulers: bool) -> None:
            if self.elastic_committed:  # a discarded step leaves the schedulers (and their progress) as they are
                original(interval, update_plateau_schedulers)
            if interval == "step" and sync.attached:  # between two steps, the schedulers stepped: a DiLoCo
                sync.after_step()  # round's quorum here gives a joining site the state it holds between steps
                self._follow_job_step(sync.job_step)

        wrap_lr_scheduler_updates(trainer, update_lr_schedulers)  # undone in teardown

    def on_train_start(self) -> None:
        """An elastic job's first quorum, before the first (micro-)batch, after Lightning restored a checkpoint
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
        if sync is None:  # the sync's work runs in hooks
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
        """Written where ``CrossSite.save_once`` says: elastic, by one site (one copy of the identical state;
        collective over that site's ranks; who writes: ``multidc.hierarchical.elastic.writer``), so every site may
        run the same ``ModelCheckpoint``; else here."""
        from multidc.plugins.checkpoint.state import with_streams_of_now

        save = super().save_checkpoint  # Lightning built `checkpoint` now; the random streams are read at the save
        self.gradient_sync.save_once(
            with_streams_of_now(lambda: save(checkpoint, filepath, storage_options=storage_options)))

    def remove_checkpoint(self, filepath) -> None:
        """Only a site that writes checkpoints removes (what ``save_top_k`` drops)."""
        if self.gradient_sync.writes_checkpoints:
            super().remove_checkpoint(filepath)

    def _checkpoint_sites(self) -> dict[str, Any]:
        return self.gradient_sync.checkpoint_sites()

    def _follow_job_step(self, step: int) -> None:
        """Make the Trainer's ``global_step`` the job's ``step``."""
        set_optimizer_steps(self.lightning_module.trainer, step)

    def _close_sync(self) -> None:
        try:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            if trainer is not None:
                unwrap_lr_scheduler_updates(trainer)
        finally:
            self.gradient_sync.close()


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
