"""HierarchicalDDPStrategy end to end: Trainer runs with 4 CPU ranks in subprocesses, registry, env config, errors.

The Trainer runs use _lightning_script.py, an ordinary script whose only multidc lines are the import and
the strategy name; the strategy launches its own ranks, as for a user running ``python train.py``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from tests import _launch
from tests._resources import require_module

require_module("lightning", "lightning")

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

import multidc.strategies  # noqa: E402,F401  (registers the strategy names)
from multidc.hierarchical import WanConfig  # noqa: E402
from multidc.hierarchical.tools.processes import ProcessTree  # noqa: E402
from multidc.strategies import HierarchicalDDPFabricStrategy, HierarchicalDDPStrategy  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "_lightning_script.py")
# Variables a launcher or the caller's shell may have set; each run must start clean.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def start_script(args: list[str], env: dict[str, str]) -> ProcessTree:
    """Start the training script with a clean environment; ``_launch.finish`` waits for it and kills every rank it
    launched."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_") and k not in _LAUNCH_VARS}
    return ProcessTree([sys.executable, SCRIPT, *args], env={**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                                             **env})


# Every launch of this module: {name: (script arguments, environment)}.
LAUNCHES = {
    # 4 ranks, 2 sites from env, accumulation 2, 3 optimizer steps
    "ddp": (["--strategy", "ddp", "--accumulate", "2"], {}),
    "hierarchical_ddp": (["--strategy", "hierarchical_ddp", "--accumulate", "2"],
                         {"MULTIDC_NUM_SITES": "2", "MULTIDC_WAN_CHUNK_MB": "0.0005", "MULTIDC_WAN_STREAMS": "3"}),
    # Fabric, 2 ranks, 2 sites
    "fabric": (["--fabric", "--strategy", "hierarchical_ddp", "--devices", "2"], {"MULTIDC_NUM_SITES": "2"}),
}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every launch of ``LAUNCHES`` at once (10 ranks on 2 cores: each launch's first process imports Lightning
    alone before it starts the others, which leaves a core idle); ``{name: (exit code, output, out dir)}``."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in LAUNCHES}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every launch
        trees = {name: stack.enter_context(start_script([*args, "--out", str(dirs[name])], env))
                 for name, (args, env) in LAUNCHES.items()}
        return {name: (*_launch.finish(tree, 180), dirs[name]) for name, tree in trees.items()}


@pytest.fixture(scope="module")
def runs(launches):
    """The `ddp` and the `hierarchical_ddp` Trainer runs: their reports, CSV rows and weights."""
    results = {}
    for strategy in ("ddp", "hierarchical_ddp"):
        code, log, out_dir = launches[strategy]
        assert code == 0, f"{strategy} run failed:\n{log[-6000:]}"
        with open(out_dir / "run.json") as f:
            report = json.load(f)
        with open(report["metrics_csv"]) as f:
            report["csv"] = list(csv.DictReader(f))
        report["weights"] = torch.load(out_dir / "weights.pt")
        results[strategy] = report
    return results


def test_hierarchical_ddp_trains_to_the_same_weights_as_ddp(runs):
    ddp, hier = runs["ddp"]["weights"], runs["hierarchical_ddp"]["weights"]
    assert runs["hierarchical_ddp"]["strategy_class"] == "HierarchicalDDPStrategy"
    for name, reference in ddp["final"].items():
        assert not torch.allclose(reference, ddp["initial"][name]), f"{name} did not train"
        torch.testing.assert_close(hier["final"][name], reference, rtol=1e-5, atol=1e-6, msg=name)


def test_string_name_takes_site_layout_and_wan_settings_from_env(runs):
    report = runs["hierarchical_ddp"]
    assert report["world_size"] == 4
    assert report["site_sizes"] == [2, 2]
    assert report["wan"]["chunk_mb"] == 0.0005 and report["wan"]["streams"] == 3


