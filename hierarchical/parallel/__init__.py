"""The parallel layout, framework-free: site x data (FSDP2 / replicated) x pipeline x tensor parallelism.

Uses only ``torch`` and ``multidc.hierarchical``; never Lightning or Accelerate. The Lightning strategy
(``multidc.strategies.Parallel3DStrategy``) and the Accelerate plugin (``multidc.plugins.MultiDCAccelerator``) are
thin adapters over it.

* ``layout``: ``ParallelLayout``, the sizes and the one ``DeviceMesh`` with axes
  ``("site", "pp", "dp_replicate", "dp_shard", "tp")``.
* ``parallelize``: put a model into a layout (tensor -> pipeline split -> data parallel) and run its steps.
* ``tensor_parallel``, ``pipeline``, ``data_parallel``: one parallel dimension each.
* ``grad_clip``: clipping by the global norm over every shard and stage.
* ``diloco``: DiLoCo across sites (``parallelize(..., cross_site="diloco")``, then ``build_diloco``).
* ``unequal_sites``: sites that differ in ``dp_shard`` only, under DiLoCo (a mesh per site, syncs in full tensors).
"""

from multidc.hierarchical.parallel.data_parallel import apply_data_parallel, replicate_topology
from multidc.hierarchical.parallel.diloco import DiLoCoShardState, build_diloco
from multidc.hierarchical.parallel.grad_clip import clip_grad_norm_
from multidc.hierarchical.parallel.layout import ParallelLayout
from multidc.hierarchical.parallel.parallelize import (
    ParallelModel,
    RemoteBlock,
    adopt_sharded,
    data_parallel_coordinate,
    parallelize,
    prepare_parallel,
)
from multidc.hierarchical.parallel.pipeline import Pipeline, PipelineConfig, split_blocks
from multidc.hierarchical.parallel.tensor_parallel import apply_tensor_parallel, transformer_block_plan

__all__ = [
    "DiLoCoShardState",
    "ParallelLayout",
    "ParallelModel",
    "Pipeline",
    "PipelineConfig",
    "RemoteBlock",
    "adopt_sharded",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "build_diloco",
    "clip_grad_norm_",
    "data_parallel_coordinate",
    "parallelize",
    "prepare_parallel",
    "replicate_topology",
    "split_blocks",
    "transformer_block_plan",
]
