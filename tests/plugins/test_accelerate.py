"""MultiDCAccelerator under a real ``accelerate launch``: parity with a plain ``Accelerator``, sites from
``MULTIDC_NUM_SITES`` or per machine from ``MULTIDC_SITE``, no WAN traffic on accumulation steps, clear errors.

Launch form: ``accelerate launch --config_file examples/accelerate_config.yaml`` (4 local processes through
torchrun, gloo on the CPU). In Accelerate 1.15 ``--cpu --num_processes 4`` starts one process (its CPU launcher
needs ``mpirun``), so the config selects the torchrun launcher; the plain-``Accelerator`` reference run needs
``ACCELERATE_USE_CPU=1``, MultiDCAccelerator picks the CPU itself. Each rank checks that Accelerate really ran 4
processes together (a silent one-process run cannot pass).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests._resources import require_module

require_module("accelerate", "accelerate")

from multidc.hierarchical import WanConfig  # noqa: E402
from multidc.hierarchical.tools.launch import free_port  # noqa: E402
from multidc.hierarchical.tools.processes import ProcessTree  # noqa: E402
from tests._launch import LAUNCH_TIMEOUT_S, ROOT, finish, launch  # noqa: E402

pytestmark = pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S + 120)
SCRIPT = os.path.join(ROOT, "tests", "plugins", "_accelerate_script.py")
EXIT_SCRIPT = os.path.join(ROOT, "tests", "plugins", "_exit_script.py")
EXAMPLE = os.path.join(ROOT, "examples", "accelerate_hierarchical.py")


def read_run(out_dir) -> dict:
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]
    return {"ranks": ranks, "weights": torch.load(out_dir / "weights.pt")}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every training launch of this file, two at a time (8 ranks on 2 cores), each batch awaited before the next:

    plain Accelerator with MultiDCAccelerator and MULTIDC_NUM_SITES=2; the example with MULTIDC_NUM_SITES=3 (must
    fail); MultiDCAccelerator as two machines of 2 processes, each naming its site with MULTIDC_SITE.
    Returns ``{name: (exit code, output, out dir)}``.
    """
    tmp = tmp_path_factory.mktemp("accelerate")
    dirs = {name: tmp / name for name in ("plain", "sites_env", "site_per_machine", "example", "bad_sites")}
    for d in dirs.values():
        d.mkdir()
    wan = {"MULTIDC_WAN_CHUNK_MB": "0.0005", "MULTIDC_WAN_STREAMS": "3"}
    port = free_port()

    def machine(index: int, site: str) -> ProcessTree:
        machine_args = ["--num_machines", "2", "--machine_rank", str(index), "--main_process_ip", "127.0.0.1",
                        "--main_process_port", str(port)]
        return launch([*machine_args, SCRIPT, "--out", str(dirs["site_per_machine"])], {"MULTIDC_SITE": site, **wan},
                      tmp)

    batches = [
        {"plain": lambda: launch([SCRIPT, "--out", str(dirs["plain"]), "--plain"], {"ACCELERATE_USE_CPU": "1"}, tmp),
         "sites_env": lambda: launch([SCRIPT, "--out", str(dirs["sites_env"])], {"MULTIDC_NUM_SITES": "2", **wan},
                                     tmp)},
        {"example": lambda: launch([EXAMPLE, "--steps", "15"], {}, tmp),
         # monitor interval 2 s: torchrun lets every failing rank report before it stops the rest
         "bad_sites": lambda: launch(["--monitor_interval", "2", SCRIPT, "--out", str(dirs["bad_sites"])],
                                     {"MULTIDC_NUM_SITES": "3"}, tmp)},
        {"machine0": lambda: machine(0, "us-east"), "machine1": lambda: machine(1, "eu-west")},
    ]
    outputs = {}
    for batch in batches:
        with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills every tree of the batch
            trees = {name: stack.enter_context(start()) for name, start in batch.items()}
            outputs.update({name: finish(tree, LAUNCH_TIMEOUT_S) for name, tree in trees.items()})
    outputs["site_per_machine"] = outputs.pop("machine0")
    code, out = outputs.pop("machine1")
    assert code == 0, f"machine 1 failed:\n{out[-6000:]}"
    return {name: (code, out, dirs[name]) for name, (code, out) in outputs.items()}


