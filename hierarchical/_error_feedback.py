"""Error feedback for lossy WAN compression (int8), shared by the DDP hook and the FSDP replica hook.

Each rank keeps, for every gradient tensor a hook reduces, what compression dropped from the shards it sent, and
adds it to the next step's shards (``all_reduce.submit(residual=...)``), so the error does not accumulate over
steps. A residual belongs to one tensor: it restarts at zero when the tensor under its key changes.
"""

from __future__ import annotations

import torch

from multidc.hierarchical.all_reduce import residual_numel
from multidc.hierarchical.compression import is_sparse
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.topology import Topology


class ErrorFeedback:
    """Float32 residuals of one hook, one per key (a DDP bucket index, an FSDP unit index); ``residuals`` maps
    key -> buffer, one slot per element this rank sends over the WAN."""

    def __init__(self, topology: Topology, wan: WanConfig) -> None:
        self.topology, self.wan = topology, wan
        self.residuals: dict[int, torch.Tensor] = {}
        self._owners: dict[int, object] = {}

    def residual(self, key: int, values: torch.Tensor, owners: object = None) -> torch.Tensor:
        """The residual for ``values`` reduced under ``key``; zeroed when new, when the size changed, or when
        ``owners`` (e.g. the parameters in a bucket) differ from last time."""
        numel = residual_numel(values.numel(), values.element_size(), self.topology, self.wan)
        current = self.residuals.get(key)
        if current is None or current.numel() != numel or self._owners.get(key) != owners:
            current = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=values.device)
            self._owners[key] = owners
        return current


def default_error_feedback(compression: str) -> bool:
    """Error feedback is on by default for the integer codecs, whose rounding is coarse enough to accumulate."""
    return compression in ("int8", "int4")


def refuse_sparse_per_step(compression: str, where: str) -> None:
    """A ValueError for a top-k codec on per-step gradients (``where`` names the hook): it drops ~98% of every
    step's gradient, and the per-step residuals here ignore the optimizer's momentum, which slows convergence;
    top-k is for DiLoCo's outer syncs (``DiLoCoConfig.compression``), whose error feedback is per fragment."""
    if is_sparse(compression):
        raise ValueError(
            f"{where}: WanConfig.compression={compression!r} (or MULTIDC_WAN_COMPRESSION) is for DiLoCo's outer "
            f"syncs, not per-step gradients; use 'int8' / 'int4' here, or cross_site='diloco' with "
            f"DiLoCoConfig.compression={compression!r}."
        )
