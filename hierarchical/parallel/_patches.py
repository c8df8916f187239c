"""Every patch of a private torch API in the parallel layout, in one place; checked against ``CHECKED_AGAINST``
(``tests/e2e/test_patches.py`` fails when a patched attribute disappears or changes its signature).

* ``fsdp_mesh_info`` / ``resolving_fsdp_meshes_with``: FSDP2's ``_fully_shard._get_mesh_info(mesh, dp_mesh_dims)``,
  which ``fully_shard`` resolves its mesh with (``data_parallel_within_sites`` keeps a ``ModelParallelStrategy``
  module's sharding inside each site).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager

CHECKED_AGAINST = "torch 2.13"


def _fsdp_impl():
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard
    except ImportError:  # pragma: no cover - torch moved its FSDP2 internals
        return None
    return _fully_shard


def fsdp_mesh_info() -> Callable | None:
    """FSDP2's ``_get_mesh_info(mesh, dp_mesh_dims=None)``, or ``None`` when this torch lacks it."""
    return getattr(_fsdp_impl(), "_get_mesh_info", None)


@contextmanager
def resolving_fsdp_meshes_with(get_mesh_info: Callable) -> Generator[None, None, None]:
    """Inside, ``fully_shard`` resolves its mesh with ``get_mesh_info`` (same signature as ``fsdp_mesh_info()``);
    restored on exit. Only where ``fsdp_mesh_info()`` is not ``None``."""
    impl = _fsdp_impl()
    original = impl._get_mesh_info
    impl._get_mesh_info = get_mesh_info
    try:
        yield
    finally:
        impl._get_mesh_info = original
