"""Parallel layouts and Lightning strategies (see the project issues).

Importing this package registers the multidc strategy names (``"hierarchical_ddp"``, ...) with Lightning's
``StrategyRegistry`` and Fabric's registry when Lightning is installed. Without Lightning the package still
imports (framework-agnostic parts work) and using a Lightning strategy class raises an ImportError that says what
to install.
"""

import importlib
import importlib.util

from multidc.strategies.data_parallel import apply_data_parallel, replicate_topology
from multidc.strategies.grad_clip import clip_grad_norm_
from multidc.strategies.layout import ParallelLayout
from multidc.strategies.parallelize import (
    ParallelModel,
    RemoteBlock,
    data_parallel_coordinate,
    parallelize,
    prepare_parallel,
)
from multidc.strategies.pipeline import Pipeline, PipelineConfig, split_blocks
from multidc.strategies.tensor_parallel import apply_tensor_parallel, transformer_block_plan

# Public names that need Lightning -> the module defining them (without Lightning, __getattr__ raises its error).
_LIGHTNING_EXPORTS = {
    "HierarchicalDDPStrategy": "multidc.strategies.hierarchical_ddp",
    "HierarchicalDDPFabricStrategy": "multidc.strategies.hierarchical_ddp",
}
_LIGHTNING_EXPORTS["Parallel3DStrategy"] = "multidc.strategies.parallel_3d"

__all__: list[str] = ["HierarchicalDDPFabricStrategy", "HierarchicalDDPStrategy"]
__all__ += [
    "ParallelLayout",
    "ParallelModel",
    "Parallel3DStrategy",
    "Pipeline",
    "PipelineConfig",
    "RemoteBlock",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "data_parallel_coordinate",
    "parallelize",
    "prepare_parallel",
    "replicate_topology",
    "split_blocks",
    "transformer_block_plan",
]


def __getattr__(name: str):
    module = _LIGHTNING_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)  # without Lightning: its clear ImportError


if importlib.util.find_spec("lightning") is not None:
    from multidc.strategies._registry import register_all

    register_all()  # Trainer(strategy="hierarchical_ddp") etc. work once multidc.strategies is imported
