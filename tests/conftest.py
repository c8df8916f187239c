"""Session-wide fixtures: real SeaweedFS S3 servers (one anonymous, one with S3 authentication); the ``dist`` marker.

A test is marked ``dist`` (``make test-fast`` deselects it) when it, one of its fixtures, or a function or class of
``tests`` / ``benchmarks`` that they use refers to something that starts processes (``_SPAWNERS``), or when its
module or class carries ``pytest.mark.dist``. Names are resolved in each function's own globals, so a new test that
calls ``run_ranks`` or uses ``s3_server`` is marked without further work.
"""

from __future__ import annotations

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
from multidc.hierarchical.tools.seaweed import SeaweedS3
from tests import _launch
from tests._resources import require_weed

# Modules and objects whose use means: this test starts processes (ranks, launchers, S3 servers, namespaces).
_SPAWNERS = {id(o) for o in (subprocess, multiprocessing, torch.multiprocessing, processes, _launch, ranks.run_ranks,
                              processes.ProcessTree, SeaweedS3, Lab, SiteJob)}
_OUR_PREFIXES = ("tests.", "benchmarks.")

AUTH_KEYS = ("MDCTESTACCESSKEY", "mdc-test-secret-9f2c41d7")
READONLY_KEYS = ("MDCREADONLYKEY", "mdc-readonly-secret-51b0e2aa")


def _start(tmp_path_factory, name: str, **kwargs) -> SeaweedS3:
    require_weed()
    return SeaweedS3.start(tmp_path_factory.mktemp(name), **kwargs)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 gateway on loopback that accepts anonymous requests."""
    server = _start(tmp_path_factory, "seaweed")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory):
    """A SeaweedFS S3 gateway on loopback that only accepts ``AUTH_KEYS`` (and ``READONLY_KEYS``: no writes)."""
    server = _start(tmp_path_factory, "seaweed-auth", auth=AUTH_KEYS, readonly=READONLY_KEYS)
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
