"""``DiLoCoStrategy`` through a real Lightning ``Trainer`` (tests/strategies/_diloco_script.py, 4 gloo ranks as 2
sites x 2): the result equals tests/diloco_reference.py's single-process computation (streaming fragments,
overlap, gradient accumulation; and, on 2 sites x 1, the top-k codec with error feedback applied by hand), the WAN
metrics reach the logger, and a resume from a checkpoint saved with a sync in flight ends bitwise where the
unbroken run ends."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys

import pytest
import torch

from tests import _launch
from tests._resources import require_module
from tests._topk_by_hand import TopKByHand

require_module("lightning", "lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins import TorchCheckpointIO  # noqa: E402

import tests.strategies._diloco_script as script  # noqa: E402
from multidc.hierarchical import DiLoCoConfig  # noqa: E402
from multidc.hierarchical.tools.processes import ProcessTree  # noqa: E402
from multidc.strategies import DiLoCoStrategy  # noqa: E402
from tests.diloco_reference import LR, run_reference  # noqa: E402
from tests.diloco_reference import model as _model  # noqa: E402
from tests.diloco_reference import rows as _rows  # noqa: E402

pytestmark = pytest.mark.timeout(400)
CONFIG = {"sync_every": 4, "fragments": 2, "overlap_steps": 1}
STEPS, ACCUMULATE, PER_EPOCH = 11, 2, 6  # a sync starts at step 6 and merges at 7: in flight at the save
TOPK_CONFIG, TOPK_STEPS = {"sync_every": 4, "compression": "topk"}, 8  # the second sync adds the first's residual
TIME_CONFIG, TIME_STEPS = {"sync_every": 4, "sync_every_s": 0.25}, 60  # rounds by time, site 1 slowed
_LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def _start(out_dir, root, *extra: str, config: dict = CONFIG, steps: int = STEPS,
           accumulate: int = ACCUMULATE) -> ProcessTree:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_") and k not in _LAUNCH}
    argv = [sys.executable, script.__file__, "--config", json.dumps(config), "--max-steps", str(steps),
            "--accumulate", str(accumulate), "--steps-per-epoch", str(PER_EPOCH), "--root", str(root),
            "--out", str(out_dir), *extra]
    return ProcessTree(argv, env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def _result(out_dir, tree: ProcessTree, world: int = 4) -> dict:
    code, log = _launch.finish(tree, 300)
    assert code == 0, log
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    weights = [torch.load(out_dir / f"weights_rank{r}.pt") for r in range(world)]
    with open(out_dir / "log" / "version_0" / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    return {"ranks": ranks, "weights": weights, "metrics": metrics, "log": log}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The unbroken run and examples/lightning_diloco.py at once (each launch's first process imports Lightning alone
    before it starts the others, which leaves a core idle), then the run resumed from the unbroken run's checkpoint;
    ``{"unbroken": run, "resumed": run, "example": (exit code, output)}``."""
    tmp = tmp_path_factory.mktemp("diloco")
    example = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "lightning_diloco.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIDC_") and k not in _LAUNCH}
    with contextlib.ExitStack() as stack:  # a failed or interrupted wait still kills both
        unbroken = stack.enter_context(_start(tmp / "unbroken", tmp / "root"))
        example_run = stack.enter_context(ProcessTree(
            [sys.executable, example, "--max-steps", "20", "--sync-every", "10", "--out", str(tmp / "example")],
            env={**env, "OMP_NUM_THREADS": "1"}))
        runs = {"example": _launch.finish(example_run, 300), "unbroken": _result(tmp / "unbroken", unbroken)}
    saved = tmp / "root" / "ckpts" / f"epoch=0-step={PER_EPOCH}.ckpt"
    with _start(tmp / "resumed", tmp / "root2", "--ckpt-path", str(saved)) as resumed:
        runs["resumed"] = _result(tmp / "resumed", resumed)
    return runs


@pytest.fixture(scope="module")
def runs(launches):
    return launches["unbroken"], launches["resumed"]


@pytest.fixture(scope="module")
def topk_run(tmp_path_factory):
    """2 sites x 1 rank, plain DiLoCo with the top-k codec: ``TOPK_STEPS`` optimizer steps, a sync every 4."""
    tmp = tmp_path_factory.mktemp("diloco-topk")
    with _start(tmp / "out", tmp / "root", "--devices", "2", config=TOPK_CONFIG, steps=TOPK_STEPS,
                accumulate=1) as tree:
        return _result(tmp / "out", tree, world=2)


@pytest.fixture(scope="module")
def time_rounds_run(tmp_path_factory):
    """2 sites x 1 rank, rounds by time, site 1 slowed (50 ms a step): ``TIME_STEPS`` optimizer steps at most."""
    tmp = tmp_path_factory.mktemp("diloco-time")
    with _start(tmp / "out", tmp / "root", "--devices", "2", "--sleep-site1", "0.05", "--no-checkpoints",
                config=TIME_CONFIG, steps=TIME_STEPS, accumulate=1) as tree:
        return _result(tmp / "out", tree, world=2)


