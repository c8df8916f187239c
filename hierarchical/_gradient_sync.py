"""The ``CrossSite`` syncs of a job whose sites train every step together or meet at DiLoCo's syncs:
``GradientSync`` (per-step hierarchical all-reduce) and ``DiLoCoSync``. Built by
``multidc.hierarchical.cross_site_sync``; the elastic variant of either is ``multidc.hierarchical.elastic.steps
.ElasticSync``. Their work runs in hooks (the DDP comm hook, the FSDP2 replicate hook, DiLoCo's optimizer step
post-hook), so a front-end calls only these, without any framework import:

1. ``build_topology`` (collective, once the process group exists; a parallel layout builds its own instead);
2. ``attach_ddp`` for every DDP model, before its first backward (or a layout placed with ``placement``);
3. ``attach(models, optimizers, parallel=)`` once the model and its optimizer exist (collective);
4. every step: ``after_backward`` right after backward returns, ``metrics()`` once per optimizer step;
   ``checkpoint_sites()`` for what a checkpoint holds per site;
5. ``close()`` when training ends; ``release_ddp()`` before a front-end destroys the process group itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.cross_site import CrossSite
from multidc.hierarchical.ddp_hook import (
    HierarchicalHookState,
    register_ddp_hook,
    register_site_ddp_hook,
    release_reducer,
)
from multidc.hierarchical.diloco import DiLoCo, DiLoCoConfig
from multidc.hierarchical.stats import WanStepMeter
from multidc.hierarchical.topology import Topology

if TYPE_CHECKING:
    from multidc.hierarchical.parallel import ParallelModel


class GradientSync(CrossSite):
    """Per-step hierarchical all-reduce: each DDP gradient bucket (or a layout's FSDP2 replicas, inside backward)
    averaged inside its site, then across sites over the WAN; plus the per-step WAN figures.

    Args:
        wan: WAN settings for the topology and the hooks; default ``WanConfig()`` (env ``MULTIDC_WAN_*``).

    Raises:
        ValueError: ``wan`` is not a ``WanConfig``.
    """

    decides_auto_wan = False
    """Whether this placement picks ``WanConfig`` settings on ``"auto"`` (DiLoCo's syncs do; a per-step all-reduce
    refuses them at construction)."""

    def __init__(self, wan: WanConfig | None = None) -> None:
        if wan is not None and not isinstance(wan, WanConfig):
            raise ValueError(f"wan must be a multidc.hierarchical.WanConfig, not {type(wan).__name__}.")
        self.wan = wan if wan is not None else WanConfig()
        if not self.decides_auto_wan:
            self.wan.refuse_auto("hierarchical DDP's per-step all-reduce (cross_site='allreduce')")
        self.topology: Topology | None = None
        self.hook_states: list[HierarchicalHookState] = []
        self.meter: WanStepMeter | None = None
        self._reduced_in_backward = False
        self._ddp_models: weakref.WeakSet = weakref.WeakSet()

    def __getstate__(self) -> dict:
        # Lightning pickles the strategy for spawn launches: the live DDP models stay behind (a WeakSet cannot
        # be pickled, and the spawned ranks attach their own).
        return {**self.__dict__, "_ddp_models": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _ddp_models=weakref.WeakSet())

    def build_topology(self, *, num_sites: int | None = None, site: int | str | None = None) -> Topology:
        """The job's topology over the default group, built on the first call (collective: every rank calls it)
        and kept for later fits (``close`` stops only its worker thread)."""
        if self.topology is None:
            self.topology = Topology.build(num_sites=num_sites, site=site, wan=self.wan)
        return self.topology

    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> HierarchicalHookState | None:
        """Send ``ddp_model``'s gradient buckets through the hierarchical all-reduce and time its gradients. Call
        after ``build_topology``, before the first backward, on every rank."""
        assert self.topology is not None, "build_topology() comes first: the hook needs the topology"
        self._ddp_models.add(ddp_model)
        state = register_ddp_hook(ddp_model, self.topology, wan=self.wan)
        self.hook_states.append(state)
        self._meter(self.topology).watch(ddp_model.parameters())
        return state

    def _meter(self, topology: Topology) -> WanStepMeter:
        if self.meter is None:
            self.meter = WanStepMeter(topology.wan_stats, [])
        return self.meter

    def place(self, parallel: ParallelModel) -> None:
        """A layout's replicas are reduced by its FSDP hook inside backward: meter its topology (``None``: this
        rank has no replicas, nothing crosses the WAN)."""
        if parallel.topology is not None:
            self.topology, self._reduced_in_backward = parallel.topology, True
            self._meter(parallel.topology)

    def ddp_models(self) -> list:
        """The DDP models attached (and still alive)."""
        return list(self._ddp_models)

    def backward_done(self) -> None:
        """Call right after backward returns (see ``WanStepMeter.backward_done``)."""
        if self.meter is not None:
            self.meter.backward_done()

    def after_backward(self, model: torch.nn.Module | None = None) -> None:
        self.backward_done()

    def metrics(self) -> dict[str, float]:
        """WAN figures since the previous call; call once per optimizer step. Keys ``wan/bytes_sent`` (bytes),
        ``wan/comm_s``, ``wan/MBps``, ``wan/wait_s`` (see ``WanStepMeter``); ``{}`` before a model is attached."""
        if self.meter is None:
            return {}
        metrics = self.meter.take()
        if self._reduced_in_backward:  # backward waits for all of it: none of the reduction overlaps compute
            metrics["wan/wait_s"] = metrics["wan/comm_s"]
        return metrics

    def close(self) -> None:
        """Remove the meter's gradient hooks and stop the topology's worker thread (its groups stay usable)."""
        if self.meter is not None:
            self.meter.close()
            self.meter = None
        if self.topology is not None:
            self.topology.close()

    def release_ddp(self) -> None:
        """Free the reducers of the attached DDP models (see ``release_reducer``). Call on every rank when the
        front-end destroys the process group itself while the models may outlive it (Accelerate's
        ``end_training``); the models cannot train afterwards."""
        for ddp_model in list(self._ddp_models):
            release_reducer(ddp_model)
        self._ddp_models = weakref.WeakSet()


class DiLoCoSync(GradientSync):
    """DiLoCo / streaming DiLoCo: DDP (or a layout's replicas) averaged inside each site only, and every
    ``sync_every`` inner steps ``DiLoCo`` averages the sites' pseudo-gradients over the WAN (in the inner optimizer's
    step post-hook). ``wan`` carries the syncs (its ``compression`` replaced by ``diloco.compression``).

    Raises:
        ValueError: ``diloco`` is not a ``DiLoCoConfig``.
    """

    placement = "diloco"
    sites_differ = True
    decides_auto_wan = True

    def __init__(self, wan: WanConfig | None = None, diloco: DiLoCoConfig | None = None) -> None:
        super().__init__(wan)
        if not isinstance(diloco, DiLoCoConfig):
            raise ValueError(f"diloco must be a multidc.hierarchical.DiLoCoConfig, not {type(diloco).__name__}.")
        self.diloco_config = diloco
        self.diloco: DiLoCo | None = None
        self._mesh = None

    def place(self, parallel: ParallelModel) -> None:
        """The layout's DiLoCo topology (``diloco_topology``: the ranks of every site holding this rank's shards)
        and mesh: what a checkpoint's per-site state follows, also outside training."""
        self.topology, self._mesh = parallel.topology, parallel.mesh

    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Average ``ddp_model``'s gradient buckets inside the site only (``register_site_ddp_hook``)."""
        assert self.topology is not None, "build_topology() comes first: the hook needs the topology"
        self._ddp_models.add(ddp_model)
        register_site_ddp_hook(ddp_model, self.topology)

    def attach(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
               parallel: ParallelModel | None = None, scaler=None, **_unused: Any) -> DiLoCo:
        """Build ``DiLoCo`` over the one model (the DDP wrapper, or ``parallel``: each rank syncs its own shard) and
        its one optimizer, whose steps then drive the outer loop. Collective; before a checkpoint is loaded.

        Raises:
            ValueError: not exactly one model and one optimizer (DiLoCo's inner one), or fp16 loss scaling
                (``scaler``), on every rank alike.
        """
        from multidc.hierarchical.diloco.config import refuse_loss_scaling

        one_model_one_optimizer(models, optimizers, "DiLoCo steps after the inner optimizer of the one model")
        refuse_loss_scaling(scaler)
        self.close_diloco()
        if parallel is not None:
            from multidc.hierarchical.parallel import build_diloco

            self.diloco = build_diloco(parallel, optimizers[0], self.diloco_config, wan=self.wan)
            self.topology, self._mesh = self.diloco.topology, parallel.mesh  # as placed
        else:
            self.diloco = DiLoCo(models[0], optimizers[0], self.topology, self.diloco_config, wan=self.wan)
        return self.diloco

    def checkpoint_sites(self) -> dict[str, Any]:
        if self.topology is None:
            return {}
        return {"site": self.topology.site, "diloco": diloco_state(self.diloco, self._mesh)}

    def metrics(self) -> dict[str, float]:
        """``DiLoCo.metrics()``: ``wan/bytes_sent``, ``wan/outer_syncs``, ``wan/exposed_s``; ``{}`` before
        ``attach``."""
        return self.diloco.metrics() if self.diloco is not None else {}

    def close_diloco(self) -> None:
        """Wait for a sync in flight and unhook DiLoCo from the optimizer (every rank); nothing without one."""
        diloco, self.diloco = self.diloco, None
        if diloco is not None:
            diloco.close()

    def close(self) -> None:
        """Close DiLoCo (a sync in flight finishes), then as ``GradientSync.close``."""
        try:
            self.close_diloco()
        finally:  # also when the sync in flight failed: the hooks and the worker thread must not outlive the fit
            super().close()


