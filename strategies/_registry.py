"""The multidc strategy names in Lightning's ``StrategyRegistry`` (Trainer) and Fabric's ``STRATEGY_REGISTRY``.

Registered in one place: :func:`register_all`, which importing ``multidc.strategies`` calls when Lightning is
installed (``multidc.strategies`` is the Lightning package; the framework-free layout lives in
``multidc.hierarchical.parallel``). Each strategy class lists its own names in a ``register_strategies``
classmethod, as Lightning's do.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any


def register(registry, name: str, cls: type, start_method: str | None = None, *, description: str = "") -> None:
    """Register ``cls`` under ``name``; idempotent (re-import, module reload), but never steals a name.

    Raises:
        RuntimeError: ``name`` is registered to another class.
    """
    current = registry[name]["strategy"] if name in registry else None
    if current is not None and _qualified(current) != _qualified(cls):
        raise RuntimeError(
            f"strategy name {name!r} is already registered to {_qualified(current)}; multidc cannot register "
            f"{_qualified(cls)} under it. Remove the other registration, or pass a {cls.__name__}(...) instance "
            "instead of the name."
        )
    init_params = {} if start_method is None else {"start_method": start_method}
    registry.register(name, cls, description=description, override=True, **init_params)


# Strategy module -> the classes it defines that register names.
_STRATEGIES = {
    "multidc.strategies.hierarchical_ddp": ("HierarchicalDDPStrategy", "HierarchicalDDPFabricStrategy"),
    "multidc.strategies.parallel_3d": ("Parallel3DStrategy",),
    "multidc.strategies.diloco": ("DiLoCoStrategy",),
}


def register_all() -> None:
    """Register every multidc strategy name with both registries (imports Lightning and the strategy modules).

    A strategy module still being imported (it imported Lightning, whose import calls this) is skipped, with the
    modules not imported yet: it calls ``register_all`` again as its last statement.
    """
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    def loading(module_name: str) -> bool:
        module = sys.modules.get(module_name)
        return module is not None and not all(hasattr(module, name) for name in _STRATEGIES[module_name])

    busy = any(loading(name) for name in _STRATEGIES)
    for module_name, names in _STRATEGIES.items():
        # A module mid-import is skipped, and so are those not imported yet (they may import it, e.g. diloco
        # imports hierarchical_ddp): the module mid-import ends with register_all, which imports them then.
        if loading(module_name) or (busy and module_name not in sys.modules):
            continue
        module = importlib.import_module(module_name)
        for name in names:
            cls = getattr(module, name)
            cls.register_strategies(STRATEGY_REGISTRY if "Fabric" in name else StrategyRegistry)


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def register_if_installed() -> None:
    """``register_all`` when Lightning is installed; nothing without it (the strategy classes then raise their
    ImportError, which says what to install, when used)."""
    if importlib.util.find_spec("lightning") is not None:
        register_all()
