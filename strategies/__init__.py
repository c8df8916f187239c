"""The Lightning strategies (Trainer and Fabric).

* ``HierarchicalDDPStrategy`` (``"hierarchical_ddp"``, ``"hierarchical_ddp_spawn"``) and its Fabric twin
  ``HierarchicalDDPFabricStrategy``: Lightning's DDP with every gradient bucket reduced inside its site first,
  then across sites.
* ``DiLoCoStrategy`` (``"diloco"``, ``"diloco_spawn"``): DDP inside each site, DiLoCo / streaming DiLoCo across
  sites (low-bandwidth WANs).
* ``Parallel3DStrategy`` (``"parallel_3d"``): Lightning's ``ModelParallelStrategy`` extended to site x data x
  pipeline x tensor parallelism, over the framework-free layout of ``multidc.hierarchical.parallel`` (whose names,
  ``ParallelLayout``, ``parallelize``, ..., are re-exported here).

Importing this package registers the multidc strategy names with Lightning's ``StrategyRegistry`` and Fabric's
registry when Lightning is installed (it imports Lightning). Without Lightning the package still imports and using
a strategy class raises an ImportError that says what to install.
"""

import importlib

from multidc.hierarchical import parallel as _parallel
from multidc.hierarchical.parallel import *  # noqa: F403  (re-exports its __all__)
from multidc.strategies._registry import register_if_installed

# Public names that need Lightning -> the module defining them (without Lightning, __getattr__ raises its error).
_LIGHTNING_EXPORTS = {
    "HierarchicalDDPStrategy": "multidc.strategies.hierarchical_ddp",
    "HierarchicalDDPFabricStrategy": "multidc.strategies.hierarchical_ddp",
    "Parallel3DStrategy": "multidc.strategies.parallel_3d",
    "DiLoCoStrategy": "multidc.strategies.diloco",
}

__all__: list[str] = [*_LIGHTNING_EXPORTS, *_parallel.__all__]  # and the layout's names, re-exported


def __getattr__(name: str):
    module = _LIGHTNING_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)  # without Lightning: its clear ImportError


register_if_installed()  # Trainer(strategy="hierarchical_ddp") etc. work once multidc.strategies is imported
