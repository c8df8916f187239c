"""Elastic sites' lighthouse: ``multidc lighthouse`` serves torchft's lighthouse until SIGTERM, ``check_lighthouse``
reaches it without registering anything, and ``multidc doctor`` reports whether every rank reaches it. Bad
addresses and a lighthouse that is not there give errors that say what to do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from multidc.hierarchical.tools.launch import free_port
from multidc.hierarchical.tools.processes import ProcessTree
from tests._resources import require_torchft

require_torchft()

from multidc.hierarchical.elastic import (  # noqa: E402
    LighthouseUnreachable,
    check_lighthouse,
    lighthouse_url,
    start_lighthouse,
)
from tests._launch import run_doctor  # noqa: E402

MULTIDC = [sys.executable, "-m", "multidc.hierarchical.tools.cli"]


@pytest.fixture
def lighthouse_cli():
    """``multidc lighthouse`` on a free loopback port: (address, the process tree)."""
    with ProcessTree([*MULTIDC, "lighthouse", "--bind", "127.0.0.1:0"], env=dict(os.environ)) as tree:
        lines = []  # torchft's own log line (stderr, merged) may come first: the native server starts at once
        while not lines or (lines[-1] and "multidc lighthouse: listening" not in lines[-1] and len(lines) < 20):
            lines.append(tree.process.stdout.readline())
        match = re.search(r"multidc lighthouse: listening on (127\.0\.0\.1:\d+)", lines[-1])
        assert match, "".join(lines)
        yield match.group(1), tree


def test_cli_serves_until_sigterm_and_check_reaches_it(lighthouse_cli):
    address, tree = lighthouse_cli
    assert check_lighthouse(address, timeout_s=5) == f"http://{address}"
    tree.process.send_signal(signal.SIGTERM)
    output, _ = tree.process.communicate(timeout=20)
    assert tree.process.returncode == 0 and "stopped" in output
    with pytest.raises(LighthouseUnreachable, match=re.escape(f"http://{address}")):
        check_lighthouse(address, timeout_s=1)


def test_the_lighthouse_starts_without_importing_torch_so_a_restart_is_quick():
    # a restarted lighthouse is what every site waits for: its process loads torchft's native server only
    code = ("import sys, subprocess; from multidc.hierarchical.elastic import start_lighthouse; "
            "server = start_lighthouse('127.0.0.1:0'); print('torch' in sys.modules, server.address()); "
            "server.shutdown()")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False http://"), out.stdout
    assert time.monotonic() - started < 10
    address = out.stdout.split("http://", 1)[1].strip()
    assert address.rsplit(":", 1)[1].isdigit()


def test_the_lazily_imported_names_are_the_functions_whatever_was_imported_first():
    # multidc.hierarchical imports its names on first use; its submodule all_reduce must not replace the function
    code = ("import multidc.hierarchical.diloco, multidc.hierarchical.elastic.site\n"
            "import multidc.hierarchical as h, multidc.hierarchical.elastic as e\n"
            "from multidc.hierarchical import all_reduce, Topology\n"
            "assert callable(h.all_reduce) and all_reduce is h.all_reduce and callable(e.ElasticSite), h.all_reduce\n"
            "assert {'all_reduce', 'Topology', 'DiLoCo'} <= set(dir(h)) and 'ElasticDiLoCo' in dir(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_unreachable_lighthouse_says_where_and_what_to_do():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(LighthouseUnreachable) as err:
        check_lighthouse(address, timeout_s=1)
    assert time.monotonic() - started < 10
    assert f"http://{address}" in str(err.value) and "multidc lighthouse --bind" in str(err.value)


def test_lighthouse_address_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv("MULTIDC_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="set MULTIDC_LIGHTHOUSE=host:port"):
        lighthouse_url()
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "10.0.0.5:29510")
    assert lighthouse_url() == "http://10.0.0.5:29510"
    monkeypatch.setenv("MULTIDC_LIGHTHOUSE", "10.0.0.5")
    with pytest.raises(ValueError, match="MULTIDC_LIGHTHOUSE='10.0.0.5' must be host:port"):
        lighthouse_url()


@pytest.mark.parametrize("kwargs,message", [
    ({"bind": "29510"}, "must be host:port"),
    ({"bind": "127.0.0.1:0", "min_sites": 0}, "min_sites=0 must be a positive integer"),
    ({"bind": "127.0.0.1:0", "heartbeat_timeout_ms": -5}, "heartbeat_timeout_ms=-5"),
])
def test_bad_lighthouse_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        start_lighthouse(**kwargs)


def test_doctor_checks_every_rank_reaches_the_lighthouse(lighthouse_cli, tmp_path):
    address, _ = lighthouse_cli
    proc, report = run_doctor(tmp_path, "--loopback", env={"MULTIDC_LIGHTHOUSE": address})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["lighthouse"] == {"url": f"http://{address}", "unreachable_from": [], "error": None}
    assert f"torchft lighthouse http://{address}: reached from every rank" in proc.stdout


def test_doctor_fails_when_the_lighthouse_is_not_there(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    proc, report = run_doctor(tmp_path, "--loopback", env={"MULTIDC_LIGHTHOUSE": address})
    assert proc.returncode != 0
    assert report["lighthouse"]["unreachable_from"] == [0, 1, 2, 3]
    assert f"UNREACHABLE from ranks 0,1,2,3: no torchft lighthouse answers at http://{address}" in proc.stdout


def test_without_torchft_the_error_says_which_extra_to_install(monkeypatch):
    from multidc.hierarchical.elastic import import_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(ImportError, match=re.escape("pip install 'multidc[elastic]'")):
        import_torchft()
