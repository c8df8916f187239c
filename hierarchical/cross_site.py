"""``CrossSite``: what crosses the WAN for one training job, and the fixed points of a training loop that drive it.

Each way of crossing the WAN implements it once: per-step hierarchical all-reduce and DiLoCo
(``multidc.hierarchical._gradient_sync.GradientSync``, whose DDP / FSDP2 hooks and DiLoCo optimizer hook do the work
inside backward and the optimizer step), and the elastic variants of both (``multidc.hierarchical.elastic.steps
.ElasticSteps``: a torchft quorum, average and commit vote per step; ``ElasticDiLoCo``: a quorum per outer round).
A front-end (the Lightning strategies, Fabric, ``MultiDCAccelerator``, a raw loop) calls the same points whatever
the way, and holds no branch per algorithm::

    sync.before_step()           # before the forward: an elastic site joins the step's quorum (and heals there)
    loss.backward()
    sync.after_backward(model)   # gradients ready: elastic per-step sites average them over the sites present
    if sync.commit():            # elastic per-step sites: the site's ranks vote on the step; else always True
        optimizer.step()         # DiLoCo steps in the optimizer's step post-hook
    scheduler.step()             # only if committed
    sync.after_step()            # after what steps with the optimizer: elastic DiLoCo's next round starts here
    sync.save_once(save)         # a checkpoint: written on one site of an elastic job, else here
    sync.metrics(); sync.job_step; sync.close()

Every point is collective over the ranks that train (a site's ranks, in an elastic job).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CrossSite:
    """The points a training loop calls; the defaults are those of a sync that does its work in hooks."""

    quorum_per_step = False
    """Whether ``before_step`` joins a quorum every step (a site may receive the live state there, so gradients
    accumulated before it would belong to another model: front-ends that call it after accumulating refuse
    gradient accumulation)."""

    def before_step(self) -> None:
        """Before the step's forward, and before its first micro-batch under gradient accumulation (a front-end
        that can only call it later refuses accumulation when ``quorum_per_step``). Calling it again before the
        step ends does nothing."""

    def after_backward(self, model: torch.nn.Module) -> None:
        """Right after the step's (last micro-batch's) backward returns; ``model``: what was attached or trained
        (the DDP wrapper, a layout's model)."""

    def commit(self) -> bool:
        """Whether the optimizer may apply this step: step it (and the LR schedulers) only if True."""
        return True

    def after_step(self) -> None:
        """After the optimizer step and whatever the loop steps with it (LR schedulers), before the next step."""

    def resume(self, step: int) -> None:
        """The front-end restored a checkpoint of the job's optimizer step ``step`` before the first step (per-step
        sites resume the job there; ``ElasticDiLoCo`` resumes from its own ``load_state_dict`` instead)."""

    @property
    def job_step(self) -> int | None:
        """The job's optimizer steps so far, which a (re)joining elastic site takes from the live ones; None: the
        front-end's own count."""
        return None

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this rank's site writes the job's checkpoints now (elastic: one site; else every rank takes its
        part)."""
        return True

    def save_once(self, save: Callable[[], object]) -> None:
        """Run ``save`` (collective over the ranks that write) where the job's checkpoint is to be written once."""
        save()

    def metrics(self) -> dict[str, float]:
        """The WAN figures since the previous call (``wan/*``); call once per optimizer step."""
        return {}

    def close(self) -> None:
        """When training ends: stop background work and leave the job (every rank)."""
