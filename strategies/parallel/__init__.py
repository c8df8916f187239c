"""Deprecated: the parallel layout moved to ``multidc.hierarchical.parallel`` (framework-free, beside the rest of
the core). This alias of it and of its modules (``multidc.strategies.parallel.layout`` ...) goes in the next release.
"""

import importlib
import sys
import warnings

from multidc.hierarchical import parallel as _moved
from multidc.hierarchical.parallel import *  # noqa: F403  (re-exports its __all__)

__all__ = list(_moved.__all__)

for _name in ("data_parallel", "diloco", "grad_clip", "layout", "parallelize", "pipeline", "tensor_parallel"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{_moved.__name__}.{_name}")

warnings.warn("multidc.strategies.parallel moved to multidc.hierarchical.parallel; import it from there (this "
              "alias goes in the next release).", DeprecationWarning, stacklevel=2)
