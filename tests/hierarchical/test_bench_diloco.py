"""``multidc bench diloco``: one tiny run in the lab WAN, the windows, the figures' arithmetic, targets and plot on
synthetic records, and bad arguments."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from multidc.hierarchical.tools import _diloco_report as report
from multidc.hierarchical.tools import bench_diloco, cli
from multidc.hierarchical.tools._bench_model import TopicData
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
    assert list(speed) == ["hierarchical_ddp", "diloco", "streaming_diloco", "sparse_streaming_diloco", "sites_alone"]
    # The timed window of DiLoCo spans sync_every steps: one sync of every fragment, nothing left in flight.
    assert speed["diloco"]["outer_syncs"] == 1 and speed["streaming_diloco"]["outer_syncs"] == 2
    assert speed["sparse_streaming_diloco"]["outer_syncs"] == 2
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
    assert set(result["targets"]) == {"utilization", "bytes", "loss", "sparse_bytes", "sparse_utilization",
                                      "sparse_loss"}
    assert result["targets"]["sparse_utilization"]["met"] is None  # no 1mbit in this run
    assert (tmp_path / "bench.png").stat().st_size > 10_000  # matplotlib: the "bench" extra, in make test's install


def test_topic_tables_come_from_the_seed_alone_so_every_rank_and_run_draws_the_same_chains():
    tables = []
    for global_seed in (1, 2):  # torch seeds its global RNG differently in every process
        torch.manual_seed(global_seed)
        tables.append(TopicData(vocab=32, topics=4, seed=0).tables)
    assert torch.equal(tables[0], tables[1])
    assert not torch.equal(tables[0], TopicData(vocab=32, topics=4, seed=1).tables)
    # every token of every topic: 4 successors whose probabilities sum to 1
    assert torch.equal((tables[0] > 0).sum(-1), torch.full((4, 32), 4))
    assert torch.allclose(tables[0].sum(-1), torch.ones(4, 32))


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


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_diloco.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_ddp_times_one_step_below_10mbit_and_diloco_windows_hold_one_sync_of_each_fragment():
    args = _bench_args("--sync-every", "8", "--fragments", "2", "--overlap-steps", "1", "--ddp-steps", "3")
    slow = {m["name"]: m for m in bench_diloco._methods(args, quality=False, rate="1mbit")}
    fast = {m["name"]: m for m in bench_diloco._methods(args, quality=False, rate="10mbit")}
    assert list(slow) == list(bench_diloco.METHODS)
    assert (slow["hierarchical_ddp"]["warmup"], slow["hierarchical_ddp"]["steps"]) == (0, 1)
    assert (fast["hierarchical_ddp"]["warmup"], fast["hierarchical_ddp"]["steps"]) == (1, 4)
    # Blocking DiLoCo syncs at steps 8, 16: the window 5..12 holds one; streaming's 10..17 holds both fragments'.
    assert (fast["diloco"]["warmup"], fast["diloco"]["steps"]) == (4, 12)
    assert (fast["sparse_streaming_diloco"]["warmup"], fast["sparse_streaming_diloco"]["steps"]) == (9, 17)
    # The sparse row's defaults: 1/16 of each chunk at 2 bits, SparseLoCo's plain outer SGD at lr 1, no merge.
    assert fast["sparse_streaming_diloco"]["diloco"] == {
        "sync_every": 8, "fragments": 2, "overlap_steps": 1, "compression": "topk:0.0625:2", "outer_lr": 1.0,
        "outer_momentum": 0.0, "nesterov": False, "alpha": 0.0}
    assert fast["streaming_diloco"]["diloco"]["compression"] == "int8" and "outer_lr" not in fast["streaming_diloco"][
        "diloco"]


def test_sparse_row_takes_its_codec_and_outer_optimizer_and_png_is_the_plot_flag():
    args = _bench_args("--sparse-compression", "topk:0.03125:2", "--sparse-outer-lr", "0.7",
                       "--sparse-outer-momentum", "0.9", "--sparse-alpha", "0.5", "--png", "x.png",
                       "--methods", "sites_alone,sparse_streaming_diloco")
    (sparse,) = [m for m in bench_diloco._methods(args, quality=True) if m["name"] == "sparse_streaming_diloco"]
    assert sparse["diloco"]["compression"] == "topk:0.03125:2" and sparse["steps"] == 640
    outer = ("outer_lr", "outer_momentum", "nesterov", "alpha")
    assert [sparse["diloco"][k] for k in outer] == [0.7, 0.9, True, 0.5]
    assert args.plot == "x.png" and bench_diloco._selected(args) == ["sparse_streaming_diloco", "sites_alone"]


def _speed(ddp_util, sparse_util, *, ddp_bytes=13e6, stream_bytes=1e5, sparse_bytes=5e3):
    return {"hierarchical_ddp": {"utilization": ddp_util, "wan_bytes_per_step": ddp_bytes},
            "streaming_diloco": {"utilization": 0.4 if ddp_util < 0.01 else 0.97, "wan_bytes_per_step": stream_bytes},
            "sparse_streaming_diloco": {"utilization": sparse_util, "wan_bytes_per_step": sparse_bytes},
            "sites_alone": {"utilization": 1.0, "wan_bytes_per_step": 40.0}}


def test_sparse_targets_bytes_at_every_rate_utilization_at_1mbit_loss_against_ddp_and_int8():
    quality = {"hierarchical_ddp": {"val_loss": 2.0}, "streaming_diloco": {"val_loss": 2.04},
               "sparse_streaming_diloco": {"val_loss": 2.05}, "sites_alone": {"val_loss": 2.5}}
    results = {"speed": {"1mbit": _speed(0.003, 0.96), "10mbit": _speed(0.03, 1.0, sparse_bytes=1.2e4)},
               "quality": quality}
    t = report.targets(results, ["1mbit", "10mbit"])
    # 13e6 / 1.2e4 = 1083x at 10mbit is the worst rate; the int8 row's utilization is judged at 10mbit, not 1mbit.
    assert t["sparse_bytes"]["factor_min"] == pytest.approx(13e6 / 1.2e4) and t["sparse_bytes"]["met"] is True
    assert t["utilization"]["rate"] == "10mbit" and t["utilization"]["met"] is True
    assert t["sparse_utilization"] == {**t["sparse_utilization"], "rate": "1mbit", "sparse": 0.96, "met": True}
    assert t["sparse_loss"]["gap_vs_ddp"] == pytest.approx(0.025)
    assert t["sparse_loss"]["gap_vs_int8"] == pytest.approx(0.01 / 2.04) and t["sparse_loss"]["met"] is True
    quality["sparse_streaming_diloco"]["val_loss"] = 2.0599  # just under 3% above DDP and 1% above int8
    assert report.targets(results, ["1mbit"])["sparse_loss"]["met"] is True
    quality["sparse_streaming_diloco"]["val_loss"] = 2.062  # 1.1% above int8, 3.1% above DDP
    results["speed"]["1mbit"] = _speed(0.003, 0.9, sparse_bytes=2e4)  # 650x fewer, 90%
    t = report.targets(results, ["1mbit", "10mbit"])
    assert [t[k]["met"] for k in ("sparse_loss", "sparse_bytes", "sparse_utilization")] == [False, False, False]
    assert report.targets(results, ["10mbit"])["sparse_utilization"]["met"] is None  # no 1mbit: not judged


def test_targets_leave_out_what_a_run_did_not_measure():
    speed = {m: r for m, r in _speed(0.003, 0.96).items() if m != "sparse_streaming_diloco"}
    t = report.targets({"speed": {"1mbit": speed}, "quality": None}, ["1mbit"])
    assert set(t) == {"utilization", "bytes"} and t["utilization"]["met"] is None  # DDP <= 30% only below 10 mbit


def test_bytes_per_inner_step_take_the_median_rate_and_the_plot_draws_one_point_per_method(tmp_path):
    require_module("matplotlib", "bench")
    speed = {"1mbit": _speed(0.003, 0.96, sparse_bytes=4e3), "10mbit": _speed(0.03, 1.0, sparse_bytes=5e3),
             "50mbit": _speed(0.1, 1.0, sparse_bytes=9e3)}
    quality = {m: {"val_loss": 2 + i / 10, "curve": [[1000, 3.0], [2000, 2 + i / 10]]}
               for i, m in enumerate(speed["1mbit"])}
    results = {"speed": speed, "quality": quality}
    assert report.wan_bytes(results, ["1mbit", "10mbit", "50mbit"])["sparse_streaming_diloco"] == 5e3
    path = tmp_path / "diloco.png"
    assert report.plot(results, ["1mbit", "10mbit", "50mbit"], str(path)).endswith(str(path))
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("argv,fragment", [
    (["--sites", "1"], "--sites 1 must be >= 2"),
    (["--rates", "fast"], "WAN rate 'fast' is not understood"),
    (["--sync-every", "8", "--fragments", "4", "--overlap-steps", "2"], "overlap_steps"),
    (["--compression", "zstd"], "zstd"),
    (["--sparse-compression", "int8"], "--sparse-compression 'int8' must be a top-k codec"),
    (["--sparse-compression", "topk:2"], "topk"),
    (["--methods", "ddp"], "not among hierarchical_ddp"),
    (["--methods", "hierarchical_ddp,streaming_diloco"], "needs sites_alone"),
], ids=["one-site", "bad-rate", "overlap-too-long", "unknown-codec", "sparse-not-topk", "bad-density",
        "unknown-method", "speed-without-alone"])
def test_bad_arguments_exit_2_before_launching(capsys, argv, fragment):
    assert cli.main(["bench", "diloco", *argv]) == 2
    assert fragment in capsys.readouterr().err
