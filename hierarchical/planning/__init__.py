"""Planning: which cross-site method keeps the GPUs busy on a given WAN (``multidc plan``).

Pure arithmetic on the real wire sizes (``compression`` codecs, ``chunking`` plans); no process group. The model's
equations and what it ignores: docs/guides/plan.md.
"""

from multidc.hierarchical.planning.model import (
    Job,
    Link,
    Prediction,
    Setting,
    bandwidth_for,
    candidates,
    cheapest,
    predict,
    wan_bytes_per_sync,
)

__all__ = ["Job", "Link", "Prediction", "Setting", "bandwidth_for", "candidates", "cheapest", "predict",
           "wan_bytes_per_sync"]
