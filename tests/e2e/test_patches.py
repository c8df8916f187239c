"""Every private framework API multidc patches or reads, as its ``_patches`` module names it: each test fails when
the attribute disappears or changes its signature (then re-check the patch against the new version and update the
module's ``CHECKED_AGAINST``). And importing multidc patches nothing."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from tests._resources import require_module


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_torch_fsdp2_still_resolves_its_mesh_with_get_mesh_info():
    from multidc.hierarchical.parallel._patches import fsdp_mesh_info

    assert fsdp_mesh_info() is not None, "torch's FSDP2 has no _fully_shard._get_mesh_info any more"
    assert _parameters(fsdp_mesh_info()) == ["mesh", "dp_mesh_dims"]


def test_torchft_managers_quorum_client_and_answer_are_what_multidc_wraps_and_reads():
    require_module("torchft", "elastic")
    from torchft._torchft import ManagerClient, QuorumResult
    from torchft.manager import Manager

    assert "self._client = ManagerClient(" in inspect.getsource(Manager.__init__)
    assert _parameters(ManagerClient._quorum) == ["self", "group_rank", "step", "checkpoint_metadata", "shrink_only",
                                                  "init_sync", "commit_failures", "timeout"]
    for field in ("quorum_id", "replica_ids", "replica_rank", "max_step", "max_replica_rank", "max_world_size",
                  "heal"):
        assert hasattr(QuorumResult, field), field


def test_lightnings_last_checkpoint_lookup_loop_and_step_counter_are_where_multidc_patches_them():
    require_module("lightning", "lightning")
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    find = ModelCheckpoint._find_last_checkpoints
    assert _parameters(getattr(find, "__multidc_original__", find)) == ["self", "trainer"]
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    def original(function):
        return getattr(function, "__multidc_original__", function)

    # install_regional_checkpoints
    assert _parameters(original(_CheckpointConnector._parse_ckpt_path)) == [
        "self", "state_fn", "ckpt_path", "model_provided", "model_connected"]
    assert "get_filesystem(path)" in inspect.getsource(original(_CheckpointConnector._parse_ckpt_path))
    assert _parameters(original(_CheckpointConnector.resume_start)) == ["self", "checkpoint_path", "weights_only"]
    assert _parameters(original(ModelCheckpoint.file_exists)) == ["self", "filepath", "trainer"]
    assert _parameters(original(ModelCheckpoint._ModelCheckpoint__warn_if_dir_not_empty)) == ["self", "dirpath"]
    assert _parameters(original(ModelCheckpoint._ModelCheckpoint__init_ckpt_dir)) == ["self", "dirpath", "filename"]
    setup = inspect.getsource(original(ModelCheckpoint.setup))  # what the patch skips for a mapping's text
    assert "trainer.strategy.broadcast(dirpath)" in setup and "get_filesystem(self.dirpath" in setup
    assert _parameters(ModelCheckpoint._ModelCheckpoint__resolve_ckpt_dir) == ["self", "trainer"]
    assert _parameters(_TrainingEpochLoop.update_lr_schedulers) == ["self", "interval", "update_plateau_schedulers"]
    assert _parameters(_TrainingEpochLoop._broadcast_sigterm_tensor) == ["self"]  # site_sigterm_broadcast
    total = Trainer(logger=False).fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    assert {"ready", "completed"} <= set(vars(total))


def test_accelerates_skipped_step_flag_is_what_multidc_sets():
    require_module("accelerate", "accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    assert "self._is_overflow" in inspect.getsource(AcceleratedOptimizer.__init__)
    assert "return self._is_overflow" in inspect.getsource(AcceleratedOptimizer.step_was_skipped.fget)


@pytest.mark.parametrize("modules", ["multidc.strategies", "multidc.plugins.lightning_checkpoint_io"])
def test_importing_multidc_patches_nothing_in_lightning(tmp_path, modules):
    require_module("lightning", "lightning")
    code = ("from lightning.pytorch.callbacks import ModelCheckpoint\n"
            "before = ModelCheckpoint._find_last_checkpoints\n"
            f"import {modules}\n"
            "print(ModelCheckpoint._find_last_checkpoints is before)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.strip() == "True", done.stderr[-3000:]


@pytest.mark.parametrize("build", ["HierarchicalDDPStrategy()", "ObjectStoreCheckpointIO()"])
def test_an_unpickled_strategy_or_checkpoint_io_installs_the_last_checkpoint_lookup(tmp_path, build):
    # spawn launchers unpickle the strategy (and its CheckpointIO) in each rank, where fit(ckpt_path="last") resolves
    require_module("lightning", "lightning")
    import pickle

    from multidc.plugins.lightning_checkpoint_io import ObjectStoreCheckpointIO  # noqa: F401  (for build)
    from multidc.strategies import HierarchicalDDPStrategy  # noqa: F401  (for build)

    (tmp_path / "pickled").write_bytes(pickle.dumps(eval(build)))
    code = ("import pickle\n"
            "from lightning.pytorch.callbacks import ModelCheckpoint\n"
            "pickle.loads(open('pickled', 'rb').read())\n"
            "print(hasattr(ModelCheckpoint._find_last_checkpoints, '__multidc_original__'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.strip() == "True", done.stderr[-3000:]


def test_a_mapping_dirpath_with_save_last_link_is_refused_as_lightning_refuses_remote_paths(monkeypatch):
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from multidc.plugins._lightning_patches import install_regional_checkpoints

    for owner, name in ((_CheckpointConnector, "_parse_ckpt_path"), (_CheckpointConnector, "resume_start"),
                        (ModelCheckpoint, "file_exists"), (ModelCheckpoint, "setup"),
                        (ModelCheckpoint, "_ModelCheckpoint__warn_if_dir_not_empty"),
                        (ModelCheckpoint, "_ModelCheckpoint__init_ckpt_dir")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test: the patches are global
    install_regional_checkpoints(lambda trainer: None)
    callback = ModelCheckpoint(dirpath={"a": "s3://ckpt-a/run", "b": "s3://ckpt-b/run"}, save_last="link")
    trainer = SimpleNamespace(strategy=SimpleNamespace(broadcast=lambda value: value))
    with pytest.raises(ValueError, match="save_last='link'.*mapping of regional paths"):
        callback.setup(trainer, None, "fit")
