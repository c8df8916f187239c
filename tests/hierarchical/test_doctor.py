"""``multidc doctor``: detected sites, addresses and ports, measured bandwidths; clear errors before connecting."""

from __future__ import annotations

import pytest

from multidc.hierarchical.tools import cli
from multidc.hierarchical.tools.lab import lab_available
from tests._launch import run_doctor

needs_lab = pytest.mark.skipif(lab_available() is not None, reason=f"lab WAN unavailable: {lab_available()}")


def _check_report(report: dict, printed: str) -> None:
    assert [s["ranks"] for s in report["sites"]] == [[0, 1], [2, 3]]
    assert [r["site"] for r in report["ranks"]] == [0, 0, 1, 1]
    assert [r["rail"] for r in report["ranks"]] == [0, 1, 0, 1]
    host, port = report["rendezvous"].rsplit(":", 1)
    assert int(port) in report["ranks"][0]["listen_ports"]  # rank 0 serves the rendezvous store
    assert all(r["listen_ports"] for r in report["ranks"])  # every rank listens for its peers
    for site in report["sites"]:
        assert site["intra_MBps"] > 0 and site["inter_MBps_per_rail"] > 0
    assert "listening TCP ports" in printed and report["rendezvous"] in printed
    assert "unauthenticated" in printed


def test_doctor_on_loopback_prints_sites_ports_and_bandwidths(tmp_path):
    proc, report = run_doctor(tmp_path, "--loopback")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_report(report, proc.stdout)
    assert {r["address"] for r in report["ranks"]} == {"127.0.0.1"}


@needs_lab
def test_doctor_in_lab_measures_the_shaped_wan_below_the_site_links(tmp_path):
    proc, report = run_doctor(tmp_path, "--wan-rate", "100mbit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_report(report, proc.stdout)
    assert [s["addresses"] for s in report["sites"]] == [["10.213.0.10"], ["10.213.0.11"]]
    for site in report["sites"]:
        # both rails share one 100 mbit = 12.5 MB/s link; the tbf bucket (64 KiB per direction, full after the
        # start barrier) adds 3% to the 2 MiB each direction carries; the rest is timing noise
        assert 6 < site["inter_MBps_site"] <= 13.5
        assert site["intra_MBps"] > site["inter_MBps_site"]  # loopback veth vs the shaped link (CPU-bound here)
    assert not report["warnings"]


def test_doctor_reports_a_layout_that_cannot_split_the_ranks(tmp_path):
    proc, report = run_doctor(tmp_path, "--loopback", env={"MULTIDC_NUM_SITES": "3"})
    assert proc.returncode != 0 and report is None
    assert "have no ranks (of 3 sites, num_sites=3 from num_sites / MULTIDC_NUM_SITES)" in proc.stderr


def test_doctor_without_a_launcher_says_how_to_launch_it(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert "torchrun" in err and "multidc lab run" in err


def test_doctor_rejects_a_bad_wan_setting_before_connecting(capsys, monkeypatch):
    monkeypatch.setenv("MULTIDC_WAN_COMPRESSION", "zstd")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    assert cli.main(["doctor"]) == 2  # would otherwise wait for a second rank that never comes
    assert "MULTIDC_WAN_COMPRESSION" in capsys.readouterr().err
