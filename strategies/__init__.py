"""Parallel layouts and Lightning strategies (see the project issues).

Importing this package registers the multidc strategy names (``"hierarchical_ddp"``, ...) with Lightning's
``StrategyRegistry`` and Fabric's registry when Lightning is installed. Without Lightning the package still
imports (framework-agnostic parts work) and using a Lightning strategy class raises an ImportError that says what
to install.
"""

import importlib
import importlib.util

from multidc.strategies.layout import ParallelLayout

# Public names that need Lightning -> the module defining them. Those modules register their strategy names
# when imported, so they are imported eagerly whenever Lightning is installed.
_LIGHTNING_EXPORTS = {
    "HierarchicalDDPStrategy": "multidc.strategies.hierarchical_ddp",
    "HierarchicalDDPFabricStrategy": "multidc.strategies.hierarchical_ddp",
}

__all__: list[str] = ["HierarchicalDDPFabricStrategy", "HierarchicalDDPStrategy"]
__all__ += ["ParallelLayout"]


def __getattr__(name: str):
    module = _LIGHTNING_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)  # without Lightning: its clear ImportError


if importlib.util.find_spec("lightning") is not None:
    for _module in dict.fromkeys(_LIGHTNING_EXPORTS.values()):
        importlib.import_module(_module)
