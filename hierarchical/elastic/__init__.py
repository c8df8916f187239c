"""Elastic sites on torchft (opt-in; the ``elastic`` extra): ``ElasticSite`` (one site of a job whose sites may
fail and rejoin live, see ``multidc.hierarchical.elastic.site``), ``ElasticDiLoCo`` (DiLoCo with a quorum per
outer round, ``multidc.hierarchical.elastic.diloco``), the lighthouse that keeps the sites' quorum,
and the checks that every site reaches it. ``multidc lighthouse`` starts one; ``multidc doctor`` checks it when
``MULTIDC_LIGHTHOUSE`` is set. torchft is imported only when one is built.

The lighthouse's traffic (gRPC over HTTP/2) is as unauthenticated and unencrypted as gloo's: run it on the private
interconnect or VPN the sites already share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from multidc.hierarchical._lazy import lazy_exports

_LAZY = {  # name -> submodule, imported on first use: starting the lighthouse needs neither torch nor torchft's
    "ElasticDiLoCo": "diloco", "ElasticSite": "site", "ElasticSteps": "steps", "OptimizerDriver": "steps",
    "elastic_sync": "steps",  # Python side
    **{name: "lighthouse" for name in ("LighthouseUnreachable", "check_lighthouse", "import_torchft",
                                       "lighthouse_url", "resolve_elastic", "start_lighthouse")},
}

if TYPE_CHECKING:
    from multidc.hierarchical.elastic.diloco import ElasticDiLoCo
    from multidc.hierarchical.elastic.lighthouse import (
        LighthouseUnreachable,
        check_lighthouse,
        import_torchft,
        lighthouse_url,
        resolve_elastic,
        start_lighthouse,
    )
    from multidc.hierarchical.elastic.site import ElasticSite
    from multidc.hierarchical.elastic.steps import ElasticSteps, OptimizerDriver, elastic_sync


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "ElasticDiLoCo",
    "ElasticSite",
    "ElasticSteps",
    "LighthouseUnreachable",
    "OptimizerDriver",
    "check_lighthouse",
    "elastic_sync",
    "import_torchft",
    "lighthouse_url",
    "resolve_elastic",
    "start_lighthouse",
]
