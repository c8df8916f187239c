"""Elastic sites as a ``CrossSite`` sync, and a driver that runs a sync from an optimizer's own calls.

``elastic_sync`` builds the elastic variant of a job's cross-site method: ``ElasticSteps`` (``cross_site=
"allreduce"``: a quorum, a gradient average over the sites present and a commit vote per optimizer step) or
``ElasticDiLoCo`` (a quorum per outer round). ``OptimizerDriver`` calls a sync's points from the optimizer the
user's loop already calls (its ``step`` and ``zero_grad``) and from the model's first training forward, so an
Accelerate loop runs unchanged (``MultiDCAccelerator``). The Lightning strategies call the points from their
``optimizer_step``, the Fabric strategy from its ``optimizer_step`` and the model's forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from multidc.hierarchical._error_feedback import refuse_sparse_per_step
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.cross_site import CrossSite
from multidc.hierarchical.elastic.shards import load_module_state, load_optimizer_state, module_state, optimizer_state
from multidc.hierarchical.stats import WanStepMeter


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
        self.joined, self._open = False, False
        self._meter = WanStepMeter(self.site.wan_stats, [])

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
        """This rank's figures since the previous call, as ``WanStepMeter`` reports them (``wan/bytes_sent``,
        ``wan/comm_s``, ``wan/MBps``) over the site's WAN counters; ``wan/wait_s`` = ``wan/comm_s``: the step waits
        for the whole average (``after_backward``)."""
        metrics = self._meter.take()
        metrics["wan/wait_s"] = metrics["wan/comm_s"]
        return metrics

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
                 wan: WanConfig | None = None, carry: Sequence | Mapping = (), replica_group=None,
                 accumulation_steps: int = 1, **site_options) -> CrossSite:
    """The elastic sync of one site's job, every rank of the site (after its process group exists).

    Args:
        model: what trains (DDP over the site's ranks, a parallel layout's model, or a plain module).
        optimizers: its optimizers (DiLoCo: exactly one, the inner optimizer).
        diloco: a ``DiLoCoConfig``: ``ElasticDiLoCo`` (its first round's quorum at the first ``before_step``, the
            next ones at ``after_step``); None: ``ElasticSteps``.
        wan: WAN settings of the rail hop.
        carry: more objects with ``state_dict()`` / ``load_state_dict()`` (LR schedulers), a list or a dict read
            whenever the state travels, that a (re)joining site receives with the model and optimizers.
        replica_group: a parallel layout's ``ParallelModel.replica_group`` (see ``ElasticSite``).
        accumulation_steps: micro-batches whose gradients accumulate before the front-end calls ``before_step``
            (Lightning calls it in the optimizer step): more than 1 is refused for per-step sites, whose quorum may
            heal the weights.
        **site_options: ``site``, ``lighthouse``, ``sites``, ...: see ``ElasticSite``.

    Raises:
        ValueError: DiLoCo with other than one optimizer; accumulation before a per-step quorum; bad settings (see
            ``ElasticSite``, ``ElasticDiLoCo``); at a heal, a live site that carries other objects than this one.
    """
    if diloco is None and accumulation_steps != 1:
        raise ValueError(
            f"elastic=True does not support accumulate_grad_batches={accumulation_steps}: a site that receives the "
            f"live state mid-accumulation would mix two models' gradients. Use a larger batch."
        )
    wan = wan if wan is not None else WanConfig()

    def extra() -> dict:
        return {key: obj.state_dict() for key, obj in _items(carry)}

    def load_extra(state: dict) -> None:
        mine = dict(_items(carry))
        if mine.keys() != state.keys():
            raise ValueError(
                f"this site carries {len(mine)} objects to a joining site ({sorted(mine)}: LR schedulers), the live "
                f"site {len(state)} ({sorted(state)}): every site must set up the same LR schedulers (under "
                f"Accelerate: prepare them with the model and optimizer, in one accelerator.prepare call)."
            )
        for key, obj in mine.items():
            obj.load_state_dict(state[key])

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


def _items(carry: Sequence | Mapping):
    return carry.items() if isinstance(carry, Mapping) else enumerate(carry)


class ElasticSync(CrossSite):
    """The elastic variant of a job's cross-site method, as the front-end holds it from its construction on
    (``multidc.hierarchical.cross_site_sync(elastic=True)``): this launch is one site; ``attach`` builds the
    ``elastic_sync`` (a quorum per step, or per DiLoCo round) that the points then run, until ``close``. Nothing
    crosses sites in hooks: a layout's or DDP's replicas average inside the site (``placement = "allreduce"``).

    Args:
        wan: WAN settings of the rail hop; default ``WanConfig()``.
        diloco: a ``DiLoCoConfig`` for elastic DiLoCo (checked by ``check_elastic_config`` here); None: per-step.
        **site_options: ``site``, ``lighthouse``, ``sites``: see ``ElasticSite`` (checked at ``attach``).
    """

    drives_steps = True

    def __init__(self, wan: WanConfig | None = None, diloco=None, **site_options) -> None:
        if diloco is not None:
            from multidc.hierarchical.elastic.diloco import check_elastic_config

            check_elastic_config(diloco)
        self.wan = wan if wan is not None else WanConfig()
        self.wan.refuse_auto("elastic sites")  # at construction, before any site starts
        if diloco is None:
            refuse_sparse_per_step(self.wan.compression, "elastic per-step sync")
        self.diloco_config, self.site_options = diloco, site_options
        self.sites_differ = diloco is not None
        self.quorum_per_step = diloco is None
        self.inner: CrossSite | None = None
        """The running ``ElasticSteps`` / ``ElasticDiLoCo``, from ``attach`` to ``close``."""
        self._mesh, self._was_leader = None, True

    def __getstate__(self) -> dict:  # Lightning pickles the strategy for spawn launches: before any attach
        return {**self.__dict__, "inner": None}

    def __getattr__(self, name: str):
        # what the running sync has beyond the points (``committed``, ``stats``, ``global_parameters``, ...)
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (before attach: nothing runs)")
        return getattr(inner, name)

    def place(self, parallel) -> None:
        self._mesh = parallel.mesh

    @property
    def attached(self) -> bool:
        return self.inner is not None

    def attach(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *, parallel=None,
               carry: Sequence | Mapping = (), accumulation_steps: int = 1, scaler=None) -> CrossSite:
        """Build the job's elastic sync over the one model (what trains: DDP inside the site, or ``parallel``'s
        model, whose ranks then average their own shards with the same-index rank of the other sites) and its one
        optimizer; ``carry``: see ``elastic_sync``. Collective over the site. Closes the one attached before.

        Raises:
            ValueError: not one model and one optimizer; fp16 loss scaling (``scaler``); see ``elastic_sync``.
        """
        from multidc.hierarchical._gradient_sync import one_model_one_optimizer
        from multidc.hierarchical.diloco.config import refuse_loss_scaling

        one_model_one_optimizer(models, optimizers, "an elastic site votes on one model's step")
        refuse_loss_scaling(scaler, mode="elastic")
        self.close()
        self.inner = elastic_sync(
            models[0], optimizers, diloco=self.diloco_config, wan=self.wan, carry=carry,
            replica_group=parallel.replica_group if parallel is not None else None,
            accumulation_steps=accumulation_steps, **self.site_options)
        self._mesh = parallel.mesh if parallel is not None else None
        return self.inner

    def _running(self) -> CrossSite:
        if self.inner is None:
            raise RuntimeError("the elastic sync runs between attach(model, optimizer) and close(): attach it first.")
        return self.inner

    @property
    def site(self):
        """The running ``ElasticSite``, else None."""
        return getattr(self.inner, "site", None)

    @property
    def diloco(self):
        """The running ``ElasticDiLoCo`` (elastic DiLoCo), else None."""
        return self.inner if self.diloco_config is not None else None

    def before_step(self) -> None:
        self._running().before_step()

    def after_backward(self, model: nn.Module) -> None:
        self._running().after_backward(model)

    def commit(self) -> bool:
        return self._running().commit()

    def after_step(self) -> None:
        self._running().after_step()

    def resume(self, step: int) -> None:
        self._running().resume(step)

    @property
    def job_step(self) -> int | None:
        return self.inner.job_step if self.inner is not None else None

    @property
    def writes_checkpoints(self) -> bool:
        """While attached, whether this site writes now; after ``close``, whether it wrote for the last step."""
        return self.inner.writes_checkpoints if self.inner is not None else self._was_leader

    def save_once(self, save: Callable[[], object]) -> None:
        if self.inner is not None:
            self.inner.save_once(save)
        elif self._was_leader:  # after the fit: as its last step's leader decided
            save()

    def checkpoint_sites(self) -> dict:
        """Elastic DiLoCo: the job's state, one site's copy (the writing site's) as site 0, read on every site."""
        if self.diloco_config is None:
            return {}
        from multidc.hierarchical._gradient_sync import diloco_state

        return {"site": 0, "diloco": diloco_state(self.diloco, self._mesh)}

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics() if self.inner is not None else {}

    def close(self) -> None:
        """Leave the job (every rank of the site); ``attach`` may build another."""
        inner, self.inner = self.inner, None
        if inner is not None:
            self._was_leader = inner.writes_checkpoints
            inner.close()


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
