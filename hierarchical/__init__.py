"""Topology-aware collectives for training across sites (datacenters). Pure ``torch.distributed``.

Typical use, on every rank after ``init_process_group``::

    from multidc.hierarchical import Topology, WanConfig, all_reduce, register_ddp_hook

    topo = Topology.build(num_sites=2)                      # or MULTIDC_SITE / MULTIDC_NUM_SITES
    all_reduce(tensor, topo, wan=WanConfig(compression="bf16"))
    register_ddp_hook(ddp_model, topo)                      # gradients go site-first, then over the WAN
    print(topo.wan_stats.snapshot())                        # bytes sent between sites

Low-bandwidth sites (DiLoCo: sites train alone, pseudo-gradients cross the WAN every ``sync_every`` steps)::

    register_site_ddp_hook(ddp_model, topo)                 # DDP averages inside the site only
    diloco = DiLoCo(ddp_model, optimizer, topo, DiLoCoConfig(sync_every=50, fragments=4, overlap_steps=1))
    # ... the usual loop: every optimizer.step() runs diloco.step() (a hook on the optimizer; don't call it too)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multidc.hierarchical._lazy import lazy_exports

# name -> submodule; imported on first use (PEP 562), so tools that need no torch (`multidc lighthouse`) start fast
_LAZY = {
    "all_reduce": "all_reduce", "Chunk": "chunking", "CrossSite": "cross_site", "cross_site_sync": "cross_site",
    "plan_chunks": "chunking",
    "get_codec": "compression",
    "WanConfig": "config", "HierarchicalHookState": "ddp_hook", "register_ddp_hook": "ddp_hook",
    "register_site_ddp_hook": "ddp_hook", "DiLoCo": "diloco", "DiLoCoConfig": "diloco", "DiLoCoStats": "diloco",
    "WanError": "errors", "WanStats": "stats", "SiteLayout": "topology", "Topology": "topology",
    "resolve_sites": "topology",
}

if TYPE_CHECKING:
    from multidc.hierarchical.all_reduce import all_reduce
    from multidc.hierarchical.chunking import Chunk, plan_chunks
    from multidc.hierarchical.compression import get_codec
    from multidc.hierarchical.config import WanConfig
    from multidc.hierarchical.cross_site import CrossSite, cross_site_sync
    from multidc.hierarchical.ddp_hook import HierarchicalHookState, register_ddp_hook, register_site_ddp_hook
    from multidc.hierarchical.diloco import DiLoCo, DiLoCoConfig, DiLoCoStats
    from multidc.hierarchical.errors import WanError
    from multidc.hierarchical.stats import WanStats
    from multidc.hierarchical.topology import SiteLayout, Topology, resolve_sites


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "Chunk",
    "CrossSite",
    "DiLoCo",
    "DiLoCoConfig",
    "DiLoCoStats",
    "HierarchicalHookState",
    "SiteLayout",
    "Topology",
    "WanConfig",
    "WanError",
    "WanStats",
    "all_reduce",
    "cross_site_sync",
    "get_codec",
    "plan_chunks",
    "register_ddp_hook",
    "register_site_ddp_hook",
    "resolve_sites",
]
