"""matplotlib for the benchmarks' PNG figures (docs/bench_*.png): imported only when a figure is drawn, since it
comes with the ``bench`` extra and nothing else in multidc needs it."""

from __future__ import annotations

import os

INSTALL_HINT = "pip install 'multidc[bench]'"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed).

    Raises:
        ImportError: matplotlib is not installed; the message names the extra that brings it.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"the benchmark figures need matplotlib, which is not installed ({INSTALL_HINT})") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, *, dpi: int = 100) -> None:
    """Write ``fig`` to ``path`` (its folder created if missing) and free it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
