"""HierarchicalDDPStrategy end to end: Trainer runs with 4 CPU ranks in subprocesses, registry, env config, errors.

The Trainer runs use _lightning_script.py, an ordinary script whose only multidc lines are the import and
the strategy name; the strategy launches its own ranks, as for a user running ``python train.py``.
"""

from __future__ import annotations

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
from multidc.strategies import HierarchicalDDPFabricStrategy, HierarchicalDDPStrategy  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "_lightning_script.py")
# Variables a launcher or the caller's shell may have set; each run must start clean.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def run_script(args: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str]:
    """Run the training script; afterwards (also on timeout) kill every rank it launched."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_") and k not in _LAUNCH_VARS}
    return _launch.run_script([sys.executable, SCRIPT, *args],
                              {**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}, timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One `ddp` and one `hierarchical_ddp` run: 4 ranks, 2 sites from env, accumulation 2, 3 optimizer steps."""
    results = {}
    for strategy, env in (
        ("ddp", {}),
        ("hierarchical_ddp", {"MULTIDC_NUM_SITES": "2", "MULTIDC_WAN_CHUNK_MB": "0.0005", "MULTIDC_WAN_STREAMS": "3"}),
    ):
        out_dir = tmp_path_factory.mktemp(strategy)
        code, log = run_script(["--strategy", strategy, "--out", str(out_dir), "--accumulate", "2"], env)
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


def test_fabric_hierarchical_ddp_matches_single_process_reference(tmp_path):
    code, log = run_script(
        ["--fabric", "--strategy", "hierarchical_ddp", "--devices", "2", "--out", str(tmp_path)],
        {"MULTIDC_NUM_SITES": "2"},
    )
    assert code == 0, log[-6000:]
    weights = torch.load(tmp_path / "weights.pt")
    for name, reference in weights["reference"].items():
        assert not torch.allclose(reference, weights["initial"][name]), f"{name} did not train"
        torch.testing.assert_close(weights["final"][name], reference, rtol=1e-5, atol=1e-6, msg=name)
    with open(tmp_path / "run.json") as f:
        report = json.load(f)
    assert report["strategy_class"] == "HierarchicalDDPFabricStrategy"
    assert all(m["wan/bytes_sent"] > 0 for m in report["wan_metrics"])


@pytest.mark.parametrize(("name", "start_method"), [("hierarchical_ddp", "popen"), ("hierarchical_ddp_spawn", "spawn")])
def test_names_are_registered_with_trainer_and_fabric_registries(name, start_method):
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is HierarchicalDDPStrategy and strategy._start_method == start_method
    fabric_strategy = FABRIC_REGISTRY.get(name)
    assert type(fabric_strategy) is HierarchicalDDPFabricStrategy and fabric_strategy._start_method == start_method


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_twice_and_reloading_keeps_one_working_registration():
    result = _python(
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
    )
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


@pytest.mark.parametrize("name", ["HierarchicalDDPStrategy", "Parallel3DStrategy", "DiLoCoStrategy"])
def test_package_imports_without_lightning_and_the_strategy_says_what_to_install(name):
    result = _python(
        "import sys; sys.modules['lightning'] = None\n"
        "import multidc.strategies\n"
        "try:\n"
        f"    multidc.strategies.{name}\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
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
