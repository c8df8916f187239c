"""The lab WAN (network namespaces + tc tbf) and ``multidc bench allreduce``.

Namespace tests need root and iproute2; they are skipped with the reason otherwise. Each checks that every
namespace it made is gone afterwards, also when the lab process is interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from multidc.hierarchical.tools import bench, cli
from multidc.hierarchical.tools.lab import Lab, lab_available, parse_rate
from tests._resources import require_module

needs_lab = pytest.mark.skipif(lab_available() is not None, reason=f"lab WAN unavailable: {lab_available()}")


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _left_behind() -> set[str]:
    """Lab namespaces whose process has ended (``mdc<pid>-...``): leaked. Another test worker's lab may be live
    meanwhile, so a namespace of a live process does not count."""
    return {n for n in _netns() if (m := re.fullmatch(r"mdc(\d+)-\S+", n)) and not os.path.exists(f"/proc/{m[1]}")}


@pytest.mark.parametrize("text, bps", [("400mbit", 4e8), ("1gbit", 1e9), ("50000kbit", 5e7), (" 2.5Mbit ", 2.5e6)])
def test_parse_rate_accepts_tc_units(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["400", "400mb", "-1mbit", "0mbit", "fast"])
def test_parse_rate_rejects_with_accepted_forms(text):
    with pytest.raises(ValueError, match="400mbit"):
        parse_rate(text)


@needs_lab
def test_lab_shapes_both_directions_and_removes_namespaces():
    with Lab(2, "40mbit") as lab:
        names = {lab.netns(0), lab.netns(1), lab.wan_netns}
        assert names <= _netns()
        for ns, dev in [(lab.netns(0), "wan0"), (lab.wan_netns, "h0"), (lab.netns(1), "wan0"), (lab.wan_netns, "h1")]:
            qdisc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "40Mbit" in qdisc, qdisc
        # A site reaches the other over the bridge, and the sender's interface counter sees the bytes.
        before = lab.tx_bytes(1)
        server = subprocess.Popen(lab.wrap(0, [sys.executable, "-c", _SERVER]), stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run(lab.wrap(1, [sys.executable, "-c", _CLIENT]), check=True, timeout=30)
        assert server.communicate(timeout=30)[0].strip() == str(1 << 20)
        assert lab.tx_bytes(1) - before >= 1 << 20
    assert not names & _netns()


@needs_lab
def test_set_rate_re_shapes_every_link_of_a_running_lab_both_directions():
    def rates(lab) -> list[str]:
        return [subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], capture_output=True,
                               text=True, check=True).stdout
                for ns, dev in [(lab.netns(0), "wan0"), (lab.wan_netns, "h0"), (lab.netns(1), "wan0"),
                                (lab.wan_netns, "h1")]]

    with Lab(2, "40mbit") as lab:
        lab.set_rate("20mbit")
        assert all("tbf" in q and "20Mbit" in q for q in rates(lab)), rates(lab)
        assert lab.rate_bps == 20e6
    with Lab(2) as unshaped:  # an unshaped lab is shaped from then on
        unshaped.set_rate("5mbit")
        assert all("5Mbit" in q for q in rates(unshaped)), rates(unshaped)


_SERVER = textwrap.dedent("""
    import socket
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.213.0.10", 5999)); s.listen(); c, _ = s.accept(); n = 0
    while (b := c.recv(65536)):
        n += len(b)
    print(n)
