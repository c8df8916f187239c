"""Run a command that starts ranks of its own (a Lightning script, ``accelerate launch``) from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


# Cold start, measured in the first run after `make clean` on 2 cores (2026-11-23): the 3 batches of two 4-rank
# launches took 43 s together, about 14 s a batch. 150 s per launch is a 10x margin for a slower, loaded machine.
LAUNCH_TIMEOUT_S = 150
ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
CONFIG = os.path.join(ROOT, "examples", "accelerate_config.yaml")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
MULTIDC = [sys.executable, "-m", "multidc.hierarchical.tools.cli"]
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                "ACCELERATE_USE_CPU")


def launch(args: list[str], env: dict[str, str], tmp_path) -> ProcessTree:
    """Start ``accelerate launch --config_file CONFIG ARGS`` with a clean environment, as a ``ProcessTree``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIDC_", "ACCELERATE_"))
             and k not in _LAUNCH_VARS}
    # HF_HOME: no default accelerate config of this machine may leak into the run.
    env = {**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HOME": str(tmp_path / "hf"), **env}
    return ProcessTree([ACCELERATE, "launch", "--config_file", CONFIG, *args], env=env)


def run_doctor(tmp_path, *lab_args: str, env: dict | None = None, sites: int = 2, per_site: int = 2):
    """``multidc lab run ... -- multidc doctor`` on ``sites`` x ``per_site`` ranks: ``(the completed process, its JSON
    report or None)``."""
    out = tmp_path / "doctor.json"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_")}
    argv = [*MULTIDC, "lab", "run", "--sites", str(sites), "--ranks-per-site", str(per_site), "--timeout-s", "90",
            *lab_args, "--", *MULTIDC, "doctor", "--size-mb", "1", "--repeats", "2", "--json", str(out)]
    # Every rank the lab launcher starts is killed with it (ProcessTree); stdout and stderr come back together.
    code, output = run_script(argv, {**clean, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=120)
    proc = subprocess.CompletedProcess(argv, code, stdout=output, stderr=output)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def start_training_script(script: str, args: list[str], env: dict | None = None) -> ProcessTree:
    """Start a training script that launches its own ranks, with a clean environment; ``finish`` waits for it and
    kills every rank it started."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_") and k not in ("RANK", "WORLD_SIZE",
             "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    return ProcessTree([sys.executable, script, *args], env={**clean, "OMP_NUM_THREADS": "1", **(env or {})})


def run_training_script(script: str, args: list[str], env: dict | None = None, timeout: float = 300) -> str:
    """Run a training script that launches its own ranks; afterwards (also on timeout) kill every rank it started."""
    code, out = finish(start_training_script(script, args, env), timeout)
    assert code == 0, out[-6000:]
    return out
