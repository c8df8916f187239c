"""Elastic sites on torchft (opt-in; the ``elastic`` extra): the lighthouse that keeps the sites' quorum, and the
checks that every site reaches it. ``multidc lighthouse`` starts one; ``multidc doctor`` checks it when
``MULTIDC_LIGHTHOUSE`` is set.

The lighthouse's traffic (gRPC over HTTP/2) is as unauthenticated and unencrypted as gloo's: run it on the private
interconnect or VPN the sites already share.
"""

from multidc.hierarchical.elastic.lighthouse import (
    LighthouseUnreachable,
    check_lighthouse,
    import_torchft,
    lighthouse_url,
    start_lighthouse,
)

__all__ = ["LighthouseUnreachable", "check_lighthouse", "import_torchft", "lighthouse_url", "start_lighthouse"]