@pytest.fixture(scope="module")
def runs(launches):
    """The training runs compared below: ``{name: {"ranks": [per-rank report], "weights": rank 0's weights}}``."""
    for name in ("plain", "sites_env", "site_per_machine"):
        code, out, _ = launches[name]
        assert code == 0, f"{name} failed:\n{out[-6000:]}"
    return {name: read_run(launches[name][2]) for name in ("plain", "sites_env", "site_per_machine")}


def test_accelerate_launch_config_starts_four_gloo_processes_for_both_accelerators(runs):
    for run in runs.values():
        assert [(r["distributed_type"], r["num_processes"]) for r in run["ranks"]] == \
            [("DistributedType.MULTI_CPU", 4)] * 4


@pytest.mark.parametrize("name", ["sites_env", "site_per_machine"])
def test_multidc_accelerator_trains_to_the_same_weights_as_plain_accelerate(runs, name):
    plain, ours = runs["plain"], runs[name]
    assert ours["weights"].keys() == plain["weights"].keys()
    for key, value in plain["weights"].items():
        torch.testing.assert_close(ours["weights"][key], value, rtol=0, atol=1e-6, msg=key)
    moved = max((v - runs["plain"]["weights"][k]).abs().max() for k, v in _initial_weights().items())
    assert moved > 1e-3, "training must change the weights, or parity proves nothing"
    torch.testing.assert_close(torch.tensor(ours["ranks"][0]["losses"]), torch.tensor(plain["ranks"][0]["losses"]),
                               rtol=0, atol=1e-6)


def _initial_weights() -> dict:
    from accelerate.utils import set_seed

    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_sites_come_from_num_sites_or_from_each_machines_site_name(runs):
    assert [(r["site"], r["num_sites"]) for r in runs["sites_env"]["ranks"]] == [("0", 2)] * 2 + [("1", 2)] * 2
    assert [(r["site"], r["num_sites"]) for r in runs["site_per_machine"]["ranks"]] == \
        [("us-east", 2)] * 2 + [("eu-west", 2)] * 2


@pytest.mark.parametrize("name", ["sites_env", "site_per_machine"])
def test_accumulation_and_no_sync_steps_send_nothing_over_the_wan(runs, name):
    for rank in runs[name]["ranks"]:
        previous = 0
        for micro in rank["micro"]:
            grew = micro["bytes_sent"] - previous
            assert (grew > 0) if micro["sync"] else (grew == 0), rank["micro"]
            previous = micro["bytes_sent"]
        assert [m["sync"] for m in rank["micro"]] == [False, True] * 3
        assert rank["no_sync_bytes"] == 0


def test_wan_metrics_report_each_optimizer_steps_bytes(runs):
    # One fp32 bucket of 8*64 + 64 + 64 + 1 gradients; a rank of a 2-rank site holds half after the intra-site
    # reduce-scatter, and an all-reduce over 2 sites sends 2 * (2-1)/2 = 1 times that share (+ chunk padding).
    share = (8 * 64 + 64 + 64 + 1) * 4 / 2
    for rank in runs["sites_env"]["ranks"]:
        sync_bytes = [m["bytes_sent"] for m in rank["micro"] if m["sync"]]
        per_step = [b - a for a, b in zip([0, *sync_bytes], sync_bytes)]
        assert [m["wan/bytes_sent"] for m in rank["metrics"]] == per_step
        assert all(share <= b <= share + 64 for b in per_step), per_step
        assert all(m["wan/comm_s"] > 0 and m["wan/MBps"] > 0 for m in rank["metrics"])


