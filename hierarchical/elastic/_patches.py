"""Every patch of a private torchft API, in one place; checked against ``CHECKED_AGAINST`` (``tests/e2e/
test_patches.py`` fails when a patched attribute disappears or changes its signature).

* ``wrap_quorum_client``: a ``Manager``'s ``_client`` (its ``ManagerClient``, whose ``_quorum(...)`` asks the site's
  manager server for the quorum), so multidc sees every quorum answer and renumbers its id
  (``multidc.hierarchical.elastic.transport.QuorumIdentity``).
"""

from __future__ import annotations

from collections.abc import Callable

CHECKED_AGAINST = "torchft 0.2"


def wrap_quorum_client(manager, wrap: Callable[[object], object]) -> None:
    """Replace ``manager``'s quorum client by ``wrap(client)``, which must forward what it does not answer."""
    manager._client = wrap(manager._client)
