"""``multidc bench diloco``: one tiny run in the lab WAN, the figures' arithmetic, and bad arguments."""

from __future__ import annotations

import argparse
import json

import pytest

from multidc.hierarchical.tools import _diloco_report as report
from multidc.hierarchical.tools import cli
from multidc.hierarchical.tools.lab import lab_available
from tests._resources import require_module

needs_lab = pytest.mark.skipif(lab_available() is not None, reason=f"lab WAN unavailable: {lab_available()}")
TINY = ["--sites", "2", "--ranks-per-site", "2", "--dim", "32", "--layers", "2", "--batch", "2", "--seq", "16",
        "--sync-every", "4", "--fragments", "2", "--overlap-steps", "1", "--ddp-steps", "2", "--timeout-s", "300"]


@needs_lab
@pytest.mark.dist  # cli.main starts the ranks
def test_tiny_run_in_the_lab_measures_every_method_and_streaming_sends_a_fraction(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "diloco", *TINY, "--rates", "20mbit", "--steps", "8", "--eval-every", "4", "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert result["shaped"] and "lab WAN 20mbit" in printed and "target bytes" in printed
    speed = result["speed"]["20mbit"]
    assert list(speed) == ["hierarchical_ddp", "diloco", "streaming_diloco", "sites_alone"]
    # The timed window of DiLoCo spans sync_every steps: one sync of every fragment, nothing left in flight.
    assert speed["diloco"]["outer_syncs"] == 1 and speed["streaming_diloco"]["outer_syncs"] == 2
    assert speed["sites_alone"]["utilization"] == 1.0
    # Interface bytes: DDP sends the fp32 gradients every step; streaming int8 a quarter of the model per 4 steps.
    ddp, streaming = speed["hierarchical_ddp"]["wan_bytes_per_step"], speed["streaming_diloco"]["wan_bytes_per_step"]
    assert ddp > 8 * streaming > 0
    assert speed["sites_alone"]["wan_bytes_per_step"] < 0.01 * ddp
    quality = result["quality"]
    for method in speed:
        tokens = [point[0] for point in quality[method]["curve"]]
        assert tokens == [4 * 2 * 16 * step for step in (4, 8)]  # 4 ranks x 2 sequences x 16 tokens
        assert 0 < quality[method]["val_loss"] < 10
    assert set(result["targets"]) == {"utilization", "bytes", "loss"}
    assert (tmp_path / "bench.png").stat().st_size > 10_000  # matplotlib: the "bench" extra, in make test's install


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"sites": 2, "ranks_per_site": 2, "batch": 2, "seq": 8, **kw})


def _end(method: str, site: int, local: int, seconds: float, sent: int, overlaps: bool = True) -> dict:
    return {"method": method, "site": site, "local": local, "timed_steps": 10, "seconds": seconds,
            "payload_bytes": sent, "iface_tx_bytes": 0, "overlaps": overlaps,
            "stats": {"outer_syncs": 2, "exposed_s": 0.5, "bytes_sent": sent, "inner_steps": 10}}


def test_speed_takes_the_slowest_rank_the_busiest_site_and_the_alone_rate_as_full_utilization():
    records = []
    for site in (0, 1):
        for local in (0, 1):
            records.append(_end("hierarchical_ddp", site, local, 20.0 + site, 1000 * (1 + site)))
            records.append(_end("diloco", site, local, 5.0, 10, overlaps=False))
            records.append(_end("sites_alone", site, local, 4.0 + 0.5 * local, 0))
    rows = report.speed(records, _args(), shaped=False)
    assert rows["hierarchical_ddp"]["steps_per_s"] == 10 / 21.0
    assert rows["hierarchical_ddp"]["wan_bytes_per_step"] == 2 * 2000 / 10  # site 1: two ranks of 2000 bytes
    assert rows["sites_alone"]["utilization"] == 1.0 and rows["diloco"]["utilization"] == pytest.approx(4.5 / 5.0)
    assert rows["hierarchical_ddp"]["tokens_per_s"] == 4 * 2 * 8 * 10 / 21.0
    # 8 Mbit/s = 1e6 B/s: DDP's 400 B/step overlap a 0.45 s step; DiLoCo's 2 B/step add to it.
    bound = report.link_bound(rows, "8mbit")
    assert bound["hierarchical_ddp"] == 1.0 and bound["diloco"] == pytest.approx(0.45 / (0.45 + 2e-6))


def test_targets_judge_at_the_lowest_rate_where_ddp_is_at_most_30_percent():
    def rates(ddp_util, streaming_util, ddp_bytes=1e6, streaming_bytes=1e3):
        return {"hierarchical_ddp": {"utilization": ddp_util, "wan_bytes_per_step": ddp_bytes},
                "streaming_diloco": {"utilization": streaming_util, "wan_bytes_per_step": streaming_bytes}}

    results = {"speed": {"10mbit": rates(0.1, 0.97), "50mbit": rates(0.3, 0.9), "200mbit": rates(0.6, 0.99)},
               "quality": {"hierarchical_ddp": {"val_loss": 2.0}, "streaming_diloco": {"val_loss": 2.05},
                           "sites_alone": {"val_loss": 2.5}}}
    t = report.targets(results, ["10mbit", "50mbit", "200mbit"])
    assert t["utilization"]["rate"] == "10mbit" and t["utilization"]["met"] is True
    assert t["bytes"]["factor_min"] == 1000 and t["bytes"]["met"] is True
    assert t["loss"]["gap_vs_ddp"] == pytest.approx(0.025) and t["loss"]["met"] is True
    results["quality"]["streaming_diloco"]["val_loss"] = 2.07  # 3.5% worse than DDP
    assert report.targets(results, ["10mbit"])["loss"]["met"] is False
    results["speed"]["10mbit"] = rates(0.5, 0.99)  # DDP above 30% at 10mbit: judged at 50mbit, where 90% < 95%
    assert report.targets(results, ["10mbit", "50mbit"])["utilization"] == {**t["utilization"], "rate": "50mbit",
                                                                             "ddp": 0.3, "streaming": 0.9,
                                                                             "met": False}


def test_plot_writes_a_png_from_speed_and_quality(tmp_path):
    require_module("matplotlib", "bench")
    methods = ("hierarchical_ddp", "diloco", "streaming_diloco", "sites_alone")
    speed = {rate: {m: {"utilization": u} for m, u in zip(methods, utils)}
             for rate, utils in (("10mbit", (0.03, 0.5, 1.0, 1.0)), ("200mbit", (0.35, 0.94, 1.0, 1.0)))}
    quality = {m: {"curve": [[1000, 3.0], [2000, 2.0 + i / 10]]} for i, m in enumerate(methods)}
    path = tmp_path / "diloco.png"
    assert report.plot({"speed": speed, "quality": quality}, ["10mbit", "200mbit"], str(path)).endswith(str(path))
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("argv,fragment", [
    (["--sites", "1"], "--sites 1 must be >= 2"),
    (["--rates", "fast"], "WAN rate 'fast' is not understood"),
    (["--sync-every", "8", "--fragments", "4", "--overlap-steps", "2"], "overlap_steps"),
    (["--compression", "zstd"], "zstd"),
], ids=["one-site", "bad-rate", "overlap-too-long", "unknown-codec"])
def test_bad_arguments_exit_2_before_launching(capsys, argv, fragment):
    assert cli.main(["bench", "diloco", *argv]) == 2
    assert fragment in capsys.readouterr().err