def test_example_prints_falling_loss_and_wan_metrics(launches):
    code, out, _ = launches["example"]
    assert code == 0, out[-6000:]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    losses = [float(line.split("loss")[1].split()[0]) for line in lines]
    assert len(losses) == 4 and losses[-1] < 0.5 * losses[0], lines
    assert all("kB sent" in line and "MB/s" in line for line in lines)
    assert "site_sizes=[2, 2]" in out


def test_ranks_exit_together_when_their_group_still_holds_work_at_end_training(tmp_path):
    """tests/plugins/_exit_script.py: rank 1 joins the last all-gather 3 s late, so rank 0's gloo worker still holds
    it when ``end_training`` destroys the group. Before ``end_training`` freed the DDP reducers first, rank 0 hung
    at exit forever: ~Reducer -> ~ProcessGroupGloo joined the worker under the GIL while the worker waited for the
    GIL in ~AsyncAllgatherWork. Both ranks must leave ``main`` and exit 0, and no process of the launch remain."""
    tree = launch(["--num_processes", "2", EXIT_SCRIPT], {}, tmp_path)
    code, out = finish(tree, timeout=LAUNCH_TIMEOUT_S)
    assert code == 0, out[-6000:]
    assert sorted(re.findall(r"exited (\d)", out)) == ["0", "1"], out[-6000:]  # the ranks' lines may interleave
    assert tree.survivors == [], "processes of the launch outlived it"


def test_bad_num_sites_fails_every_rank_of_the_launch_before_training(launches):
    """MULTIDC_NUM_SITES=3 with 4 processes: every rank raises the same ValueError while constructing the
    accelerator, before training."""
    code, out, out_dir = launches["bad_sites"]
    assert code != 0
    message = r"^\[rank(\d)\]: ValueError: 4 ranks cannot be split into num_sites=3 equal contiguous sites"
    assert {int(m) for m in re.findall(message, out, flags=re.MULTILINE)} == {0, 1, 2, 3}, out[-6000:]
    assert not list(out_dir.glob("rank*.json")), "no rank may start training"


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_sites=0), "must be a positive integer"),
    (dict(num_sites=True), "must be a positive integer"),
    (dict(site=1.5), "must be an int index or a name"),
    (dict(wan={"compression": "bf16"}), "must be a multidc.hierarchical.WanConfig"),
    (dict(checkpoint_replicas=-1), r"checkpoint_replicas=-1 must be an int >= 0"),
])
def test_plugin_rejects_bad_arguments(kwargs, message):
    from multidc.plugins import MultiDCPlugin

    with pytest.raises(ValueError, match=message):
        MultiDCPlugin(**kwargs)


def test_plugin_reads_env_fallbacks(monkeypatch):
    from multidc.plugins import MultiDCPlugin

    monkeypatch.setenv("MULTIDC_NUM_SITES", "2")
    monkeypatch.setenv("MULTIDC_WAN_COMPRESSION", "int8")
    plugin = MultiDCPlugin()
    assert plugin.num_sites == 2 and plugin.wan.compression == "int8"
    assert MultiDCPlugin(num_sites=4, wan=WanConfig(compression="bf16")).num_sites == 4
    monkeypatch.setenv("MULTIDC_WAN_COMPRESSION", "bogus")  # read by every rank alike, before Accelerate starts
    with pytest.raises(ValueError, match="MULTIDC_WAN_COMPRESSION='bogus'.*not supported"):
        MultiDCPlugin()
    monkeypatch.setenv("MULTIDC_NUM_SITES", "two")
    with pytest.raises(ValueError, match="MULTIDC_NUM_SITES='two' is not an integer"):
        MultiDCPlugin()


def test_multidc_plugins_imports_without_accelerate_and_says_what_to_install():
    code = (
        "import sys; sys.modules['accelerate'] = None\n"
        "import multidc.plugins as p\n"
        "assert 'MultiDCAccelerator' in p.__all__ and p.Checkpointer\n"
        "try:\n    p.MultiDCAccelerator\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "pip install 'multidc[accelerate]'" in out.stdout
