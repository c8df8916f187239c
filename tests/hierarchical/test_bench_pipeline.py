"""``benchmarks/bench_pipeline.py``'s theory and figure (the benchmark itself runs under ``make bench-pipeline``)."""

from __future__ import annotations

import pytest

from benchmarks import bench_pipeline
from tests._resources import require_module


@pytest.mark.parametrize("p, m, v, share", [(2, 2, 1, 1 / 3), (4, 8, 1, 3 / 11), (4, 8, 2, 3 / 19), (1, 4, 1, 0.0)])
def test_theory_is_the_idle_share_of_p_stages_over_m_microbatches(p, m, v, share):
    assert bench_pipeline.theory(p, m, v) == pytest.approx(share)


def test_plot_writes_a_png_of_measured_shares_beside_the_theory(tmp_path):
    require_module("matplotlib", "bench")
    rows = [{"schedule": schedule, "p": p, "m": m, "v": v, "theory": bench_pipeline.theory(p, m, v),
             "median": bench_pipeline.theory(p, m, v) + 0.03, "min": 0.0, "max": 0.5, "repeats": 3}
            for schedule, p, m, v in (("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("interleaved_1f1b", 2, 4, 2))]
    path = tmp_path / "pipeline.png"
    bench_pipeline.plot(rows, 20.0, str(path))
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000
