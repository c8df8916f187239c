"""Names that moved between the torch releases we support (``torch>=2.7``)."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
