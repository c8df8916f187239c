"""``benchmarks/bench_checkpoint.py``'s figure, from a record shaped as ``checkpoint_report.report`` returns it (the
benchmark itself runs under ``make bench-checkpoint``)."""

from __future__ import annotations

from benchmarks import checkpoint_report
from tests._resources import require_module

_MEDIANS = {"raw parallel PUT (bound)": 1.34, "multidc save": 1.46, "raw parallel GET (bound)": 0.19,
            "raw GET, then exchange": 0.33, "raw GET, exchange overlapped": 0.32, "multidc load": 0.45,
            "multidc async: blocked": 0.07, "multidc async: to commit": 1.42, "lightning single-file save": 1.62,
            "lightning single-file load": 1.48}


def test_plot_writes_a_png_of_save_and_load_beside_their_bounds(tmp_path):
    require_module("matplotlib", "bench")
    rows = {name: {"median": s, "min": 0.9 * s, "max": 1.2 * s, "n": 4} for name, s in _MEDIANS.items()}
    path = tmp_path / "checkpoint.png"
    checkpoint_report.plot({"rows": rows, "state_mib": 256.0, "ranks": 4}, str(path))
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000
