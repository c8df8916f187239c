"""``GradientSync``: what a training front-end keeps for the cross-site gradient reduction of one job.

The Lightning and Fabric strategies and the Accelerate accelerator drive the same steps; they are written here once,
without any framework import, so ``multidc.strategies`` and ``multidc.plugins`` both use them:

1. ``build_topology`` (collective, once the process group exists), or ``adopt`` the topology a parallel layout
   built (its FSDP hook reduces the replicas inside backward);
2. ``attach_ddp`` for every DDP model: the hierarchical comm hook, and the gradients the step meter times (with
   a ``DiLoCoConfig``: the site-only hook, then ``attach_optimizer`` builds ``DiLoCo`` on the inner optimizer);
3. every step: ``backward_done()`` right after backward returns, ``metrics()`` once per optimizer step;
4. ``close()`` when training ends: the meter's gradient hooks and the topology's worker thread; and
   ``release_ddp()`` before a front-end destroys the process group itself.
"""

from __future__ import annotations

import weakref

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


class GradientSync(CrossSite):
    """The topology, the DDP hooks and the per-step WAN figures of one training job: the ``CrossSite`` sync of
    per-step all-reduce and of DiLoCo (their work runs in the hooks).

    Args:
        wan: WAN settings for the topology and the hooks; default ``WanConfig()`` (env ``MULTIDC_WAN_*``).

    Raises:
        ValueError: ``wan`` is not a ``WanConfig``.
    """

    def __init__(self, wan: WanConfig | None = None, diloco: DiLoCoConfig | None = None) -> None:
        if wan is not None and not isinstance(wan, WanConfig):
            raise ValueError(f"wan must be a multidc.hierarchical.WanConfig, not {type(wan).__name__}.")
        if diloco is not None and not isinstance(diloco, DiLoCoConfig):
            raise ValueError(f"diloco must be a multidc.hierarchical.DiLoCoConfig, not {type(diloco).__name__}.")
        self.wan = wan if wan is not None else WanConfig()
        self.diloco_config = diloco
        self.diloco: DiLoCo | None = None
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

    def adopt(self, topology: Topology | None) -> None:
        """Meter ``topology``, whose replicas a parallel layout's FSDP hook reduces inside backward; ``None``: this
        rank has no replicas, nothing crosses the WAN."""
        if topology is None:
            return
        self.topology, self._reduced_in_backward = topology, True
        if self.meter is None:
            self.meter = WanStepMeter(topology.wan_stats, [])

    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> HierarchicalHookState | None:
        """Send ``ddp_model``'s gradient buckets through the hierarchical all-reduce and time its gradients. Call
        after ``build_topology``, before the first backward, on every rank. In DiLoCo mode the buckets are
        averaged inside the site only (``register_site_ddp_hook``) and ``attach_optimizer`` follows."""
        assert self.topology is not None, "build_topology() comes first: the hook needs the topology"
        self._ddp_models.add(ddp_model)
        if self.diloco_config is not None:
            register_site_ddp_hook(ddp_model, self.topology)
            return None
        state = register_ddp_hook(ddp_model, self.topology, wan=self.wan)
        self.hook_states.append(state)
        if self.meter is None:
            self.meter = WanStepMeter(self.topology.wan_stats, [])
        self.meter.watch(ddp_model.parameters())
        return state

    def ddp_models(self) -> list:
        """The DDP models attached (and still alive)."""
        return list(self._ddp_models)

    def attach_optimizer(self, model: torch.nn.Module, optimizers: list) -> DiLoCo | None:
        """DiLoCo mode: build ``DiLoCo`` over ``model`` (as attached: the DDP wrapper) and its one optimizer, whose
        steps then drive the outer loop. Collective (every rank); after ``attach_ddp``. Without DiLoCo: nothing.

        Raises:
            ValueError: not exactly one optimizer (DiLoCo's inner optimizer), on every rank alike.
        """
        if self.diloco_config is None:
            return None
        if len(optimizers) != 1:
            raise ValueError(
                f"DiLoCo steps after the inner optimizer, so it needs exactly one optimizer; got {len(optimizers)}. "
                "Put every parameter group in one optimizer (configure_optimizers returning one)."
            )
        self.close_diloco()
        self.diloco = DiLoCo(model, optimizers[0], self.topology, self.diloco_config, wan=self.wan)
        return self.diloco

    def adopt_diloco(self, diloco: DiLoCo) -> DiLoCo:
        """DiLoCo mode under a parallel layout: take over ``diloco`` (built over the layout by
        ``multidc.hierarchical.parallel.build_diloco``); its topology becomes this sync's (``metrics``, ``close``)."""
        self.close_diloco()
        self.topology, self.diloco = diloco.topology, diloco
        return diloco

    def close_diloco(self) -> None:
        """Wait for a DiLoCo sync in flight and unhook it from the optimizer (every rank); nothing without one."""
        diloco, self.diloco = self.diloco, None
        if diloco is not None:
            diloco.close()

    def backward_done(self) -> None:
        """Call right after backward returns (see ``WanStepMeter.backward_done``)."""
        if self.meter is not None:
            self.meter.backward_done()

    def after_backward(self, model: torch.nn.Module) -> None:
        self.backward_done()

    def metrics(self) -> dict[str, float]:
        """WAN figures since the previous call; call once per optimizer step. Keys ``wan/bytes_sent`` (bytes),
        ``wan/comm_s``, ``wan/MBps``, ``wan/wait_s`` (see ``WanStepMeter``); ``{}`` before a model is attached.
        In DiLoCo mode ``DiLoCo.metrics()``: ``wan/bytes_sent``, ``wan/outer_syncs``, ``wan/exposed_s``."""
        if self.diloco is not None:
            return self.diloco.metrics()
        if self.meter is None:
            return {}
        metrics = self.meter.take()
        if self._reduced_in_backward:  # backward waits for all of it: none of the reduction overlaps compute
            metrics["wan/wait_s"] = metrics["wan/comm_s"]
        return metrics

    def close(self) -> None:
        """Close DiLoCo (a sync in flight finishes), remove the meter's gradient hooks and stop the topology's worker
        thread (its groups stay usable)."""
        try:
            self.close_diloco()
        finally:  # also when the sync in flight failed: the hooks and the worker thread must not outlive the fit
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


class HasGradientSync:
    """Mixed into a front-end that keeps its ``GradientSync`` as ``gradient_sync``: what users read off it."""

    gradient_sync: GradientSync

    @property
    def topology(self) -> Topology | None:
        """The job's topology (WAN counters in ``topology.wan_stats``); ``None`` before it is built."""
        return self.gradient_sync.topology

    @property
    def hook_states(self) -> list[HierarchicalHookState]:
        """One hook state per DDP model (their int8 error-feedback ``residuals`` are inspectable)."""
        return self.gradient_sync.hook_states
