"""``benchmarks/bench_checkpoint_regions.py``: its figures and targets on synthetic records (a reference computed
from the per-site seconds the records were built from), its plot, and its argument checks. The benchmark itself
runs in the lab under ``make bench-checkpoint-regions``."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import bench_checkpoint_regions, checkpoint_regions_report
from multidc.hierarchical.tools import lab
from tests._resources import require_module

_MIB = 1 << 20
# operation -> (site 0 s, site 1 s): the slowest rank's seconds in repeat 1 (later repeats 5% slower each)
_SECONDS = {"single URL save": (11.0, 11.2), "single URL load": (0.9, 22.0), "raw PUT (bound)": (1.0, 1.1),
            "region-local save": (1.1, 1.2), "raw GET, then exchange": (0.40, 0.44),
            "raw GET, exchange overlapped": (0.36, 0.50), "region-local load": (0.43, 0.52)}
_SENT = {"single URL save": (1 * _MIB, 130 * _MIB), "single URL load": (260 * _MIB, 2 * _MIB)}  # else 64 KiB


def _records(remote_read=(0, 0), reps=(1, 2, 3)) -> list[dict]:
    """Two ranks per site; rank 1 of a site 10% faster than rank 0, so the site's figure is rank 0's."""
    out = []
    for rep in reps:
        for name, per_site in _SECONDS.items():
            for site in (0, 1):
                for local in (0, 1):
                    first = local == 0
                    tx = _SENT.get(name, (64 << 10, 64 << 10))[site]
                    read = remote_read[site] if first and name == "region-local load" else None
                    out.append({"name": name, "rep": rep, "site": site, "rank": 2 * site + local,
                                "seconds": per_site[site] * (1 + 0.05 * (rep - 1)) * (0.9 if local else 1.0),
                                "wan_tx": tx if first else None, "wan_rx": tx if first else None, "remote_read": read,
                                "tcp_retrans": 3 if first else None, "http_retries": int(name == "single URL save")})
    return out


def _expected(name: str, site: int, reps=(1, 2, 3)) -> float:
    return statistics.median(_SECONDS[name][site] * (1 + 0.05 * (rep - 1)) for rep in reps)


def test_figures_are_the_slowest_rank_per_site_over_its_bound_and_the_wan_bytes_every_site_sent():
    values = checkpoint_regions_report.figures(checkpoint_regions_report.per_site(_records()))
    for site in (0, 1):
        assert values[f"save_over_put_{site}"] == pytest.approx(
            _expected("region-local save", site) / _expected("raw PUT (bound)", site))
        floor = min(_expected("raw GET, then exchange", site), _expected("raw GET, exchange overlapped", site))
        assert values[f"load_over_floor_{site}"] == pytest.approx(_expected("region-local load", site) / floor)
    assert values["remote_load_speedup"] == pytest.approx(22.0 / 0.52)
    assert values["single_save_wan_mib"] == pytest.approx(131.0)
    assert values["save_wan_mib"] == values["load_wan_mib"] == pytest.approx(128 / 1024)
    assert values["load_remote_read_bytes"] == 0


def test_targets_pass_on_a_local_load_and_fail_when_a_site_read_from_another_region():
    def verdicts(records):
        values = checkpoint_regions_report.figures(checkpoint_regions_report.per_site(records))
        return {n: v["pass"] for n, v in checkpoint_regions_report.verdicts(values, 2).items()}

    good = verdicts(_records())
    assert all(good.values()), good
    crossed = verdicts(_records(remote_read=(0, 5 * _MIB)))
    assert [n for n, ok in crossed.items() if not ok] == [
        "region-local load reads 0 checkpoint bytes from other regions (library count, every site and repeat)"]


def test_a_load_that_never_reported_its_cross_region_bytes_fails_the_target():
    records = _records()
    for r in records:
        if r["name"] == "region-local load" and r["site"] == 1:
            r["remote_read"] = None
    values = checkpoint_regions_report.figures(checkpoint_regions_report.per_site(records))
    assert values["load_remote_read_bytes"] == float("inf")


def test_report_prints_every_site_and_returns_a_passing_record(capsys):
    out = {"records": _records(), "state_bytes": 256 * _MIB, "sites": ["0", "1"]}
    record = checkpoint_regions_report.report(out, wan_rate="100mbit", ranks_per_site=2, repeats=3,
                                              min_state_bytes=200 * 10**6)
    printed = capsys.readouterr().out
    assert record["pass"] and record["valid_size"]
    assert record["rows"]["region-local load"]["1"]["median"] == pytest.approx(_expected("region-local load", 1))
    single = record["rows"]["single URL save"]["1"]
    assert (single["http_retries"], single["tcp_retrans"]) == (2 * 3, 3 * 3)  # 2 ranks x 3 repeats; 3 repeats
    assert printed.count("region-local save") >= 2 and "PASS" in printed and "FAIL" not in printed


def test_plot_writes_a_png_of_seconds_and_wan_bytes(tmp_path):
    require_module("matplotlib", "bench")
    out = {"records": _records(), "state_bytes": 256 * _MIB, "sites": ["0", "1"]}
    record = checkpoint_regions_report.report(out, wan_rate="100mbit", ranks_per_site=2, repeats=3,
                                              min_state_bytes=0)
    path = tmp_path / "regions.png"
    checkpoint_regions_report.plot(record, str(path))
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000


@pytest.mark.parametrize("argv, lab_reason, says", [
    ([], "the lab WAN needs root (network namespaces and tc)", "run it as root"),
    (["--size-mb", "8"], None, "--allow-small"),
    (["--repeats", "0"], None, "--repeats 0 must be at least 1"),
    (["--wan-rate", "fast"], None, "--wan-rate"),
])
def test_arguments_that_cannot_measure_the_targets_are_refused_naming_the_fix(monkeypatch, capsys, argv, lab_reason,
                                                                               says):
    monkeypatch.setattr(lab, "lab_available", lambda: lab_reason)
    with pytest.raises(SystemExit) as exc:
        bench_checkpoint_regions.parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_small_model_runs_as_a_smoke_run_when_allowed(monkeypatch):
    monkeypatch.setattr(lab, "lab_available", lambda: None)
    args = bench_checkpoint_regions.parse_args(["--size-mb", "8", "--allow-small", "--repeats", "2"])
    assert (args.size_mb, args.repeats, args.wan_rate) == (8, 2, "100mbit")
