"""Elastic sites as a ``CrossSite`` sync, and a driver that runs a sync from an optimizer's own calls.

``elastic_sync`` builds the elastic variant of a job's cross-site method: ``ElasticSteps`` (``cross_site=
"allreduce"``: a quorum, a gradient average over the sites present and a commit vote per optimizer step) or
``ElasticDiLoCo`` (a quorum per outer round). ``OptimizerDriver`` calls a sync's points from the optimizer the
user's loop already calls (its ``step`` and ``zero_grad``) and from the model's first training forward, so an
Accelerate loop runs unchanged (``MultiDCAccelerator``). The Lightning strategies call the points from their
``optimizer_step``, the Fabric strategy from its ``optimizer_step`` and the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.cross_site import CrossSite
from multidc.hierarchical.elastic.shards import load_module_state, load_optimizer_state, module_state, optimizer_state


class ElasticSteps(CrossSite):
    """One elastic step per optimizer step (``cross_site="allreduce"``): ``before_step`` joins the step's quorum
    (a site that is behind receives the live state there), ``after_backward`` averages the gradients over the
    sites present, ``commit`` is the site's vote. Built by ``elastic_sync``.

    Attributes:
        site: the ``ElasticSite``.
        committed: whether the last step committed.
    """

    quorum_per_step = True

    def __init__(self, *, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None], wan: WanConfig,
                 **site_options) -> None:
        from multidc.hierarchical.elastic.site import ElasticSite

        self.site = ElasticSite(state_dict=state_dict, load_state_dict=load_state_dict, wan=wan, **site_options)
        self.committed = False
        self.joined, self._open, self._sent = False, False, 0

    def before_step(self) -> None:
        if self._open:  # this step's quorum formed already
            return
        self.site.start_step()
        self.joined = self._open = True

    def after_backward(self, model: nn.Module) -> None:
        self.site.sync_gradients(model)

    def commit(self) -> bool:
        self._open = False
        self.committed = self.site.commit()
        return self.committed

    def metrics(self) -> dict[str, float]:
        """``wan/bytes_sent``: bytes this rank sent to the other sites since the previous call."""
        sent = self.site.wan_stats.snapshot()["bytes_sent"]
        sent, self._sent = sent - self._sent, sent
        return {"wan/bytes_sent": float(sent)}

    def resume(self, step: int) -> None:
        self.site.resume(step)

    @property
    def job_step(self) -> int:
        return self.site.step

    @property
    def writes_checkpoints(self) -> bool:
        return self.site.is_leader

    def save_once(self, save: Callable[[], object]) -> None:
        self.site.save_once(save)

    def close(self) -> None:
        self.site.close()


def elastic_sync(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, diloco=None,
                 wan: WanConfig | None = None, state_dict: Callable[[], dict] | None = None,
                 load_state_dict: Callable[[dict], None] | None = None, replica_group=None,
                 accumulation_steps: int = 1, **site_options) -> CrossSite:
    """The elastic sync of one site's job, every rank of the site (after its process group exists).

    Args:
        model: what trains (DDP over the site's ranks, a parallel layout's model, or a plain module).
        optimizers: its optimizers (DiLoCo: exactly one, the inner optimizer).
        diloco: a ``DiLoCoConfig``: ``ElasticDiLoCo`` (its first round's quorum at the first ``before_step``, the
            next ones at ``after_step``); None: ``ElasticSteps``.
        wan: WAN settings of the rail hop.
        state_dict, load_state_dict: more state that travels to a (re)joining site (LR schedulers).
        replica_group: a parallel layout's ``ParallelModel.replica_group`` (see ``ElasticSite``).
        accumulation_steps: micro-batches whose gradients accumulate before the front-end calls ``before_step``
            (Lightning calls it in the optimizer step): more than 1 is refused for per-step sites, whose quorum may
            heal the weights.
        **site_options: ``site``, ``lighthouse``, ``sites``, ...: see ``ElasticSite``.

    Raises:
        ValueError: DiLoCo with other than one optimizer; accumulation before a per-step quorum; bad settings (see
            ``ElasticSite``, ``ElasticDiLoCo``).
    """
    if diloco is None and accumulation_steps != 1:
        raise ValueError(
            f"elastic=True does not support accumulate_grad_batches={accumulation_steps}: a site that receives the "
            f"live state mid-accumulation would mix two models' gradients. Use a larger batch."
        )
    wan = wan if wan is not None else WanConfig()
    extra, load_extra = state_dict or (lambda: {}), load_state_dict or (lambda state: None)
    if diloco is not None:
        from multidc.hierarchical.elastic.diloco import ElasticDiLoCo

        if len(optimizers) != 1:
            raise ValueError(
                f"DiLoCo steps after the inner optimizer, so it needs exactly one optimizer; got {len(optimizers)}. "
                "Put every parameter group in one optimizer."
            )
        return ElasticDiLoCo(model, optimizers[0], diloco, wan=wan, start_rounds=False, join=False,
                             state_dict=extra, load_state_dict=load_extra, replica_group=replica_group,
                             **site_options)

    def live_state() -> dict:  # this rank's shards under a layout: the same-index rank of another site gets them
        return {"model": module_state(model), "optimizers": [optimizer_state(o) for o in optimizers],
                "extra": extra()}

    def load_live_state(state: dict) -> None:
        load_module_state(model, state["model"])
        for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
            load_optimizer_state(optimizer, saved)
        load_extra(state["extra"])

    return ElasticSteps(state_dict=live_state, load_state_dict=load_live_state, wan=wan,
                        replica_group=replica_group, **site_options)


class OptimizerDriver:
    """Runs ``sync`` from the calls an Accelerate loop already makes: ``optimizer.step()`` (at a sync step:
    ``after_backward``, ``commit``, then the step only if committed) and ``optimizer.zero_grad()`` (then
    ``after_step`` and, at a sync step, ``before_step``: the next step's quorum); the first ``before_step`` also
    comes at the model's first training forward. Wraps this optimizer instance's methods until ``close``.

    Args:
        sync: the job's ``CrossSite``.
        model: what the loop trains (its first training forward joins the job); passed to ``after_backward``.
        optimizer: the object whose ``step`` / ``zero_grad`` the loop calls (Accelerate's ``AcceleratedOptimizer``).
        sync_step: whether this optimizer step ends the accumulation (default: always).
        on_step: called with whether the step committed (Accelerate marks a skipped step for its schedulers).
    """

    def __init__(self, sync: CrossSite, model: nn.Module, optimizer, *, sync_step: Callable[[], bool] = lambda: True,
                 on_step: Callable[[bool], None] | None = None) -> None:
        self.sync, self.model, self.optimizer = sync, model, optimizer
        self._sync_step, self._on_step = sync_step, on_step
        self.joined, self._open = False, False
        self.committed = False
        """Whether the last optimizer step committed."""
        self._step, self._zero_grad = optimizer.step, optimizer.zero_grad
        optimizer.step, optimizer.zero_grad = self.step, self.zero_grad  # this instance only
        self._hook = join_before_forward(model, self.join)

    def join(self) -> None:
        """The job's first quorum, once (collective over the site): a site that is behind receives the live state
        here."""
        if not self.joined:
            self._hook.remove()
            self.sync.before_step()
            self.joined = self._open = True

    @property
    def job_step(self) -> int:
        """The job's optimizer steps so far (joins the job first)."""
        self.join()
        return self.sync.job_step

    def step(self, closure=None):
        """At a sync step: the gradients' cross-site work, the vote, then the step if it commits. Accumulation
        micro-steps: the optimizer's own."""
        if not self._sync_step():
            return self._step(closure)
        if not self.joined:  # joining now could heal the weights after their gradients were computed
            raise RuntimeError(
                "elastic mode: optimizer.step() before the site joined the job: read the job step, call "
                "optimizer.zero_grad() or run the training forward through the prepared model first (a site that "
                "joins late receives the live weights there, before computing gradients)."
            )
        if not self._open and self.sync.quorum_per_step:
            raise RuntimeError(
                "elastic mode: optimizer.step() came twice without optimizer.zero_grad() between: call zero_grad() "
                "once per step (it starts the next step's quorum, where a site that fell behind heals)."
            )
        self._open = False
        self.sync.after_backward(self.model)
        self.committed = self.sync.commit()
        output = self._step(closure) if self.committed else None
        if self._on_step is not None:
            self._on_step(self.committed)
        return output

    def zero_grad(self, set_to_none=None) -> None:
        """The optimizer's ``zero_grad``; after a step that ended the accumulation: ``after_step`` and the next
        step's ``before_step``."""
        self._zero_grad(set_to_none)
        if not self.joined:
            self.join()
        elif self._sync_step() and not self._open:
            self.sync.after_step()
            self.sync.before_step()
            self._open = True

    def close(self) -> None:
        """Give the optimizer its own methods back and drop the forward hook (the sync stays open)."""
        for name in ("step", "zero_grad"):
            vars(self.optimizer).pop(name, None)
        self._hook.remove()


def join_before_forward(model: nn.Module, join: Callable[[], None]):
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
