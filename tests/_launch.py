"""Run a command that starts ranks of its own (a Lightning script, ``accelerate launch``) from a test."""

from __future__ import annotations

import pytest

from multidc.hierarchical.tools.processes import ProcessTree


def run_script(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``(exit code, output)`` of ``argv``; every process it started is killed once it ends, wherever torchrun put
    it. A run past ``timeout`` seconds fails the test with its output."""
    return finish(ProcessTree(argv, env=env), timeout)


def finish(tree: ProcessTree, timeout: float) -> tuple[int, str]:
    """``run_script`` for a tree already started (several launches at once)."""
    try:
        return tree.wait(timeout)
    except TimeoutError as exc:
        pytest.fail(str(exc))
