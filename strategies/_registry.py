"""The multidc strategy names in Lightning's ``StrategyRegistry`` (Trainer) and Fabric's ``STRATEGY_REGISTRY``.

Registered in one place: :func:`register_all`, which importing ``multidc.strategies`` calls when Lightning is
installed. Each strategy class lists its own names in a ``register_strategies`` classmethod, as Lightning's do.
"""

from __future__ import annotations

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


def register_all() -> None:
    """Register every multidc strategy name with both registries (imports Lightning)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from multidc.strategies.hierarchical_ddp import HierarchicalDDPFabricStrategy, HierarchicalDDPStrategy
    from multidc.strategies.parallel_3d import Parallel3DStrategy

    HierarchicalDDPStrategy.register_strategies(StrategyRegistry)
    Parallel3DStrategy.register_strategies(StrategyRegistry)
    HierarchicalDDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