def test_accumulation_sends_no_wan_bytes_on_non_sync_batches(runs):
    records = runs["hierarchical_ddp"]["per_batch"]
    assert len(records) == 6  # 3 optimizer steps x 2 micro-batches
    previous = {"global_step": 0, "bytes_sent": 0}
    for record in records:
        sent = record["bytes_sent"] - previous["bytes_sent"]
        if record["global_step"] == previous["global_step"]:
            assert sent == 0, f"non-sync batch {record['batch']} sent {sent} WAN bytes"
        else:
            assert sent > 0, f"sync batch {record['batch']} sent nothing over the WAN"
        previous = record


def test_wan_metrics_reach_the_csv_logger_and_progress_bar(runs):
    report = runs["hierarchical_ddp"]
    rows = [r for r in report["csv"] if r.get("wan/bytes_sent")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # one row per optimizer step
    records = report["per_batch"]
    previous = [{"global_step": 0}, *records]
    at_sync = [r["bytes_sent"] for r, p in zip(records, previous) if r["global_step"] != p["global_step"]]
    sync_deltas = [after - before for before, after in zip([0, *at_sync], at_sync)]
    assert [float(r["wan/bytes_sent"]) for r in rows] == sync_deltas
    for row in rows:
        assert float(row["wan/comm_s"]) > 0 and float(row["wan/MBps"]) > 0 and float(row["wan/wait_s"]) >= 0
    assert {"wan/MBps", "wan/wait_s"} <= set(report["progress_bar_metrics"])
    assert not any(k.startswith("wan/") for r in runs["ddp"]["csv"] for k, v in r.items() if v)


def test_fabric_hierarchical_ddp_matches_single_process_reference(launches):
    code, log, out_dir = launches["fabric"]
    assert code == 0, log[-6000:]
    weights = torch.load(out_dir / "weights.pt")
    for name, reference in weights["reference"].items():
        assert not torch.allclose(reference, weights["initial"][name]), f"{name} did not train"
        torch.testing.assert_close(weights["final"][name], reference, rtol=1e-5, atol=1e-6, msg=name)
    with open(out_dir / "run.json") as f:
        report = json.load(f)
    assert report["strategy_class"] == "HierarchicalDDPFabricStrategy"
    assert all(m["wan/bytes_sent"] > 0 for m in report["wan_metrics"])


@pytest.mark.parametrize(("name", "start_method"), [("hierarchical_ddp", "popen"), ("hierarchical_ddp_spawn", "spawn")])
def test_names_are_registered_with_trainer_and_fabric_registries(name, start_method):
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is HierarchicalDDPStrategy and strategy._start_method == start_method
    fabric_strategy = FABRIC_REGISTRY.get(name)
    assert type(fabric_strategy) is HierarchicalDDPFabricStrategy and fabric_strategy._start_method == start_method


NO_LIGHTNING = ["HierarchicalDDPStrategy", "Parallel3DStrategy", "DiLoCoStrategy"]
# Code run by a fresh interpreter each: {name: code}.
FRESH = {
    "reload": (
        "import importlib, multidc.strategies, multidc.strategies.hierarchical_ddp as m\n"
        "import multidc.strategies\n"
        "m = importlib.reload(m); importlib.reload(multidc.strategies)\n"
        "from lightning.pytorch.strategies import StrategyRegistry as R\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY as F\n"
        "assert type(R.get('hierarchical_ddp')) is m.HierarchicalDDPStrategy\n"
        "assert type(F.get('hierarchical_ddp_spawn')) is m.HierarchicalDDPFabricStrategy\n"
        "import os; os.environ['MULTIDC_DILOCO_SYNC_EVERY'] = '8'\n"
        "from multidc.strategies.diloco import DiLoCoStrategy\n"
        "assert type(R.get('diloco')) is DiLoCoStrategy and R.get('diloco_spawn')._start_method == 'spawn'\n"
    ),
    **{name: (
        "import sys; sys.modules['lightning'] = None\n"
        "import multidc.strategies\n"
        "try:\n"
        f"    multidc.strategies.{name}\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    ) for name in NO_LIGHTNING},
}


@pytest.fixture(scope="module")
def interpreters():
    """The checks that need an interpreter of their own (``FRESH``: a reload, each strategy without Lightning), all
    started at once (each mostly imports, on one core); ``{name: completed process}``."""
    procs = {}
    try:
        for name, code in FRESH.items():
            procs[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        results = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return results
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_importing_twice_and_reloading_keeps_one_working_registration(interpreters):
    result = interpreters["reload"]
    assert result.returncode == 0, result.stderr


def test_strategies_pickle_for_spawn_launches():
    """Lightning pickles the strategy for ``hierarchical_ddp_spawn`` (and the Fabric twin): every attribute must."""
    import pickle

    from multidc.hierarchical import DiLoCoConfig
    from multidc.strategies import DiLoCoStrategy, Parallel3DStrategy

    for strategy in (HierarchicalDDPStrategy(num_sites=2), HierarchicalDDPFabricStrategy(num_sites=2),
                     Parallel3DStrategy(num_sites=2), DiLoCoStrategy(num_sites=2, diloco=DiLoCoConfig(sync_every=4))):
        restored = pickle.loads(pickle.dumps(strategy))
        assert type(restored) is type(strategy) and restored.wan == strategy.wan


@pytest.mark.parametrize("name", NO_LIGHTNING)
def test_package_imports_without_lightning_and_the_strategy_says_what_to_install(interpreters, name):
    result = interpreters[name]
    assert result.returncode == 0, result.stderr
    assert "ImportError: multidc's Lightning strategies need Lightning" in result.stdout, result.stdout
    assert "pip install 'multidc[lightning]'" in result.stdout


def test_registration_refuses_to_replace_another_strategy_of_the_same_name():
    from multidc.strategies.hierarchical_ddp import _register

    registry = type(StrategyRegistry)()
    registry.register("hierarchical_ddp", dict, description="someone else's")
    with pytest.raises(RuntimeError, match="already registered to builtins.dict"):
        _register(registry, "hierarchical_ddp", HierarchicalDDPStrategy, "popen")


def test_num_sites_that_does_not_divide_the_ranks_fails_at_trainer_construction(monkeypatch):
    monkeypatch.setenv("MULTIDC_NUM_SITES", "3")
    with pytest.raises(ValueError, match=r"4 ranks .* num_sites=3 .*MULTIDC_NUM_SITES"):
        Trainer(accelerator="cpu", devices=4, strategy="hierarchical_ddp", logger=False)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("MULTIDC_WAN_COMPRESSION", "zstd", r"MULTIDC_WAN_COMPRESSION='zstd'.*not supported"),
        ("MULTIDC_WAN_CHUNK_MB", "-1", r"MULTIDC_WAN_CHUNK_MB=-1.0.*positive"),
        ("MULTIDC_NUM_SITES", "two", r"MULTIDC_NUM_SITES='two' is not an integer"),
        ("MULTIDC_NUM_SITES", "0", r"MULTIDC_NUM_SITES=0 must be a positive integer"),
    ],
)
def test_bad_env_value_fails_at_trainer_construction_naming_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", devices=4, strategy="hierarchical_ddp", logger=False)


def test_explicit_arguments_win_over_env(monkeypatch):
    monkeypatch.setenv("MULTIDC_NUM_SITES", "3")
    monkeypatch.setenv("MULTIDC_WAN_COMPRESSION", "zstd")
    strategy = HierarchicalDDPStrategy(num_sites=2, wan=WanConfig(compression="bf16"))
    assert strategy.num_sites == 2 and strategy.wan.compression == "bf16"


def test_comm_hook_arguments_are_rejected_with_the_alternative():
    with pytest.raises(ValueError, match=r"installs its own DDP comm hook.*ddp_comm_hook.*compression"):
        HierarchicalDDPStrategy(ddp_comm_hook=lambda state, bucket: None)
