"""Names a package imports on first use (PEP 562), so tools that need no torch (``multidc lighthouse``) start fast.
Imports nothing heavy itself."""

from __future__ import annotations

import importlib
import sys
import types


def lazy_exports(package: str, names: dict[str, str]):
    """Make ``names`` (attribute -> submodule of ``package``) importable from ``package`` on first use. Returns the
    package's ``__getattr__`` and ``__dir__``. A submodule named like one of these attributes (``all_reduce``) does
    not replace it when imported: the package's attribute stays the object, as with eager imports."""
    module = sys.modules[package]

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *names})

    class _Package(types.ModuleType):
        def __setattr__(self, name: str, value) -> None:
            if name in names and isinstance(value, types.ModuleType):
                value = getattr(value, name)
            super().__setattr__(name, value)

    module.__class__ = _Package
    return __getattr__, __dir__
