"""The Lightning callback that puts a multidc strategy's WAN figures into the user's logger and progress bar.

Added by the strategies' ``setup`` (``add_to``) and removed at ``teardown``; users do not construct it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

# Rates and waits read well in a progress bar; byte counts and ``wan/comm_s`` go to the logger only.
_PROGRESS_BAR = ("wan/MBps", "wan/wait_s")


class WanMetricsCallback(Callback):
    """Logs ``strategy.wan_metrics()`` with ``LightningModule.log`` once per optimizer step.

    Values are this rank's (no cross-rank reduction, so logging costs no collective). Steps accumulated under
    ``no_sync`` are folded into the optimizer step that follows them, so ``wan/bytes_sent`` is per optimizer
    step, as Lightning's step-level logging is. The strategy has ``gradient_sync`` (a ``CrossSite``) and
    ``topology``.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._step: int | None = None

    @classmethod
    def add_to(cls, trainer: pl.Trainer, strategy: Any) -> None:
        """Add one, when fitting with a topology (or an elastic sync), first: its ``on_after_backward`` then runs
        right after backward returns (see ``wan/wait_s`` in ``WanStepMeter``)."""
        crosses = strategy.topology is not None or strategy.gradient_sync.drives_steps
        if trainer.state.fn != TrainerFn.FITTING or not crosses:
            return
        if not any(isinstance(c, cls) for c in trainer.callbacks):
            trainer.callbacks.insert(0, cls(strategy))

    @classmethod
    def remove_from(cls, module: pl.LightningModule | None) -> None:
        """Remove it from the Trainer of ``module`` (strategy teardown: the next fit adds it afresh)."""
        trainer = module.trainer if module is not None else None
        if trainer is not None:
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, cls)]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step
        self._strategy.wan_metrics()  # drop traffic from before training (none today; keeps steps honest)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.gradient_sync.backward_done()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step:  # an accumulation micro-batch: no optimizer step yet
            return
        self._step = trainer.global_step
        for key, value in self._strategy.wan_metrics().items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key in _PROGRESS_BAR, batch_size=1)
