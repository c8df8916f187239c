"""Every use of a private Accelerate API, in one place; checked against ``CHECKED_AGAINST`` (``tests/e2e/
test_patches.py`` fails when a patched attribute disappears or changes).

* ``mark_step_skipped``: ``AcceleratedOptimizer._is_overflow``, which ``step_was_skipped`` returns and the prepared
  LR schedulers read: an elastic step that did not commit leaves them as they are.
"""

from __future__ import annotations

CHECKED_AGAINST = "accelerate 1.15"


def mark_step_skipped(optimizer, skipped: bool) -> None:
    """Make the ``AcceleratedOptimizer``'s ``step_was_skipped`` say ``skipped`` until its next step."""
    optimizer._is_overflow = skipped