def test_trainer_with_time_rounds_and_a_slow_site_ends_on_both_sites_at_the_same_round(time_rounds_run):
    fast, slow = sorted(time_rounds_run["ranks"], key=lambda rank: rank["site"])
    assert fast["plans"] == slow["plans"] and len(fast["plans"]) >= 3, (fast["plans"], slow["plans"])
    # site 0 runs more steps per round; the last round is cut to site 0's end (1 step left: [1, 1] is a right plan)
    plans = fast["plans"]
    assert all(h0 > h1 for h0, h1 in plans[1:-1]) and plans[-1][0] >= plans[-1][1], plans
    # site 0 ends first, at max_steps exactly; site 1 at the same (last) round, earlier; both stopped by DiLoCo
    assert fast["global_step"] == TIME_STEPS > slow["global_step"] == slow["stats"]["inner_steps"]
    assert fast["diloco_should_stop"] and slow["diloco_should_stop"] and slow["should_stop"]
    assert fast["stats"]["outer_syncs"] == slow["stats"]["outer_syncs"] == len(fast["plans"])


def test_a_default_trainer_with_time_rounds_fails_at_setup_on_every_rank_naming_max_steps(tmp_path):
    with _start(tmp_path / "out", tmp_path / "root", "--devices", "2", "--default-trainer", config=TIME_CONFIG,
                accumulate=1) as tree:
        code, log = _launch.finish(tree, 300)
    assert code != 0
    assert log.count("training must end by Trainer(max_steps=N)") >= 2, log  # both ranks, before any collective


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


class _WithValidation(pl.LightningModule):
    def validation_step(self, batch, batch_idx):
        return None


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({}, r"Trainer\(max_steps=N\)"),
    ({"max_steps": 10, "max_epochs": 3}, r"end by max_steps"),
    ({"max_steps": 10, "max_time": "00:00:01:00"}, r"end by max_steps"),
    ({"max_steps": 10}, r"enable_checkpointing=False"),
    ({"max_steps": 10, "enable_checkpointing": False, "ckpt": "last"}, r"fit\(ckpt_path='last'\) is not supported"),
    ({"max_steps": 10, "enable_checkpointing": False, "validation": True}, r"limit_val_batches=0"),
    ({"max_steps": 10, "enable_checkpointing": False, "min_steps": 5}, r"leave min_steps unset"),
    ({"max_steps": 10, "enable_checkpointing": False, "early": True}, r"remove the EarlyStopping"),
])
def test_trainer_settings_that_hang_under_time_rounds_are_refused_naming_the_fix(kwargs, fix):
    from multidc.strategies.diloco import refuse_time_round_hazards

    kwargs = dict(kwargs)
    ckpt, validation = kwargs.pop("ckpt", None), kwargs.pop("validation", False)
    if kwargs.pop("early", False):
        from lightning.pytorch.callbacks import EarlyStopping

        kwargs["callbacks"] = [EarlyStopping(monitor="loss")]
    trainer = _trainer(**kwargs)
    trainer.fit_loop.max_epochs = -1 if trainer.max_epochs is None else trainer.max_epochs  # as fit() parses it
    trainer._checkpoint_connector._ckpt_path = ckpt
    if validation:
        trainer.strategy.connect(_WithValidation())
    with pytest.raises(ValueError, match=fix) as info:
        refuse_time_round_hazards(trainer)
    assert "sync_every_s" in str(info.value)
    ok = _trainer(max_steps=10, enable_checkpointing=False, limit_val_batches=0)
    ok.fit_loop.max_epochs = -1
    ok.strategy.connect(_WithValidation())
    refuse_time_round_hazards(ok)


def _site_batch(site: int, step: int):
    """What the 2 ranks of ``site`` feed optimizer step ``step`` together (both micro-batches)."""
    first = ((step - 1) % PER_EPOCH) * ACCUMULATE + 1
    rows = [_rows(site, local, k) for local in (0, 1) for k in range(first, first + ACCUMULATE)]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def test_trainer_equals_the_single_process_reference_with_fragments_overlap_and_accumulation(runs):
    unbroken, _ = runs
    ref = run_reference(_model(), sites=2, steps=STEPS, batch=_site_batch, loss_fn=torch.nn.functional.mse_loss,
                        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), **CONFIG)
    for rank, weights in zip(unbroken["ranks"], unbroken["weights"]):
        assert rank["global_step"] == STEPS and rank["stats"]["inner_steps"] == STEPS  # one per optimizer step
        for name, value in weights["local"].items():
            torch.testing.assert_close(value, ref["local"][rank["site"]][name], rtol=0, atol=1e-6)
        for name, value in weights["global"].items():
            torch.testing.assert_close(value, ref["global"][name], rtol=0, atol=1e-6)


def _one_rank_batch(site: int, step: int):
    """What the one rank of ``site`` feeds optimizer step ``step`` (no accumulation)."""
    return _rows(site, 0, (step - 1) % PER_EPOCH + 1)


