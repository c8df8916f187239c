"""Elastic sites under Lightning: the strategy side of ``multidc.hierarchical.elastic.ElasticSite``.

``HierarchicalDDPStrategy(elastic=True)`` (env ``MULTIDC_ELASTIC=1``): each site is its own Lightning job (its own
launch, its own rendezvous; ``devices`` / ``num_nodes`` count that site's ranks), DDP averages gradients inside the
site, and every optimizer step is one step of the elastic job:

1. ``start_step()``: the quorum of sites present; a (re)started site receives the model, optimizer and LR
   scheduler states from a live site here (not from storage);
2. the training step and backward (Lightning's closure), then ``sync_gradients``: the average over the sites;
3. ``commit()``: the optimizer and the LR schedulers step only if the step commits; a discarded step changes no
   weight, optimizer or scheduler state (its batch is consumed, not retried).

The Trainer's ``global_step`` follows the job's committed steps, so ``max_steps`` ends every site at the same step
and a rejoined site continues the job's count. Checkpoints (``ModelCheckpoint`` on every site, as usual) are written
by one site, also in a degraded quorum, so each save happens once: saves come at the batch end, after the commit,
through ``ElasticSite.save_once`` (who writes: ``multidc.hierarchical.elastic.writer``). ``fit(ckpt_path=...)`` on
one site or all resumes the
job at the checkpoint's step (the first quorum gives that state to sites that start without one). A ``monitor``-ed
top-k follows the leader's metrics. Refused, with a clear error: gradient accumulation (a site receiving the live
state mid-accumulation would mix gradients of two models), fp16 loss scaling (the scale is not
shared), and LR schedulers other than ``interval="step"``, ``frequency=1`` (epochs and batch counts differ per site).
"""

from __future__ import annotations

from typing import Any

from multidc.hierarchical.elastic.shards import load_module_state, load_optimizer_state, module_state, optimizer_state
from multidc.plugins._lightning_patches import (
    set_optimizer_steps,
    unwrap_lr_scheduler_updates,
    wrap_lr_scheduler_updates,
)


class ElasticMixin:
    """Mixed into a DDP strategy before it: ``optimizer_step`` runs the elastic step when ``elastic``."""

    def _init_elastic(self, elastic: bool | None, lighthouse: str | None, sites: int | None) -> None:
        from multidc.hierarchical.elastic import resolve_elastic

        self.elastic = resolve_elastic(elastic, lighthouse)  # a missing or malformed address fails here
        self.elastic_site = None
        """The running ``ElasticSite`` (elastic mode, during ``fit``), else None."""
        self.elastic_committed = False
        """Whether the last optimizer step committed (elastic mode)."""
        self._lighthouse, self._elastic_sites = lighthouse, sites

    def _setup_elastic(self, trainer) -> None:
        if not self.elastic or trainer.state.fn != "fit":  # validate / test / predict: no steps to agree on
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError("elastic=True needs automatic optimization (the strategy decides whether a step commits).")
        from multidc.hierarchical.diloco.config import refuse_loss_scaling

        refuse_loss_scaling(getattr(self.precision_plugin, "scaler", None), mode="elastic")
        refuse_per_epoch_schedulers(self.lr_scheduler_configs)
        self._start_elastic(trainer)

    def _start_elastic(self, trainer) -> None:
        """Quorum per optimizer step: an ``ElasticSite`` that ``optimizer_step`` drives, and LR schedulers that
        step only on committed steps."""
        from multidc.hierarchical.elastic import ElasticSite

        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"elastic=True does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: a site "
                f"that receives the live state mid-accumulation would mix two models' gradients. Use a larger batch."
            )

        def update_lr_schedulers(original, interval: str, update_plateau_schedulers: bool) -> None:
            if self.elastic_committed:  # a discarded step leaves the schedulers (and their progress) as they are
                original(interval, update_plateau_schedulers)

        wrap_lr_scheduler_updates(trainer, update_lr_schedulers)  # undone in teardown

        self._elastic_started = False
        self.elastic_site = ElasticSite(
            state_dict=self._elastic_state, load_state_dict=self._load_elastic_state, site=self._site_name(),
            wan=self.wan, lighthouse=self._lighthouse, sites=self._elastic_sites, replica_group=self._replica_group(),
        )

    def _replica_group(self):
        """The ranks of this site holding this rank's parameters (``ElasticSite(replica_group=)``); None: all (DDP)."""
        return None

    def _site_name(self) -> str | None:
        site = getattr(self, "site", None)
        return str(site) if site is not None else None

    def _elastic_state(self) -> dict:
        return {  # this rank's shards under a parallel layout: the same-index rank of another site receives them
            "model": module_state(self.lightning_module),
            "optimizers": [optimizer_state(optimizer) for optimizer in self.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
        }

    def _load_elastic_state(self, state: dict) -> None:
        load_module_state(self.lightning_module, state["model"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            load_optimizer_state(optimizer, saved)
        for config, saved in zip(self.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        site = self.elastic_site
        if site is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self._elastic_started:  # after Lightning restored a checkpoint (ckpt_path): the job's step is its step
            self._elastic_started = True
            site.resume(self.lightning_module.trainer.global_step)
        site.start_step()
        self._follow_job_step(site.step)  # training_step sees the job's step (a rejoined site's too)
        result = closure()  # training_step + backward; DDP averages inside the site
        site.sync_gradients(self.model)
        output, self.elastic_committed = result, site.commit()
        if self.elastic_committed:
            output = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        self._follow_job_step(site.step - 1)  # the loop adds 1 when this returns
        return output

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Elastic: one site writes (one copy of the identical state; collective over that site's ranks), so every
        site may run the same ``ModelCheckpoint`` (``ElasticSite.save_once``; who writes:
        ``multidc.hierarchical.elastic.writer``)."""
        site = self._elastic_site_now()
        if site is None:  # not fitting: as the last step's leader decided (trainer.save_checkpoint after fit)
            if self._elastic_leader():
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return None
        from multidc.plugins.checkpoint.state import with_streams_of_now

        save = super().save_checkpoint  # Lightning built `checkpoint` now; the random streams are read at the save
        site.save_once(with_streams_of_now(lambda: save(checkpoint, filepath, storage_options=storage_options)))
        return None

    def remove_checkpoint(self, filepath) -> None:
        """Elastic: only the leader site removes (what ``save_top_k`` drops), as only it writes."""
        if not self._elastic_leader():
            return None
        return super().remove_checkpoint(filepath)

    def _elastic_leader(self) -> bool:
        """Whether this site writes checkpoints: outside elastic mode always; while fitting, the leader of the step's
        quorum; after the fit, the leader of its last step (``trainer.save_checkpoint`` after ``fit``)."""
        site = self._elastic_site_now()
        return site.is_leader if site is not None else getattr(self, "_was_leader", True)

    def _elastic_site_now(self):
        """The ``ElasticSite`` of the running fit (DiLoCo's, under elastic DiLoCo), else None."""
        return self.elastic_site

    def _follow_job_step(self, step: int) -> None:
        """Make the Trainer's ``global_step`` the job's ``step``."""
        set_optimizer_steps(self.lightning_module.trainer, step)

    def _teardown_elastic(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            unwrap_lr_scheduler_updates(trainer)
        current = self._elastic_site_now()
        if current is not None:
            self._was_leader = current.is_leader
        site, self.elastic_site = self.elastic_site, None
        if site is not None:
            site.close()


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
