"""examples/accelerate_3d.py as its docstring tells users to run it: ``accelerate launch --config_file
examples/accelerate_config.yaml examples/accelerate_3d.py`` (4 gloo processes on the CPU), in both layouts it
shows (2 sites x pipeline 2, and ``--pp 1 --tp 2``: 2 sites x tensor parallel 2), 10 steps each.

The two launches run at once (8 ranks on 2 cores); each is checked by what the example prints: the layout it built,
a falling loss, gradients crossing the WAN every step. Same seed, same data: the two layouts must print the same
losses, a reference computed another way (pipeline stages against tensor-parallel shards).
"""

from __future__ import annotations

import contextlib
import math
import os
import re

import pytest

from tests._resources import require_module

require_module("accelerate", "accelerate")

from tests._launch import LAUNCH_TIMEOUT_S, ROOT, finish, launch  # noqa: E402

pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
EXAMPLE = os.path.join(ROOT, "examples", "accelerate_3d.py")
STEPS = 10  # the example prints steps 1 and 10
LAYOUTS = {
    "pp2": ([], "4 ranks = site 2 x pp 2 x dp_replicate 1 x dp_shard 1 x tp 1"),
    "tp2": (["--pp", "1", "--tp", "2"], "4 ranks = site 2 x pp 1 x dp_replicate 1 x dp_shard 1 x tp 2"),
}
STEP_LINE = re.compile(r"^step +(\d+) +loss +([\d.]+) +wan +([\d.]+) kB sent +([\d.]+) MB/s$", re.MULTILINE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{layout: (exit code, output, the ProcessTree)}``; every process of both launches is killed when its
    launcher ends, or when the wait fails."""
    tmp = tmp_path_factory.mktemp("accelerate_3d")
    with contextlib.ExitStack() as stack:
        trees = {name: stack.enter_context(launch([EXAMPLE, "--steps", str(STEPS), *args], {}, tmp))
                 for name, (args, _) in LAYOUTS.items()}
        return {name: (*finish(tree, LAUNCH_TIMEOUT_S), tree) for name, tree in trees.items()}


def steps(output: str) -> list[tuple[int, float, float]]:
    """``(step, loss, WAN kB sent)`` of each step line the example printed."""
    return [(int(step), float(loss), float(kb)) for step, loss, kb, _ in STEP_LINE.findall(output)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_example_builds_its_layout_and_trains_across_sites(runs, name):
    code, out, tree = runs[name]
    assert code == 0, out[-6000:]
    assert tree.survivors == [], "processes of the launch outlived it"
    assert LAYOUTS[name][1] in out, out[-6000:]
    printed = steps(out)
    assert [step for step, _, _ in printed] == [1, STEPS], out[-6000:]
    (_, first, _), (_, last, _) = printed
    assert abs(first - math.log(64)) < 0.5, "the loss starts near ln(vocab), as the example says"
    assert last < first - 0.5, f"the loss must fall: {printed}"
    assert all(kb > 0 for _, _, kb in printed), f"every step's gradients cross the WAN between the 2 sites: {printed}"
    assert "returned a view tensor" not in out, "the example silences exactly FSDP2's view-tensor warning"


def test_pipeline_and_tensor_parallel_layouts_print_the_same_losses(runs):
    losses = {name: [loss for _, loss, _ in steps(out)] for name, (_, out, _) in runs.items()}
    assert len(losses["pp2"]) == len(losses["tp2"]) == 2, losses
    assert losses["pp2"] == pytest.approx(losses["tp2"], abs=2e-3), losses  # printed with 3 decimals
