"""Elastic sites under Accelerate: ``MultiDCPlugin(elastic=True)`` (env ``MULTIDC_ELASTIC=1``).

Each site is its own ``accelerate launch`` (its own rendezvous; ``--num_processes`` counts that site's processes) and
a torchft replica group. The first quorum forms at the site's first ``accelerator.job_step``, training forward
(``model.train()``, gradients enabled) or ``zero_grad``, whichever comes first (a site that starts late or restarts
receives the live model, optimizer and LR scheduler states there, not from storage), so a ``load_state`` right after
``prepare`` comes before it. Each of these is collective over the site's ranks: read ``job_step`` on every rank, and
keep rank-0-only forwards (a sample, an evaluation) in ``model.eval()`` or ``torch.no_grad()`` before training
starts. Then:

* ``cross_site="allreduce"``: one quorum per optimizer step. The prepared optimizer's ``step`` averages the
  gradients over the sites present (DDP has averaged them inside the site) and steps only if the site's ranks
  commit the step; a discarded step changes no weight, optimizer or scheduler state (the prepared LR schedulers
  see it as skipped). Its ``zero_grad`` starts the next step's quorum, so call it once per step (before the
  forward or after ``step``: both work). Gradient accumulation (``accelerator.accumulate``) works: the quorum and
  the average happen at sync steps only.
* ``cross_site="diloco"``: one quorum per outer round (``multidc.hierarchical.elastic.ElasticDiLoCo``).

Loop on ``accelerator.job_step`` (the job's optimizer steps: committed steps, or inner steps under DiLoCo), which a
rejoined site takes from the live ones. Checkpoints: ``save_state(url)`` on every site, as usual; only one site
writes (``ElasticSite.save_once``; one copy of the job's state, named by ``job_step``), and ``load_state(url)``
right after ``prepare`` resumes the job at the checkpoint's step (see ``multidc.plugins.accelerate.state``).
With ``dp_shard`` / ``dp_replicate`` (FSDP2 inside each site, ``cross_site="allreduce"``) each rank's shards are
averaged with, and healed from, the same-index rank of the other sites; every site must use the same layout.
Pipeline and tensor parallelism are refused in this mode.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from multidc.hierarchical.elastic.shards import load_module_state, load_optimizer_state, module_state, optimizer_state
from multidc.plugins.accelerate._patches import mark_step_skipped


class ElasticSteps:
    """The quorum per optimizer step of one ``MultiDCAccelerator`` (``cross_site="allreduce"``): wraps the one
    prepared optimizer's ``step`` and ``zero_grad``. Built by ``prepare`` (collective over the site).

    Args:
        model: the prepared model (DDP over the site's processes, or a plain module in a one-process site).
        optimizer: the one prepared ``AcceleratedOptimizer``.
        schedulers: the accelerator's list of prepared schedulers (read when the state is sent or received).
        plugin: the ``MultiDCPlugin`` (site name, WAN settings, lighthouse, sites the job starts with).
        replica_group: under a parallel layout, ``ParallelModel.replica_group`` (see ``ElasticSite``).
    """

    def __init__(self, model, optimizer, schedulers: list, plugin, replica_group=None) -> None:
        from multidc.hierarchical.elastic import ElasticSite

        self.model = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
        self.optimizer, self._schedulers = optimizer, schedulers
        self.committed = False
        """Whether the last optimizer step committed."""
        self._open = self.joined = False
        self.site = ElasticSite(state_dict=self._state, load_state_dict=self._load, wan=plugin.wan,
                                replica_group=replica_group, **site_options(plugin))
        self._step, self._zero_grad = optimizer.step, optimizer.zero_grad
        optimizer.step, optimizer.zero_grad = self.step, self.zero_grad  # this instance only
        self._hook = join_before_forward(model, self.join)

    @classmethod
    def build(cls, models: list, optimizers: list, schedulers: list, scaler, plugin, replica_group=None
              ) -> ElasticSteps:
        """Check what ``prepare`` got (one model, one optimizer, no fp16 loss scaling), then build."""
        if len(models) != 1 or len(optimizers) != 1:
            raise ValueError(
                f"MultiDCPlugin(elastic=True) trains one model with one optimizer (one quorum and one commit per "
                f"step); prepare got {len(models)} models and {len(optimizers)} optimizers."
            )
        from multidc.hierarchical.diloco.config import refuse_loss_scaling

        refuse_loss_scaling(scaler, mode="elastic")
        return cls(models[0], optimizers[0], schedulers, plugin, replica_group)

    @property
    def job_step(self) -> int:
        self.join()
        return self.site.step

    def join(self) -> None:
        """The site's first quorum, once (collective over the site): a site that is behind receives the live
        state here."""
        if not self.joined:
            self._hook.remove()
            self._start()
            self.joined = True

    def _start(self) -> None:
        self.site.start_step()
        self._open = True

    def resume(self, step: int) -> None:
        """The prepared objects were loaded from a checkpoint of the job's step ``step`` (``load_state``, before
        the first quorum): it forms at that step, so the sites further on give this site their state and those
        behind (or starting) receive this one's."""
        self.site.resume(step)

    def _state(self) -> dict:  # this rank's shards under a layout: the same-index rank of another site gets them
        return {"model": module_state(_unwrap(self.model)), "optimizer": optimizer_state(self.optimizer.optimizer),
                "schedulers": [scheduler.scheduler.state_dict() for scheduler in self._schedulers]}

    def _load(self, state: dict) -> None:
        load_module_state(_unwrap(self.model), state["model"])
        load_optimizer_state(self.optimizer.optimizer, state["optimizer"])
        load_schedulers(self._schedulers, state["schedulers"])

    def step(self, closure=None) -> None:
        """Accelerate's step at a sync step: the average over the sites present, the site's vote, then the
        optimizer step if the step commits. Accumulation micro-steps: Accelerate's own (nothing)."""
        if not self.optimizer.gradient_state.sync_gradients:
            return self._step(closure)
        if not self.joined:  # joining now could heal the weights after their gradients were computed
            raise RuntimeError(
                "elastic mode: optimizer.step() before the site joined the job: read accelerator.job_step, call "
                "optimizer.zero_grad() or run the training forward through the prepared model first (a site that "
                "joins late receives the live weights there, before computing gradients)."
            )
        if not self._open:
            raise RuntimeError(
                "elastic mode: optimizer.step() came twice without optimizer.zero_grad() between: call zero_grad() "
                "once per step (it starts the next step's quorum, where a site that fell behind heals)."
            )
        self._open = False
        self.site.sync_gradients(self.model)
        self.committed = self.site.commit()
        if self.committed:
            self._step(closure)
        mark_step_skipped(self.optimizer, not self.committed)  # the prepared schedulers skip it too
        return None

    def zero_grad(self, set_to_none=None) -> None:
        """Accelerate's ``zero_grad``; at a sync step after a ``step``, the next step's quorum."""
        self._zero_grad(set_to_none)
        if not self.joined:
            self.join()
        elif self.optimizer.gradient_state.sync_gradients and not self._open:
            self._start()

    def close(self) -> None:
        """Leave the job (this site's manager) and give the optimizer its own methods back."""
        for name in ("step", "zero_grad"):
            vars(self.optimizer).pop(name, None)
        self._hook.remove()
        self.site.close()


