"""``Parallel3DStrategy``: Lightning's ``ModelParallelStrategy`` extended to site x data (FSDP2 / replicated) x
pipeline x tensor parallelism, registered as ``"parallel_3d"``. A thin adapter over ``parallel.parallelize``.

What a LightningModule does with it:

* ``configure_model``: apply tensor parallelism as with ``ModelParallelStrategy`` (``self.device_mesh`` answers to
  ``"tensor_parallel"`` and ``"data_parallel"``), e.g.
  ``apply_tensor_parallel(blocks, self.device_mesh["tensor_parallel"])``.
  Leave data parallelism to the strategy: it shards with FSDP2 inside each site and reduces replicas across sites
  hierarchically. A ``configure_model`` written for ``ModelParallelStrategy`` that calls
  ``fully_shard(..., mesh=self.device_mesh["data_parallel"])`` itself runs unchanged (without pipeline
  parallelism): that ``fully_shard`` shards inside each site instead and the strategy reduces the sites'
  replicas hierarchically (``data_parallel_within_sites``); ``fsdp_across_sites=True`` keeps it across sites,
  flat, with a warning.
* ``pipeline_blocks(self) -> list[nn.Module]``: the model's ordered blocks
  (see ``multidc.hierarchical.parallel.pipeline``).
  Required with ``pipeline_parallel_size > 1``; otherwise used as FSDP units when defined.
* ``training_step``: with pipeline parallelism, ``self(x)`` is not available on any one rank. Instead write
  ``loss = self.trainer.strategy.pipeline_step(x, y, loss_fn)``: it runs the schedule (forward and backward of
  every microbatch) and returns the batch's mean loss on every rank, for ``self.log``; return it as usual, the
  strategy skips Lightning's backward for it. With ``pipeline_parallel_size == 1`` the same line is just
  ``loss_fn(self(x), y)``. ``validation_step`` uses ``pipeline_eval_step`` the same way.
* ``gradient_clip_val`` clips by the global norm over all TP/FSDP shards and pipeline stages; optimizers and LR
  schedulers are the usual ones over ``self.parameters()`` (this rank's stages only).
* ``accumulate_grad_batches`` works without pipeline parallelism (non-sync steps send nothing over the WAN); with
  it, raise ``microbatches`` instead.

Slow WAN: ``Parallel3DStrategy(..., cross_site="diloco", diloco=DiLoCoConfig(sync_every=50))`` trains each site
alone (FSDP2 / pipeline / tensor parallelism inside it, nothing crosses the WAN on a step) and syncs the sites with
DiLoCo every ``sync_every`` optimizer steps; see ``multidc.hierarchical.parallel.diloco``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch

from multidc.hierarchical import DiLoCoConfig, WanConfig, _env
from multidc.hierarchical._compat import destroy_process_groups_at_exit
from multidc.hierarchical.diloco.config import resolve_cross_site
from multidc.hierarchical.elastic.shards import check_elastic_layout
from multidc.hierarchical.parallel.data_parallel import data_parallel_within_sites, fsdp_mesh_crosses_sites
from multidc.hierarchical.parallel.layout import ParallelLayout
from multidc.hierarchical.parallel.parallelize import (
    ParallelModel,
    adopt_sharded,
    data_parallel_coordinate,
    layout_of,
    parallelize,
)
from multidc.hierarchical.parallel.pipeline import PipelineConfig
from multidc.hierarchical.parallel.unequal_sites import refuse_without_diloco

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.init import _materialize_distributed_module
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "multidc's Lightning strategies need Lightning: pip install 'multidc[lightning]' (lightning>=2.5,<2.7)."
    ) from exc

from multidc.strategies._checkpointing import CheckpointingMixin
from multidc.strategies._cross_site import CrossSiteMixin
from multidc.strategies._registry import register, register_all
from multidc.strategies._wan_metrics import WanMetricsCallback

_FLAT_WAN_WARNING = (
    "configure_model applied fully_shard over a mesh that spans sites, and {why}: that module's gradients cross "
    "the WAN flat (reduce-scattered over all sites) and its parameters are all-gathered across it in every forward "
    "and backward. For the hierarchical reduction, shard over self.device_mesh['data_parallel'] with "
    "fsdp_across_sites=False (the default: parameters are then sharded inside each site and reduced across sites "
    "once per step), or leave data parallelism to Parallel3DStrategy."
)


class Parallel3DStrategy(CrossSiteMixin, CheckpointingMixin, ModelParallelStrategy):
    """Site x data (FSDP2 / replicated) x pipeline x tensor parallelism for the Lightning ``Trainer``.

    Args:
        num_sites: see ``ParallelLayout`` (``None`` = ``MULTIDC_NUM_SITES``, else the number of ``MULTIDC_SITE``
            names when every rank sets one, else 1).
        dp_replicate: see ``ParallelLayout`` (``None`` = ``MULTIDC_DP_REPLICATE``, then default).
        dp_shard: see ``ParallelLayout`` (``None`` = ``MULTIDC_DP_SHARD``; default auto, or 1 when another size is
            auto).
        pipeline_parallel_size: see ``ParallelLayout`` (``None`` = ``MULTIDC_PP_SIZE``, then 1).
        tensor_parallel_size: see ``ParallelLayout`` (``None`` = ``MULTIDC_TP_SIZE``, then 1). One of the sizes
            may be ``-1``/``"auto"``.
        data_parallel_size: as ``ModelParallelStrategy``'s: the data-parallel ranks over ALL sites, i.e.
            ``num_sites x dp_replicate x dp_shard`` (``dp_shard`` follows from it when unset). ``None``/``"auto"``
            = whatever the other sizes leave (not ``ModelParallelStrategy``'s "number of nodes").
        pipeline_schedule: see ``PipelineConfig`` (env ``MULTIDC_PP_SCHEDULE``).
        microbatches: see ``PipelineConfig`` (env ``MULTIDC_PP_MICROBATCHES``).
        stages_per_rank: see ``PipelineConfig``.
        split_points: see ``PipelineConfig``.
        wan: cross-site reduction settings; default ``WanConfig()`` (env ``MULTIDC_WAN_*``).
        fsdp_across_sites: ``False`` (default): a ``fully_shard`` over ``device_mesh["data_parallel"]`` in
            ``configure_model`` shards inside each site, and the sites' replicas are reduced hierarchically
            (parameters and optimizer state then take ``num_sites x dp_replicate`` times the memory they would
            take sharded over all sites). ``True``: it shards over all sites as written, and gradients and
            parameter all-gathers cross the WAN flat (a warning says so). Not with ``cross_site="diloco"``.
        cross_site: ``"allreduce"`` (default; env ``MULTIDC_CROSS_SITE``): the replicas' gradients are averaged
            across sites every step. ``"diloco"``: each site trains alone (replicas averaged inside the site only,
            gradient clipping by the site's own norm), and ``multidc.hierarchical.DiLoCo`` syncs the sites every
            ``sync_every`` optimizer steps, each rank its own shard (see ``multidc.hierarchical.parallel.diloco``).
            ``configure_optimizers`` must then return one optimizer (DiLoCo's inner one); ``wan_metrics()`` are
            DiLoCo's (``wan/bytes_sent``, ``wan/outer_syncs``, ``wan/exposed_s``); checkpoints hold each site's
            model and optimizer states under ``site_<k>`` and the DiLoCo state per shard (resume with the same
            layout; with ``compression="topk"`` each rank's residuals for its shard too, under its global rank);
            ``strategy.diloco.global_parameters()`` swaps in the sites' consensus while fitting.
        diloco: ``DiLoCoConfig`` for ``cross_site="diloco"``; default ``DiLoCoConfig()`` from
            ``MULTIDC_DILOCO_*``, built here, so a missing ``sync_every`` fails at construction. ``wan`` carries
            the syncs (its ``compression`` replaced by ``diloco.compression``).
        checkpoint_async: upload checkpoints in the background (training blocks only for the host copy); the next
            save and the end of ``fit`` wait for it and raise its error.
        checkpoint_storage_options: fsspec / s3fs options for checkpoints (``endpoint_url``, ``key``, ...), or
            for checkpoint paths with ``{site}`` (one store per site) a mapping site -> options; default env
            ``MULTIDC_CKPT_STORAGE_OPTIONS`` (JSON), else the standard AWS environment / config. Never logged.
        checkpoint_replicas: with one checkpoint store per site (a ``{site}`` or mapping path), how many other
            regions also hold each site's own state, for a load after its region is lost (``Checkpointer``'s
            ``replicas``); default env ``MULTIDC_CKPT_REPLICAS``, else 0.
        save_distributed_checkpoint: ``True``: sharded checkpoints through multidc's ``Checkpointer`` to any
            fsspec URL (``s3://...``), loadable into another layout, ``ckpt_path="last"`` = newest committed (see
            ``multidc.strategies._checkpointing``). ``False``: ``ModelParallelStrategy``'s full single file.
        elastic: elastic sites on torchft (default env ``MULTIDC_ELASTIC``): this Trainer is one site (launch one job
            per site; ``MULTIDC_SITE`` names it, ``num_sites`` / ``MULTIDC_NUM_SITES`` counts the sites the job starts
            with, the layout's own ``num_sites`` is 1). FSDP2 (``dp_shard``) inside the site; each rank's shards
            are averaged with (``"allreduce"``: every step; ``"diloco"``: every round) and healed from the
            same-index rank of the other sites, so every site runs the same layout. ``dp_replicate``, pipeline and
            tensor parallelism are refused in this mode. See ``multidc.strategies._cross_site``.
        lighthouse: the torchft lighthouse's ``host:port`` (default ``MULTIDC_LIGHTHOUSE``), elastic mode only.
        process_group_backend: as ``ModelParallelStrategy``'s.
        timeout: as ``ModelParallelStrategy``'s.

    Raises:
        ValueError: bad sizes at construction (a ``data_parallel_size`` that ``num_sites x dp_replicate x dp_shard``
            cannot make), bad or contradictory ``cross_site`` / ``diloco`` / ``fsdp_across_sites`` /
            ``save_distributed_checkpoint``; sizes that do not multiply to ``devices x num_nodes`` when the
            ``Trainer`` launches, before any process group exists; under DiLoCo, not exactly one optimizer or
            settings differing between ranks, on every rank at setup.
    """

    strategy_name = "parallel_3d"

    def __init__(
        self,
        *,
        num_sites: int | str | None = None,
        data_parallel_size: int | str | None = None,
        dp_replicate: int | str | None = None,
        dp_shard: int | str | None = None,
        pipeline_parallel_size: int | str | None = None,
        tensor_parallel_size: int | str | None = None,
        pipeline_schedule: str | None = None,
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        split_points: Sequence[int] | None = None,
        wan: WanConfig | None = None,
        checkpoint_async: bool = False,
        checkpoint_storage_options: dict | None = None,
        checkpoint_replicas: int | None = None,
        fsdp_across_sites: bool = False,
        cross_site: str | None = None,
        diloco: DiLoCoConfig | None = None,
        save_distributed_checkpoint: bool = True,
        elastic: bool | None = None,
        lighthouse: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        config = _diloco_config(cross_site, diloco, fsdp_across_sites, save_distributed_checkpoint)
        self.cross_site = "allreduce" if config is None else "diloco"
        self._init_cross_site(wan=wan, diloco=config, elastic=elastic, lighthouse=lighthouse, site=None,
                              sites=_elastic_sites(num_sites))
        if self.elastic:  # this job is one site; the quorum decides the sites of each step (or round)
            num_sites = 1
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.layout = ParallelLayout(
            num_sites=num_sites, dp_replicate=dp_replicate, dp_shard=dp_shard, data_parallel_size=data_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, tensor_parallel_size=tensor_parallel_size,
        )
        self.pipeline_config = PipelineConfig(
            schedule=pipeline_schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
            split_points=split_points,
        )
        self.fsdp_across_sites = fsdp_across_sites
        self._fsdp_within_sites = False
        self.parallel: ParallelModel | None = None
        self._parked_grads: list | None = None
        self._init_checkpointing(checkpoint_async, checkpoint_storage_options, checkpoint_replicas)

    def _sharded_checkpoints(self) -> bool:
        return self._save_distributed_checkpoint

    @property
    def wan(self) -> WanConfig:
        """The cross-site reduction settings (``wan=``, default ``WanConfig()``, env ``MULTIDC_WAN_*``)."""
        return self.gradient_sync.wan

    @property
    def topology(self):
        """The replica topology (WAN statistics in ``topology.wan_stats``), or ``None`` without replicas."""
        return self.parallel.topology if self.parallel is not None else None

    def _configure_launcher(self) -> None:
        # Fails here, before any rank starts; unless the sites come from MULTIDC_SITE (their count and sizes, maybe
        # unequal), which only the ranks together know (build_mesh checks them then, on every rank).
        if _env.read(_env.SITE) is None:
            self.layout.resolve(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        self._setup_distributed()
        destroy_process_groups_at_exit()  # Lightning does so for NCCL only; gloo aborts at exit without it
        if self._device_mesh is None:  # validate / test after fit keep the mesh the module was placed on
            self._device_mesh = self.layout.build_mesh(self.root_device.type)
            self.layout = layout_of(self._device_mesh)
            refuse_without_diloco(self.layout, self.cross_site, "Parallel3DStrategy")  # every rank alike
        self.lightning_module._device_mesh = self._device_mesh

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # ``configure_model`` runs inside: ``device_mesh["tensor_parallel"]`` slices a flattened axis of the root
        # mesh, which torch 2.13 supports but warns about; the aliases are this strategy's documented interface.
        # A ``fully_shard`` over ``device_mesh["data_parallel"]`` shards inside each site (see ``setup``).
        within_sites = nullcontext(False)
        if self._device_mesh is not None and not self.fsdp_across_sites:
            within_sites = data_parallel_within_sites(self._device_mesh)
        with warnings.catch_warnings(), super().model_sharded_context(), within_sites as redirected:
            warnings.filterwarnings("ignore", message="Slicing a flattened dim", category=UserWarning)
            self._fsdp_within_sites = self._fsdp_within_sites or redirected
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.elastic:
            check_elastic_layout(self.layout, "Parallel3DStrategy")
        pp = self.layout.pipeline_parallel_size
        if pp > 1 and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} with pipeline_parallel_size={pp}: the "
                f"schedule already accumulates over microbatches; raise microbatches instead."
            )
        if self.parallel is not None and self.parallel.model is module:
            pass  # validate / test / fit again after fit: already placed (its pipeline and topology are kept)
        elif any(isinstance(m, FSDPModule) for m in module.modules()):
            if pp > 1:
                raise ValueError(
                    "configure_model applied fully_shard, but with pipeline_parallel_size > 1 the strategy shards "
                    "each stage itself; apply only tensor parallelism in configure_model."
                )
            self.parallel = self._adopt_sharded_module(module)
        else:
            blocks = module.pipeline_blocks() if callable(getattr(module, "pipeline_blocks", None)) else None
            self.parallel = parallelize(
                module, self.device_mesh, blocks=blocks, pipeline=self.pipeline_config, wan=self.wan,
                wrap_root=False, device=self.root_device, cross_site=self.gradient_sync.placement,
            )
        self.gradient_sync.place(self.parallel)  # its topology: the checkpoints' sites, the metrics
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning has no strategy hook for clipping: the precision plugin clips with torch's per-process
        # clip_grad_norm_, which cannot see other stages' and shards' gradients. Route it to the global norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._attach_sync(trainer, parallel=self.parallel)  # before Lightning restores a checkpoint into it
        WanMetricsCallback.add_to(trainer, self)

    def _adopt_sharded_module(self, module: pl.LightningModule) -> ParallelModel:
        """A module that ``configure_model`` sharded itself: add the hierarchical replica reduction to its units
        over ``"dp_shard"`` (where ``model_sharded_context`` put its ``fully_shard`` over ``"data_parallel"``), and
        warn about units whose gradients still cross sites flat."""
        mesh = self.device_mesh
        parallel = adopt_sharded(module, mesh, wan=self.wan, cross_site=self.gradient_sync.placement)
        if fsdp_mesh_crosses_sites(module, mesh):
            if self.gradient_sync.placement == "diloco":
                raise ValueError(
                    "configure_model applied fully_shard over a mesh that spans sites, but with cross_site='diloco' "
                    "each site must train alone; shard over self.device_mesh['data_parallel'] (the strategy keeps it "
                    "inside each site), or leave data parallelism to Parallel3DStrategy."
                )
            if self.fsdp_across_sites:
                why = "fsdp_across_sites=True keeps it there"
            elif not self._fsdp_within_sites:
                why = "this torch has no fully_shard mesh resolution (_get_mesh_info) for multidc to redirect"
            else:
                why = "that mesh is not device_mesh['data_parallel'] (only a fully_shard over that one is moved)"
            rank_zero_warn(_FLAT_WAN_WARNING.format(why=why))
        return parallel

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        index, size = data_parallel_coordinate(self.device_mesh)  # over all sites, also unequal ones
        return {"num_replicas": size, "rank": index}

    def pipeline_step(self, inputs: torch.Tensor, target: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Run one training batch through the model; call it from ``training_step`` and return its result.

        With pipeline parallelism: forward and backward of every microbatch, returning the detached mean loss
        on every rank (Lightning's backward is then skipped). Without: ``loss_fn(module(inputs), target)``.
        """
        if self.parallel is None or self.parallel.pipeline is None:
            return loss_fn(self.lightning_module(inputs), target)
        # Lightning zeroes gradients between training_step and backward, not before training_step: start from
        # none, run the schedule (which accumulates into .grad), and park its gradients until ``backward`` puts
        # them back (references only, no copies).
        params = list(self.parallel.parameters())
        for p in params:
            p.grad = None
        loss = self.parallel.pipeline.step(inputs, target, loss_fn)
        self._parked_grads = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._parked_grads:
            p.grad = None
        return loss

    def pipeline_eval_step(self, inputs: torch.Tensor, target: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """``pipeline_step`` without backward, for ``validation_step`` / ``test_step``."""
        if self.parallel is None or self.parallel.pipeline is None:
            return loss_fn(self.lightning_module(inputs), target)
        return self.parallel.pipeline.eval_step(inputs, target, loss_fn)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._parked_grads is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        for p, grad in self._parked_grads:  # the schedule ran backward already; keep the after-backward hooks
            p.grad = grad if p.grad is None else p.grad + grad
        self._parked_grads = None
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.parallel is None:
            yield
            return
        self.parallel.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.parallel.set_requires_gradient_sync(True)

    def _clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        from multidc.hierarchical.parallel.grad_clip import clip_grad_norm_

        clip_grad_norm_(params, clip_val, self.device_mesh, per_site=self.parallel.site_groups)

    def teardown(self) -> None:
        WanMetricsCallback.remove_from(self.lightning_module)
        try:
            self._close_sync()  # a sync in flight finishes (every rank); the groups stay for a later fit
        finally:
            super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register(strategy_registry, cls.strategy_name, cls,
                 description="multidc site x FSDP2 x pipeline x tensor parallelism")


def _elastic_sites(num_sites) -> int | None:
    """Elastic: ``num_sites`` counts the sites the job starts with (``ElasticSite(sites=)``), not this job's."""
    return num_sites if isinstance(num_sites, int) and not isinstance(num_sites, bool) else None


def _diloco_config(cross_site: str | None, diloco, fsdp_across_sites: bool, distributed_checkpoint: bool):
    """The ``DiLoCoConfig`` (``None``: ``cross_site="allreduce"``), and ValueErrors for settings that contradict it."""
    config = resolve_cross_site(cross_site, diloco, owner="Parallel3DStrategy")
    if config is not None and fsdp_across_sites:
        raise ValueError(
            "fsdp_across_sites=True shards parameters over all sites, so every step crosses the WAN, while "
            "cross_site='diloco' trains each site alone; drop fsdp_across_sites (shards then stay inside each site)."
        )
    if config is not None and not distributed_checkpoint:
        raise ValueError(
            "cross_site='diloco' needs save_distributed_checkpoint=True: its checkpoints hold every site's own model "
            "and the DiLoCo state, which the single-file format cannot."
        )
    return config


register_all()  # the names, also when this module's own import of Lightning came first (see _registry)