def test_trainer_with_topk_and_error_feedback_equals_the_codec_applied_by_hand(topk_run):
    config = {k: v for k, v in TOPK_CONFIG.items() if k != "compression"}
    by_hand = TopKByHand(TOPK_CONFIG["compression"], site_size=1)
    ref = run_reference(_model(), sites=2, steps=TOPK_STEPS, batch=_one_rank_batch,
                        loss_fn=torch.nn.functional.mse_loss, compress=by_hand, keep_in_flight=True,
                        inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR), **config)
    for rank, weights in zip(topk_run["ranks"], topk_run["weights"]):
        assert rank["global_step"] == TOPK_STEPS and rank["stats"]["outer_syncs"] == 2
        for name, value in weights["local"].items():
            torch.testing.assert_close(value, ref["local"][rank["site"]][name], rtol=0, atol=1e-6)
        for name, value in weights["global"].items():
            torch.testing.assert_close(value, ref["global"][name], rtol=0, atol=1e-6)
    # without error feedback the second sync ends elsewhere: the comparison above sees the residuals
    without = run_reference(_model(), sites=2, steps=TOPK_STEPS, batch=_one_rank_batch,
                            loss_fn=torch.nn.functional.mse_loss,
                            compress=TopKByHand(TOPK_CONFIG["compression"], site_size=1, feedback=False),
                            keep_in_flight=True, inner_optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                            **config)
    assert max((without["global"][n] - ref["global"][n]).abs().max() for n in ref["global"]) > 1e-4


def test_wan_metrics_reach_the_logger_on_merge_steps_only(runs):
    unbroken, _ = runs
    rows = [r for r in unbroken["metrics"] if r.get("wan/outer_syncs")]
    assert len(rows) == STEPS  # one row per optimizer step
    merged = [r["step"] for r in rows if float(r["wan/outer_syncs"]) > 0]
    sent = [r["step"] for r in rows if float(r["wan/bytes_sent"]) > 0]
    assert len(merged) == 5 and sent == merged  # syncs start at 2, 4, 6, 8, 10 and merge one step later
    assert all(float(r["wan/exposed_s"]) >= 0 for r in rows)


def test_diloco_start_sends_no_parameters_over_the_wan_when_sites_start_equal(runs):
    for run in runs:  # DDP's start-up broadcast made the sites equal; DiLoCo's start compares digests only
        assert [rank["start_bytes"] for rank in run["ranks"]] == [0, 0, 0, 0]


def test_resume_from_a_checkpoint_with_a_sync_in_flight_ends_like_the_unbroken_run(runs):
    unbroken, resumed = runs
    for a, b, ra, rb in zip(unbroken["weights"], resumed["weights"], unbroken["ranks"], resumed["ranks"]):
        assert ra["site"] == rb["site"] and rb["global_step"] == STEPS
        for kind in ("local", "global"):
            for name in a[kind]:
                assert torch.equal(a[kind][name], b[kind][name]), (kind, name)


def test_strategy_name_without_sync_every_fails_at_trainer_construction(monkeypatch):
    monkeypatch.delenv("MULTIDC_DILOCO_SYNC_EVERY", raising=False)
    with pytest.raises(ValueError, match="MULTIDC_DILOCO_SYNC_EVERY"):
        pl.Trainer(strategy="diloco", accelerator="cpu", devices=1, logger=False)
    monkeypatch.setenv("MULTIDC_DILOCO_SYNC_EVERY", "0")
    with pytest.raises(ValueError, match="sync_every"):
        pl.Trainer(strategy="diloco", accelerator="cpu", devices=1, logger=False)


def test_a_single_file_checkpoint_io_is_refused_with_the_reason():
    strategy = DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=4))
    with pytest.raises(ValueError, match="every site's own model and the DiLoCo state"):
        pl.Trainer(strategy=strategy, plugins=[TorchCheckpointIO()], accelerator="cpu", devices=1, logger=False)


def test_the_example_trains_across_two_sites_and_reports_both_validation_losses(launches):
    code, log = launches["example"]
    assert code == 0, log
    # sync_every 10, 2 fragments, 2 overlap steps: syncs start at 5, 10, 15, 20 and merge 2 steps later
    assert "done: 4 ranks in 2 sites [2, 2]" in log and "step   20" in log
    assert "MiB sent in 3 fragment syncs" in log and "global parameters" in log


def test_each_site_keeps_its_buffers_and_elastic_mode_needs_a_lighthouse(monkeypatch):
    assert DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=4))._ddp_kwargs["broadcast_buffers"] is False
    monkeypatch.delenv("MULTIDC_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="set MULTIDC_LIGHTHOUSE=host:port"):
        DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=4), elastic=True)
    monkeypatch.setenv("MULTIDC_ELASTIC", "1")
    with pytest.raises(ValueError, match="set MULTIDC_LIGHTHOUSE=host:port"):
        DiLoCoStrategy(diloco=DiLoCoConfig(sync_every=4))
