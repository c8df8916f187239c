"""DiLoCo and streaming DiLoCo across sites: see ``DiLoCo`` and ``DiLoCoConfig``."""

from multidc.hierarchical.diloco.config import DiLoCoConfig
from multidc.hierarchical.diloco.diloco import DiLoCo, DiLoCoStats

__all__ = ["DiLoCo", "DiLoCoConfig", "DiLoCoStats"]