def diloco_state(diloco, mesh):
    """What a checkpoint stores under ``"diloco"``: the DiLoCo (a ``Stateful``), per local shard under a layout."""
    if diloco is None or mesh is None:
        return diloco
    from multidc.hierarchical.parallel import DiLoCoShardState

    return DiLoCoShardState(diloco, mesh)


def one_model_one_optimizer(models: Sequence, optimizers: Sequence, why: str) -> None:
    if len(models) != 1 or len(optimizers) != 1:
        raise ValueError(
            f"{why}: it needs exactly one model and one optimizer, got {len(models)} model(s) and {len(optimizers)} "
            f"optimizer(s). Train one model and put every parameter group in one optimizer."
        )


class HasGradientSync:
    """Mixed into a front-end that keeps its ``CrossSite`` sync as ``gradient_sync``: what users read off it."""

    gradient_sync: CrossSite

    def _init_cross_site(self, *, wan, diloco, elastic: bool | None, lighthouse: str | None, site,
                         sites: int | None) -> None:
        """``gradient_sync`` from the front-end's settings; ``elastic`` / ``lighthouse`` resolved from
        ``MULTIDC_ELASTIC`` / ``MULTIDC_LIGHTHOUSE`` (a missing or malformed address fails here)."""
        from multidc.hierarchical.cross_site import cross_site_sync
        from multidc.hierarchical.elastic import resolve_elastic

        self.elastic = resolve_elastic(elastic, lighthouse)
        self.gradient_sync = cross_site_sync(
            wan=wan, diloco=diloco, elastic=self.elastic, site=None if site is None else str(site),
            lighthouse=lighthouse, sites=sites)
        self.elastic_committed = False
        """Whether the last optimizer step committed (elastic mode)."""

    @property
    def topology(self) -> Topology | None:
        """The job's topology (WAN counters in ``topology.wan_stats``); ``None`` before it is built (and in an
        elastic job, whose quorum decides the sites of each step)."""
        return self.gradient_sync.topology

    @property
    def hook_states(self) -> list[HierarchicalHookState]:
        """One hook state per DDP model (their int8 error-feedback ``residuals`` are inspectable)."""
        return self.gradient_sync.hook_states

    @property
    def diloco(self):
        """The running ``multidc.hierarchical.DiLoCo`` (``stats``, ``global_parameters()``) under DiLoCo, from the
        model's set-up to the end of training; else None."""
        return self.gradient_sync.diloco

    @property
    def diloco_config(self) -> DiLoCoConfig | None:
        """The ``DiLoCoConfig`` under DiLoCo; else None."""
        return self.gradient_sync.diloco_config

    @property
    def elastic_sync(self) -> CrossSite | None:
        """The running elastic sync (elastic mode, from the model's set-up to the end of training), else None."""
        sync = self.gradient_sync
        return sync if getattr(sync, "attached", False) else None

    @property
    def elastic_site(self):
        """The running ``multidc.hierarchical.elastic.ElasticSite`` (elastic mode, while training), else None."""
        return getattr(self.gradient_sync, "site", None)

    def wan_metrics(self) -> dict[str, float]:
        """This rank's WAN figures since the previous call; call once per optimizer step. Per-step all-reduce:
        ``wan/bytes_sent`` (bytes), ``wan/comm_s``, ``wan/MBps``, ``wan/wait_s`` (see
        ``multidc.hierarchical.stats.WanStepMeter``; a parallel layout reduces inside backward, so ``wan/wait_s`` =
        ``wan/comm_s``); DiLoCo: ``wan/bytes_sent``, ``wan/outer_syncs``, ``wan/exposed_s`` (seconds the optimizer
        step waited for syncs); ``{}`` before a model is set up."""
        return self.gradient_sync.metrics()