def build_elastic_diloco(models: list, optimizers: list, schedulers: list, config, plugin):
    """``ElasticDiLoCo`` on the one prepared model and its one prepared optimizer (DiLoCo steps after its inner
    optimizer); the prepared LR schedulers travel with the live state. The first round's quorum forms at the
    first training forward, ``zero_grad`` or ``accelerator.job_step`` (after a ``load_state``); the next round's
    starts in the optimizer's ``zero_grad`` after the step that ended a round (after ``scheduler.step()`` when the
    loop calls that first, as it should: the live state then holds the schedulers as a joining site does)."""
    from multidc.hierarchical.elastic import ElasticDiLoCo

    if len(models) != 1 or len(optimizers) != 1:
        raise ValueError(
            f"MultiDCPlugin(cross_site='diloco', elastic=True) trains one model with one optimizer; prepare got "
            f"{len(models)} models and {len(optimizers)} optimizers."
        )
    prepared = optimizers[0]
    diloco = ElasticDiLoCo(
        models[0], prepared.optimizer, config, wan=plugin.wan, start_rounds=False, join=False,
        state_dict=lambda: {"schedulers": [s.scheduler.state_dict() for s in schedulers]},
        load_state_dict=lambda state: load_schedulers(schedulers, state["schedulers"]), **site_options(plugin),
    )
    zero_grad = prepared.zero_grad

    def zero_grad_then_round(set_to_none=None) -> None:
        zero_grad(set_to_none)
        if diloco.round_pending:
            diloco.start_round()

    prepared.zero_grad = zero_grad_then_round  # this instance only
    hook = join_before_forward(models[0], lambda: diloco.start_round() if not diloco.joined else None)
    diloco.on_close.append(hook.remove)  # if it never ran: no hook left on the user's model (it holds the DiLoCo)
    return diloco


def join_before_forward(model, join):
    """Call ``join()`` before the model's first training forward (``model.training``, gradients enabled; then never
    again): a site that heals at its first quorum must compute its first gradients on the live state. An evaluation
    forward (one rank's sample) does not join: the join is collective over the site. Returns the hook's handle."""
    def before(module, _args):
        if not (module.training and torch.is_grad_enabled()):
            return
        handle.remove()
        with torch.inference_mode(False):
            join()

    # first: before FSDP2's own pre-forward hook gathers the parameters this may heal
    handle = getattr(model, "_orig_mod", model).register_forward_pre_hook(before, prepend=True)
    return handle


def site_options(plugin) -> dict:
    """``ElasticSite`` keyword arguments from a ``MultiDCPlugin`` (but ``wan``)."""
    return {"site": None if plugin.site is None else str(plugin.site), "lighthouse": plugin.lighthouse,
            "sites": plugin.num_sites}


def load_schedulers(schedulers: list, states: list) -> None:
    """Load the live sites' LR scheduler states into this site's prepared schedulers."""
    if len(schedulers) != len(states):
        raise ValueError(
            f"this site prepared {len(schedulers)} LR schedulers, the live site {len(states)}: in elastic mode "
            f"prepare the model, its optimizer and its LR schedulers in one accelerator.prepare(...) call."
        )
    for scheduler, state in zip(schedulers, states):
        scheduler.scheduler.load_state_dict(state)


def ensure_process_group() -> bool:
    """A one-process site started without a launcher (``python train.py``: Accelerate starts no process group): a
    one-rank gloo group of its own, as torchrun would make, whose store (``MASTER_ADDR`` / ``MASTER_PORT``, on
    ``MULTIDC_ELASTIC_HOST`` or the host's name) the site's manager also serves its rail rendezvous from. Returns
    whether it made one (to destroy at the end)."""
    if dist.is_initialized():
        return False
    from multidc.hierarchical.elastic.site import advertised_host

    host = advertised_host()
    store = dist.TCPStore(host, 0, world_size=1, is_master=True, timeout=datetime.timedelta(minutes=30))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(store.port)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    return True


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    model = getattr(model, "_orig_mod", model)  # torch.compile
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
