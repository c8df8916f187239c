"""What the suite's ``run_ranks`` forkserver imports once (``tests/conftest.py``), and what each forked rank redoes
of those imports' environment reads: Lightning sets ``rank_zero_only.rank`` from ``RANK`` / ``LOCAL_RANK`` at import,
which in the server saw no rank."""

from __future__ import annotations

import sys

MODULES = ["lightning.pytorch", "accelerate"]  # not torchft: its import sets up its logging from the environment


def on_rank_start() -> None:
    """In each rank, once its environment is set: Lightning's rank-zero rank as its own import would have set it."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0  # one object with lightning_utilities' own
