"""Hugging Face Accelerate integration: ``MultiDCPlugin`` (settings) and ``MultiDCAccelerator``.

An ordinary Accelerate loop trains across sites by swapping ``Accelerator`` for ``MultiDCAccelerator``; under
``accelerate launch`` the site layout and WAN settings come from ``MULTIDC_*`` environment variables::

    accelerator = MultiDCAccelerator()                 # was: Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ...                                                # accumulate / backward / gather / save_state unchanged
    if accelerator.sync_gradients:
        accelerator.log(accelerator.wan_metrics(), step=step)

With parallel sizes (``dp_shard``, ``pipeline_parallel_size``, ``tensor_parallel_size``; env ``MULTIDC_DP_SHARD``,
``MULTIDC_PP_SIZE``, ``MULTIDC_TP_SIZE``) ``prepare`` places the model into a
``multidc.hierarchical.parallel.ParallelLayout`` (site x pipeline x FSDP2 x tensor) instead of DDP; see
``MultiDCAccelerator``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import _env
from multidc.hierarchical._compat import destroy_process_groups_at_exit
from multidc.hierarchical._gradient_sync import HasGradientSync
from multidc.hierarchical.cross_site import cross_site_sync

try:
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "multidc's Accelerate integration needs Accelerate: pip install 'multidc[accelerate]' (accelerate>=1.10)."
    ) from exc

from multidc.plugins.accelerate import parallel as _par
from multidc.plugins.accelerate._patches import mark_step_skipped
from multidc.plugins.accelerate.elastic import ensure_process_group, site_options
from multidc.plugins.accelerate.plugin import MultiDCPlugin
from multidc.plugins.accelerate.state import StateMixin

if TYPE_CHECKING:  # the layout imports FSDP2, tensor and pipeline parallelism: only layout code pays
    from multidc.hierarchical.elastic.steps import OptimizerDriver
    from multidc.hierarchical.parallel import ParallelLayout, ParallelModel

class MultiDCAccelerator(StateMixin, HasGradientSync, Accelerator):
    """An ``Accelerator`` that trains across sites: DDP with a hierarchical gradient hook, or a parallel layout.

    **Data parallel (default).** ``prepare`` / ``prepare_model`` attach ``multidc.hierarchical.register_ddp_hook``
    to every model Accelerate wraps in ``DistributedDataParallel``; the rest is Accelerate's own (``accumulate`` and
    ``no_sync`` skip the WAN on accumulation steps, ``backward``, ``gather``, trackers).

    **Parallel layout** (plugin sizes with pipeline, tensor or FSDP shard degree > 1). The constructor builds the
    mesh (``device_mesh``; axes ``site, pp, dp_replicate, dp_shard, tp`` and aliases ``data_parallel``,
    ``tensor_parallel``, ``pipeline_parallel``, ``replicate``). ``prepare(model, optimizer, loader, scheduler,
    blocks=[...])`` puts the one model into the layout (``multidc.hierarchical.parallel.prepare_parallel``: TP,
    pipeline split, FSDP2 with the hierarchical cross-site reduction) and rebinds its optimizers to the parallelized
    parameters, also those prepared in an earlier or a later ``prepare`` call (they must not have stepped);
    ``blocks`` are the model's ordered blocks (required with pipeline parallelism; default
    ``model.pipeline_blocks()`` when defined).
    Data loaders are sharded by data-parallel replica, so TP/PP peers see the same batches; LR schedulers step once
    per replica.
    What changes in the loop:

    * ``loss = accelerator.pipeline_step(model, x, y, loss_fn)`` replaces forward + ``backward`` (it is both, for
      every layout; under PP ``model(x)`` is not available on any one rank). Returns the detached batch loss,
      identical on the ranks of a pipeline.
    * ``accelerator.clip_grad_norm_`` clips by the global norm over every TP/FSDP shard and pipeline stage.
    * Gradient accumulation (``accumulate`` / ``no_sync``) works without PP; with PP raise ``microbatches``.

    **DiLoCo** (``MultiDCPlugin(cross_site="diloco")``). ``prepare`` builds ``multidc.hierarchical.DiLoCo`` on the
    one model and its one optimizer (``accelerator.diloco``): DDP averages inside each site only, or, with a
    layout, FSDP2 / PP / TP stay inside the site and each rank syncs its own shard; ``wan_metrics`` reports
    DiLoCo's figures; ``save_state`` stores each site's model and optimizer under ``site_<k>`` and the DiLoCo state.

    **Checkpoints.** ``save_state(url)`` / ``load_state(url)`` with ``s3://...``, ``file://...`` (and local
    directories with a layout or ``shard_local_checkpoints``) go through ``multidc.plugins.Checkpointer``: sharded,
    replicated state striped, atomic commit, ``async_save``; ``load_state(url)`` picks the newest committed
    checkpoint and reshards into this run's layout (other world size, sites, dp/pp/tp). Other local directories
    keep Accelerate's own format. Details: ``multidc.plugins.accelerate.state``.

    Args:
        *args: passed to ``Accelerator``.
        multidc_plugin: site, WAN and layout settings; default ``MultiDCPlugin()`` (``MULTIDC_*`` env).
        **accelerator_kwargs: passed to ``Accelerator``. A DDP comm hook in ``kwargs_handlers`` is rejected (DDP
            takes one hook per model). Without ``cpu``, a torchrun launch on a machine with no GPU uses the CPU.

    Attributes:
        topology: the ``Topology`` over the gradient replicas (``None`` in a single-process run; with a layout,
            set by ``prepare``); WAN counters in ``topology.wan_stats``.
        device_mesh: the layout's ``DeviceMesh`` (``None`` for plain data parallelism).
        parallel: the ``ParallelModel`` from ``prepare`` (layout only).
        hook_states: one ``HierarchicalHookState`` per prepared DDP model.
        gradient_sync: the job's ``multidc.hierarchical.CrossSite`` sync (``cross_site_sync`` of the plugin's
            settings): what crosses the WAN, behind ``wan_metrics``, ``diloco`` and the checkpoints' per-site state.

    Raises:
        ValueError: bad settings, a layout that cannot split the processes (on every rank, during construction,
            before any training collective), or sites asked for in a single-process run.
    """

    def __init__(self, *args, multidc_plugin: MultiDCPlugin | None = None, **accelerator_kwargs) -> None:
        plugin = multidc_plugin if multidc_plugin is not None else MultiDCPlugin()
        if not isinstance(plugin, MultiDCPlugin):
            raise ValueError(f"multidc_plugin must be a MultiDCPlugin, not {type(plugin).__name__}.")
        if "cpu" not in accelerator_kwargs and _par.launched_without_device():
            accelerator_kwargs["cpu"] = True
        super().__init__(*args, **accelerator_kwargs)
        _par.check_launch(self.num_processes, self.distributed_type)
        self.multidc_plugin = plugin
        if self.ddp_handler is not None and self.ddp_handler.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_hook={self.ddp_handler.comm_hook}) cannot be combined with "
                f"MultiDCAccelerator, which installs its own DDP comm hook. For WAN compression use "
                f"MultiDCPlugin(wan=WanConfig(compression='bf16'|'int8')) or MULTIDC_WAN_COMPRESSION."
            )
        self.gradient_sync = cross_site_sync(wan=plugin.wan, diloco=plugin.diloco, elastic=plugin.elastic,
                                             **site_options(plugin))
        if self.gradient_sync.sites_differ:  # each site keeps its own buffers (BatchNorm statistics): none cross
            if self.ddp_handler is None:
                self.ddp_handler = DistributedDataParallelKwargs()
            self.ddp_handler.broadcast_buffers = False
        self.device_mesh = None
        self.layout: ParallelLayout | None = None
        self.parallel: ParallelModel | None = None
        self.elastic_steps: OptimizerDriver | None = None
        """Elastic mode: what drives the job's elastic sync (``.sync``) from the prepared optimizer; else None."""
        self._own_group, self._attached = False, (0, 0)
        destroy_process_groups_at_exit()  # when the script ends without end_training (torch aborts otherwise)
        if plugin.elastic:  # this launch is one site: no topology, the quorum decides the sites of each step
            self._own_group = ensure_process_group()
        if plugin.layout is not None:
            self._build_layout()
        elif not plugin.elastic:
            self._build_topology()

    def _build_topology(self) -> None:
        plugin = self.multidc_plugin
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.gradient_sync.build_topology(num_sites=plugin.num_sites, site=plugin.site)
            return
        if plugin.diloco is not None:
            raise ValueError(
                f"MultiDCPlugin(cross_site='diloco') trains across sites but this is a single process "
                f"({self.distributed_type}); start it with `accelerate launch --num_processes N ...`, or unset "
                f"cross_site / {_env.CROSS_SITE}."
            )
        if plugin.num_sites not in (None, 1):
            raise ValueError(
                f"MultiDCAccelerator was asked for num_sites={plugin.num_sites} (num_sites / {_env.NUM_SITES}) but "
                f"runs as a single process ({self.distributed_type}); start it with `accelerate launch "
                f"--num_processes N ...` (N a multiple of {plugin.num_sites}) or unset {_env.NUM_SITES}."
            )

    def _build_layout(self) -> None:
        """Resolve the layout for this job; build the mesh when it is more than plain data parallelism."""
        plugin = self.multidc_plugin
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                f"MultiDCPlugin sets a parallel layout ({plugin.layout}) but this is a single process "
                f"({self.distributed_type}); start it with `accelerate launch --num_processes N ...`."
            )
        # Collective: sites counted from MULTIDC_SITE when not given; ValueError on every rank, naming what would fit
        resolved = plugin.layout.resolve_job()
        if (resolved.pipeline_parallel_size, resolved.tensor_parallel_size, resolved.dp_shard) == (1, 1, 1):
            if plugin.elastic:  # DDP inside the site, as without sizes
                return None
            plugin.num_sites = resolved.num_sites  # plain data parallelism after all: DDP + hierarchical hook
            return self._build_topology()
        if plugin.elastic:
            from multidc.hierarchical.elastic.shards import check_elastic_layout

            check_elastic_layout(resolved, "MultiDCPlugin")
        if resolved.pipeline_parallel_size > 1 and self.gradient_accumulation_steps > 1:
            raise ValueError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} with pipeline_parallel_size="
                f"{resolved.pipeline_parallel_size}: the schedule already accumulates over microbatches; raise "
                f"MultiDCPlugin.microbatches ({_env.PP_MICROBATCHES}) instead."
            )
        self.device_mesh = resolved.build_mesh(self.device.type)
        self.layout = resolved
        return None

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None, blocks: Sequence[torch.nn.Module] | None = None):
        """Accelerate's ``prepare``; with a parallel layout the model first goes into the layout (see the class
        docstring), ``blocks`` being its ordered blocks."""
        if self.device_mesh is None:
            if blocks is not None:
                raise ValueError("prepare(blocks=...) needs a parallel layout (MultiDCPlugin sizes); this run is DDP.")
            prepared = super().prepare(*args, device_placement=device_placement)
            self._attach()
            return prepared
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        if len(models) > 1 or (models and self.parallel is not None):
            raise ValueError("with a parallel layout MultiDCAccelerator prepares exactly one model.")
        optimizers = [getattr(a, "optimizer", a) for a in args if isinstance(a, torch.optim.Optimizer)]
        if models:  # optimizers prepared in an earlier call were built over the model as it was then, too
            self._parallelize(models[0], optimizers + [o.optimizer for o in self._optimizers], blocks)
        elif self.parallel is not None:  # prepare(model) came first: point these at the parallelized parameters
            for optimizer in optimizers:
                self.parallel.rebind_optimizer(optimizer)
        prepared = super().prepare(*args, device_placement=device_placement)
        self._attach()
        return prepared

    def _parallelize(self, model: torch.nn.Module, optimizers: list, blocks) -> None:
        from multidc.hierarchical.parallel import prepare_parallel

        plugin = self.multidc_plugin
        if blocks is None and callable(getattr(model, "pipeline_blocks", None)):
            blocks = model.pipeline_blocks()
        if self.device_placement:
            model.to(self.device)
        self.parallel = prepare_parallel(
            model, optimizers, self.device_mesh, blocks=blocks, tensor_parallel=plugin.tensor_parallel,
            pipeline=plugin.pipeline, wan=plugin.wan, device=self.device, cross_site=self.gradient_sync.placement,
        )
        model._is_accelerate_prepared = True  # Accelerate must not wrap it (DDP) or move it again
        self.gradient_sync.place(self.parallel)

    def _attach(self) -> None:
        """Once ``prepare`` has seen the model and its optimizer (and again when a later ``prepare`` adds some):
        attach the job's ``CrossSite`` sync to them (collective: every rank prepares alike); one that drives the
        steps (elastic) runs from the prepared optimizer's ``step`` / ``zero_grad`` (``OptimizerDriver``; the first
        quorum forms at the first ``job_step``, training forward or ``zero_grad``)."""
        sync, prepared = self.gradient_sync, self._optimizers
        optimizers = [o.optimizer for o in prepared]
        stepped = {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}
        models = [getattr(m, "_orig_mod", m) for m in self._models  # torch.compile wraps the DDP module
                  if any(id(p) in stepped for p in m.parameters())]  # not a frozen / evaluation-only one
        counts = (len(models), len(optimizers))
        if not all(counts) or counts == self._attached:
            return
        # the prepared schedulers, live: a rejoining site receives their states (``carry``)
        sync.attach(models, optimizers, parallel=self.parallel, carry=self._schedulers, scaler=self.scaler)
        self._attached = counts
        if sync.drives_steps:
            from multidc.hierarchical.elastic.steps import OptimizerDriver

            if self.elastic_steps is not None:
                self.elastic_steps.close()
            self.elastic_steps = OptimizerDriver(  # the prepared schedulers skip a step the job discarded
                sync, models[0], prepared[0],
                sync_step=lambda: prepared[0].gradient_state.sync_gradients,
                on_step=lambda committed: mark_step_skipped(prepared[0], not committed))

    @property
    def job_step(self) -> int:
        """Elastic mode: the job's optimizer steps so far (committed steps; inner steps under DiLoCo), which a
        rejoined site takes from the live sites: loop on it. The first read joins the job (collective over the
        site: read it on every rank). Otherwise ``self.step``."""
        if self.elastic_steps is not None:
            return self.elastic_steps.job_step  # joins the first quorum if not yet
        return self.step

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode=False):
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.device_mesh is not None:
            return prepared
        ddp_model = getattr(prepared, "_orig_mod", prepared)  # torch.compile wraps the DDP module
        if isinstance(ddp_model, DistributedDataParallel):  # elastic: DDP averages inside the site, nothing here
            self.gradient_sync.attach_ddp(ddp_model)
        elif self.topology is not None and self.topology.num_sites > 1 and not evaluation_mode:
            if any(p.requires_grad for p in prepared.parameters()):
                raise ValueError(
                    f"MultiDCAccelerator sends gradients across sites for DDP models; with "
                    f"distributed_type={self.distributed_type} Accelerate did not wrap this model in DDP, so its "
                    f"gradients would not go through the hierarchical all-reduce. Use multi-GPU / multi-CPU DDP."
                )
        return prepared

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if self.device_mesh is None or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        from multidc.hierarchical.parallel import data_parallel_coordinate

        index, size = data_parallel_coordinate(self.device_mesh)
        placement = self.device_placement if device_placement is None else device_placement
        prepared = _par.shard_data_loader(self, data_loader, index, size, placement, slice_fn_for_dispatch)
        self._dataloaders.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        if self.device_mesh is None or isinstance(prepared, _par.ReplicaScheduler):
            return prepared
        replica = _par.ReplicaScheduler(
            prepared.scheduler, prepared.optimizers, replicas=self.layout.dp_size,
            step_with_optimizer=prepared.step_with_optimizer, split_batches=self.split_batches,
        )
        self._schedulers[self._schedulers.index(prepared)] = replica
        return replica

    # ------------------------------------------------------------------ training
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        super().backward(loss, **kwargs)
        self.gradient_sync.backward_done()

    def pipeline_step(self, model, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of one batch, for every layout. Every rank must call it.

        With pipeline parallelism the schedule runs every microbatch (``inputs`` / ``targets`` rows must divide by
        ``microbatches``); otherwise ``accelerator.backward(loss_fn(model(inputs), targets))``.

        Returns:
            The batch's mean loss, detached (unscaled by gradient accumulation); under PP broadcast from the last
            stage to every rank of the pipeline.
        """
        if self.parallel is None or self.parallel.pipeline is None:
            loss = loss_fn(model(inputs), targets)
            self.backward(loss)
            return loss.detach()
        loss = self.parallel.pipeline.step(inputs, targets, loss_fn)
        self.gradient_sync.backward_done()
        return loss

    def pipeline_eval_step(self, model, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable):
        """``pipeline_step`` without backward (evaluation), under ``torch.no_grad`` without PP."""
        if self.parallel is None or self.parallel.pipeline is None:
            with torch.no_grad():
                return loss_fn(model(inputs), targets).detach()
        return self.parallel.pipeline.eval_step(inputs, targets, loss_fn)

    @contextmanager
    def no_sync(self, model):
        if self.parallel is None:
            with super().no_sync(model):
                yield
            return
        self.parallel.set_requires_gradient_sync(False)  # nothing crosses sites, nothing is reduce-scattered
        try:
            yield
        finally:
            self.parallel.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's ``clip_grad_norm_``; with a layout, by the global norm over every TP/FSDP shard and pipeline
        stage (``multidc.hierarchical.parallel.clip_grad_norm_``), identical on every rank (under DiLoCo: the site's
        own norm, identical in the site). Every rank must call it."""
        if self.device_mesh is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        from multidc.hierarchical.parallel import clip_grad_norm_

        self.unscale_gradients()
        per_site = self.parallel.site_groups if self.parallel is not None else None  # DiLoCo: the site's own norm
        return clip_grad_norm_(list(parameters), max_norm, self.device_mesh, norm_type=norm_type, per_site=per_site)

    def end_training(self) -> None:
        try:
            self._close_checkpointers()  # waits for an async save_state and raises its error
        finally:
            steps, self.elastic_steps = self.elastic_steps, None
            if steps is not None:
                steps.close()  # the optimizer's own methods back
            self.gradient_sync.close()  # the topology's worker (elastic: leave the job), before the group goes
            # Accelerate destroys the process group while the user's DDP models live on; their reducers must not
            # be the groups' last holders, or a rank can hang at exit (see release_reducer).
            self.gradient_sync.release_ddp()
            super().end_training()
            if self._own_group and dist.is_initialized():
                dist.destroy_process_group()