""")
_CLIENT = 'import socket; s = socket.create_connection(("10.213.0.10", 5999)); s.sendall(b"x" * (1 << 20)); s.close()'


@needs_lab
def test_lab_cut_link_blocks_traffic_until_restored():
    with Lab(2) as lab:
        probe = [sys.executable, "-c", 'import socket; socket.create_connection(("10.213.0.10", 22), timeout=1)']
        lab.set_link(1, up=False)
        cut = subprocess.run(lab.wrap(1, probe), capture_output=True, text=True)
        assert "timed out" in cut.stderr or "unreachable" in cut.stderr.lower(), cut.stderr
        lab.set_link(1, up=True)
        time.sleep(0.2)
        back = subprocess.run(lab.wrap(1, probe), capture_output=True, text=True)
        assert "refused" in back.stderr, back.stderr  # reachable again: nothing listens on port 22 there


@needs_lab
def test_lab_is_torn_down_when_its_process_gets_sigterm(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from multidc.hierarchical.tools.lab import Lab
        with Lab(2, "100mbit") as lab:
            print(lab.netns(0), flush=True)
            time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    assert name in _netns()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) != 0
    assert not {n for n in _netns() if n.startswith(name.split("-")[0] + "-")}


@needs_lab
def test_next_lab_sweeps_namespaces_of_a_killed_lab(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text("import time\nfrom multidc.hierarchical.tools.lab import Lab\nlab = Lab(2).__enter__()\n"
                      "print(lab.netns(0), flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    prefix = proc.stdout.readline().strip().split("-")[0]
    assert any(n.startswith(prefix + "-") for n in _netns())
    proc.kill()  # its namespaces stay behind (a lab of another test worker may sweep them first)
    proc.wait()
    with Lab(2):
        pass
    assert not any(n.startswith(prefix + "-") for n in _netns())


def _bench(tmp_path, *extra) -> dict:
    out = tmp_path / "bench.json"
    argv = ["bench", "allreduce", "--sites", "2", "--ranks-per-site", "2", "--size-mb", "1", "--repeats", "2",
            "--compression", "none,int8", "--json", str(out), "--timeout-s", "120", *extra]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.dist  # cli.main starts the ranks
def test_bench_on_loopback_compares_flat_and_hierarchical_in_one_run(tmp_path, capsys):
    result = _bench(tmp_path, "--loopback")
    printed = capsys.readouterr().out
    assert "WITHOUT bandwidth shaping" in printed
    modes = [row["mode"] for row in result["summary"]]
    assert modes == ["flat", "hier", "hier+int8"]
    hier, int8 = result["summary"][1], result["summary"][2]
    assert hier["max_rel_error_vs_flat"] < 1e-5 and int8["max_rel_error_vs_flat"] < 0.05
    # payload over the WAN per site: 1 MiB for the uncompressed ring over 2 sites, ~1/4 of it for int8
    assert hier["wan_bytes_per_site"] == 1 << 20
    assert int8["wan_bytes_per_site"] < 0.3 * (1 << 20)
    assert all(line in printed for line in ("median s", "x flat", '"bench": "allreduce"'))


@needs_lab
def test_bench_in_lab_reads_interface_counters_and_leaves_no_namespace(tmp_path):
    require_module("matplotlib", "bench")
    leaked_before = _left_behind()
    result = _bench(tmp_path, "--wan-rate", "200mbit", "--plot", str(tmp_path / "bench.png"))
    assert result["config"]["shaped"]
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    hier = result["summary"][1]
    # interface bytes = payload + TCP/IP headers: a little over the 1 MiB payload
    assert (1 << 20) <= hier["wan_bytes_per_site"] < 1.2 * (1 << 20)
    assert 0 < hier["line_rate_share"] <= 1.05
    assert not _left_behind() - leaked_before


def test_bench_rejects_unknown_compression_before_launching(capsys):
    assert cli.main(["bench", "allreduce", "--compression", "none,zstd"]) == 2
    assert "zstd" in capsys.readouterr().err


def _summary_row(mode: str, median_s: float, wan_mb: float | None, shaped: bool) -> dict:
    return {"mode": mode, "median_s": median_s, "min_s": 0.9 * median_s, "max_s": 1.1 * median_s,
            "speedup_vs_flat": 2.0 / median_s, "max_rel_error_vs_flat": 1e-3,
            "wan_bytes_per_site": None if wan_mb is None else wan_mb * 1e6,
            "wan_MBps": None if wan_mb is None else wan_mb / median_s,
            "bound_s": wan_mb * 1e6 / 5e7 if shaped else None, "line_rate_share": 0.9 if shaped else None}


@pytest.mark.parametrize("shaped", [True, False], ids=["lab", "loopback"])
def test_bench_plot_writes_a_png_from_a_summary(tmp_path, shaped):
    require_module("matplotlib", "bench")
    rows = [_summary_row("flat", 2.0, 100.0 if shaped else None, shaped), _summary_row("hier", 1.4, 67.0, shaped),
            _summary_row("hier+int8", 0.5, 17.0, shaped)]  # on loopback the flat ring's WAN bytes are unknown
    config = {"size_mb": 64.0, "sites": 2, "ranks_per_site": 2, "wan_rate": "400mbit", "shaped": shaped}
    bench.plot(rows, config, str(tmp_path / "figs" / "allreduce.png"))
    png = (tmp_path / "figs" / "allreduce.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


_RANK_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from multidc.hierarchical import Topology, all_reduce
    dist.init_process_group("gloo")
    topo = Topology.build()
    t = torch.full((5,), float(dist.get_rank()))
    all_reduce(t, topo)
    in_lab = os.path.exists("/sys/class/net/wan0")
    line = f"rank={dist.get_rank()} site={topo.site} local={topo.local_rank_in_site} lab={in_lab} sum={t[0].item()}"
    os.write(1, (line + "\\n").encode())  # one write: ranks share the terminal
    dist.destroy_process_group()
    sys.exit(int(os.environ.get("FAIL_RANK", "-1") == os.environ["RANK"]) * 3)
""")


def _lab_run(tmp_path, capfd, *extra, env=None):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        code = cli.main(["lab", "run", "--sites", "2", "--ranks-per-site", "2", "--timeout-s", "90", *extra,
                         "--", sys.executable, str(script)])
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return code, capfd.readouterr()


@pytest.mark.dist  # cli.main starts the ranks
def test_lab_run_gives_each_rank_its_site_and_torchrun_env(tmp_path, capfd):
    code, out = _lab_run(tmp_path, capfd)
    assert code == 0, out.err
    lines = sorted(line for line in out.out.splitlines() if line.startswith("rank="))
    in_lab = lab_available() is None
    assert lines == [f"rank={r} site={r // 2} local={r % 2} lab={in_lab} sum=6.0" for r in range(4)]


@pytest.mark.dist  # cli.main starts the ranks
def test_lab_run_reports_a_failed_rank(tmp_path, capfd):
    code, out = _lab_run(tmp_path, capfd, env={"FAIL_RANK": "2"})
    assert code == 1
    assert "{2: 3}" in out.err


def test_free_ports_are_distinct_bindable_and_outside_the_kernels_port_0_range():
    # a port the kernel hands to a port-0 bind (a store, a gloo pair, a torchft manager) could be taken again
    # before the process it was picked for binds it: a site's torchrun once failed with EADDRINUSE that way
    import socket

    from multidc.hierarchical.tools.launch import _ephemeral_range, free_port

    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    low, _ = _ephemeral_range()
    assert all(1024 <= port < low for port in ports)
    for port in ports[:4]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("sites, loopback", [(3, False), (2, True)])
def test_site_job_refuses_a_given_lab_of_other_sites_or_with_loopback(sites, loopback):
    from multidc.hierarchical.tools.launch import SiteJob

    with pytest.raises(ValueError, match="lab= has 2 sites"):
        SiteJob(["true"], sites=sites, ranks_per_site=1, loopback=loopback, lab=Lab(2, "100mbit"))
