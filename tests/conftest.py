"""Session-wide fixtures: real SeaweedFS S3 servers (one anonymous, one with S3 authentication); the ``dist`` marker.

A test is marked ``dist`` (``make test-fast`` deselects it) when it, one of its fixtures, or a function or class of
``tests`` / ``benchmarks`` that they use refers to something that starts processes (``_SPAWNERS``), or when its
module or class carries ``pytest.mark.dist``. Names are resolved in each function's own globals, so a new test that
calls ``run_ranks`` or uses ``s3_server`` is marked without further work.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import multiprocessing
import subprocess
import sys
import types
import uuid

import pytest
import torch.multiprocessing

from multidc.hierarchical.tools import processes, ranks
from multidc.hierarchical.tools.lab import Lab
from multidc.hierarchical.tools.launch import SiteJob
from multidc.hierarchical.tools.seaweed import SeaweedS3, weed_binary
from tests import _launch, _preload
from tests._resources import require_weed

# Modules and objects whose use means: this test starts processes (ranks, launchers, S3 servers, namespaces).
_SPAWNERS = {id(o) for o in (subprocess, multiprocessing, torch.multiprocessing, processes, _launch, ranks.run_ranks,
                              processes.ProcessTree, SeaweedS3, Lab, SiteJob)}
_OUR_PREFIXES = ("tests.", "benchmarks.")

AUTH_KEYS = ("MDCTESTACCESSKEY", "mdc-test-secret-9f2c41d7")
READONLY_KEYS = ("MDCREADONLYKEY", "mdc-readonly-secret-51b0e2aa")


# The session's S3 servers: {fixture: (folder name, SeaweedS3.start arguments)}.
_SERVERS = {"s3_server": ("seaweed", {}),
            "s3_auth_server": ("seaweed-auth", {"auth": AUTH_KEYS, "readonly": READONLY_KEYS})}
# Servers started at the session's start (``pytest_collection_finish``), not yet taken by their fixture.
_EARLY: dict[str, concurrent.futures.Future] = {}


def _start(tmp_path_factory, fixture: str) -> SeaweedS3:
    early = _EARLY.pop(fixture, None)
    if early is not None:
        return early.result()  # a failed start raises here, in the first test that needs the server
    require_weed()
    name, kwargs = _SERVERS[fixture]
    return SeaweedS3.start(tmp_path_factory.mktemp(name), **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    """The ranks ``run_ranks`` forks import these once, in its forkserver (per pytest process), rather than each rank
    anew: seconds of CPU per rank on 2 cores, for the many cases whose ranks use Lightning or Accelerate."""
    ranks.preload(_preload.MODULES, on_start=_preload.on_rank_start)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the servers that the selected tests use, in the background: a start mostly waits for the server to be
    ready (seconds), which then overlaps the first tests instead of holding up the first test that needs it. Only
    with the ``weed`` binary there (else the fixture reports it missing, as ever)."""
    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ()) if name in _SERVERS}
    if not wanted or weed_binary() is None or session.config.option.collectonly:
        return
    factory = session.config._tmp_path_factory  # what the tmp_path_factory fixture returns
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="seaweed-start")
    for fixture in sorted(wanted):
        name, kwargs = _SERVERS[fixture]
        _EARLY[fixture] = pool.submit(SeaweedS3.start, factory.mktemp(name), **kwargs)
    pool.shutdown(wait=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the servers started early that no test took (an interrupted or deselected run)."""
    for early in _EARLY.values():
        with contextlib.suppress(Exception):
            early.result().stop()
    _EARLY.clear()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 gateway on loopback that accepts anonymous requests."""
    server = _start(tmp_path_factory, "s3_server")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory):
    """A SeaweedFS S3 gateway on loopback that only accepts ``AUTH_KEYS`` (and ``READONLY_KEYS``: no writes)."""
    server = _start(tmp_path_factory, "s3_auth_server")
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on ``s3_server``; returns ``s3://<name>``."""
    return s3_server.make_bucket(f"t-{uuid.uuid4().hex[:12]}")


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # lambdas, nested functions, comprehensions
            names |= _code_names(const)
    return names


def _code_strings(code: types.CodeType) -> set[str]:
    strings = {c for c in code.co_consts if isinstance(c, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            strings |= _code_strings(const)
    return strings


def _spawns(obj, seen: set[int]) -> bool:
    """Whether ``obj`` starts processes: it is one of ``_SPAWNERS``, or a function or class of ``tests`` /
    ``benchmarks`` that uses one, directly or through others of theirs."""
    if id(obj) in _SPAWNERS:
        return True
    if id(obj) in seen or not getattr(obj, "__module__", None) or not obj.__module__.startswith(_OUR_PREFIXES):
        return False
    seen.add(id(obj))
    if inspect.isclass(obj):
        return any(_spawns(member, seen) for member in vars(obj).values() if inspect.isfunction(member))
    func = inspect.unwrap(obj)
    if not inspect.isfunction(func):
        return False
    names = _code_names(func.__code__)
    # request.getfixturevalue("s3_server"): a fixture of this module named by a string
    fixtures = [globals()[n] for n in _code_strings(func.__code__) if n in _FIXTURES]
    # A module imported inside the function (``from multidc.hierarchical.tools.ranks import run_ranks``) appears
    # among the names by its dotted name, the names taken from it beside it.
    imported = [sys.modules[n] for n in names if n not in func.__globals__ and n in sys.modules]
    used = [func.__globals__[n] for n in names if n in func.__globals__]
    used += [getattr(module, n) for module in imported for n in names if hasattr(module, n)]
    return any(_spawns(o, seen) for o in [*imported, *used, *fixtures])


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("dist") is not None or not isinstance(item, pytest.Function):
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        seen: set[int] = set()
        if any(_spawns(f, seen) for f in [item.function, *fixtures]):
            item.add_marker(pytest.mark.dist)


_FIXTURES = {"s3_server", "s3_auth_server", "s3_bucket"}


@pytest.fixture
def lighthouse():
    """A torchft lighthouse in this process on a free loopback port (tests/hierarchical/test_elastic.py's
    ``Lighthouse``: ``.address``, ``.restart(down_s)``); shut down after the test."""
    from tests._elastic import Lighthouse

    server = Lighthouse()
    try:
        yield server
    finally:
        server.server.shutdown()
