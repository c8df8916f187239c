"""``CrossSite``: what crosses the WAN for one training job, and the fixed points of a training loop that drive it.

Each way of crossing the WAN implements it once, and ``cross_site_sync`` picks one from the settings: per-step
hierarchical all-reduce (``multidc.hierarchical._gradient_sync.GradientSync``: the DDP / FSDP2 hooks do the work
inside backward), DiLoCo (``DiLoCoSync``: in the inner optimizer's step post-hook), and the elastic variant of either
(``multidc.hierarchical.elastic.steps.ElasticSync``: a torchft quorum, average and commit vote per step, or a quorum
per outer round). A front-end (the Lightning strategies, Fabric, ``MultiDCAccelerator``, a raw loop) calls the same
points whatever the way, and holds no branch per algorithm::

    sync.before_step()           # before the forward: an elastic site joins the step's quorum (and heals there)
    loss.backward()
    sync.after_backward(model)   # gradients ready: elastic per-step sites average them over the sites present
    if sync.commit():            # elastic per-step sites: the site's ranks vote on the step; else always True
        optimizer.step()         # DiLoCo steps in the optimizer's step post-hook
    scheduler.step()             # only if committed
    sync.after_step()            # after what steps with the optimizer: elastic DiLoCo's next round starts here
    sync.save_once(save)         # a checkpoint: written on one site of an elastic job, else here
    sync.metrics(); sync.job_step; sync.close()

Every point is collective over the ranks that train (a site's ranks, in an elastic job). Before the loop, a
front-end builds the sync with ``cross_site_sync`` when it is constructed, and sets it up where its framework sets
up the model::

    sync.build_topology(num_sites=, site=)   # once the process group exists (nothing for an elastic site)
    sync.placement                          # a parallel layout places its replicas by it (parallelize(cross_site=))
    sync.attach_ddp(ddp_model)              # every DDP model, before its first backward
    sync.place(parallel)                    # or: a parallel layout placed the model
    sync.attach([model], [optimizer], parallel=, carry=, scaler=)   # once the model and its optimizer exist
    sync.backward_done()                    # after every backward (micro-batches too): the WAN meter
    sync.checkpoint_sites()                 # what a checkpoint holds per site
    sync.drives_steps                       # whether the loop must call the points above (else hooks do the work)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch


class CrossSite:
    """The points a training loop calls; the defaults are those of a sync that does its work in hooks."""

    placement = "allreduce"
    """How a parallel layout or DDP reduces its replicas inside backward: ``"allreduce"`` (across the sites the
    topology holds: all of them, or the site alone in an elastic job) or ``"diloco"`` (inside each site only)."""

    drives_steps = False
    """Whether the front-end must call the step points (``before_step`` ... ``after_step``) around each optimizer
    step; False: hooks do the work and the framework's own optimizer step may run as it is."""

    sites_differ = False
    """Whether the sites' models differ between syncs (DiLoCo): a checkpoint holds each site's model
    (``checkpoint_sites``), which only multidc's checkpoint format can store."""

    diloco_config = None
    """The ``DiLoCoConfig`` under DiLoCo, else None."""

    diloco = None
    """The running ``DiLoCo`` under DiLoCo (after ``attach``), else None."""

    topology = None
    """The job's ``Topology`` once built or attached; None in an elastic job (its quorum decides each step's sites)."""

    hook_states: Sequence = ()
    """One ``HierarchicalHookState`` per DDP model whose buckets cross the WAN (none: an immutable default, so no
    two syncs ever share one list)."""

    quorum_per_step = False
    """Whether ``before_step`` joins a quorum every step (a site may receive the live state there, so gradients
    accumulated before it would belong to another model: front-ends that call it after accumulating refuse
    gradient accumulation)."""

    def build_topology(self, *, num_sites: int | None = None, site: int | str | None = None):
        """Collective over the job, once its process group exists: the job's ``Topology`` over it (DDP front-ends;
        a parallel layout builds its own). Nothing for an elastic site."""
        return None

    def attach_ddp(self, ddp_model: torch.nn.Module) -> None:
        """Every DDP model, after ``build_topology`` and before its first backward, on every rank."""

    def place(self, parallel) -> None:
        """A parallel layout placed the model (``parallel``: the ``ParallelModel``, placed with ``placement``),
        whatever the front-end does next (fit, evaluate, load a checkpoint): its topology is the job's."""

    def attach(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer], *,
               parallel=None, carry: Sequence | Mapping = (), accumulation_steps: int = 1, scaler=None) -> None:
        """Once the model and its optimizers exist, before the first step and before a checkpoint is loaded into
        them (collective). ``models``: what trains, as attached (the DDP wrapper, a layout's model); ``parallel``:
        the ``ParallelModel`` a layout placed it into; ``carry``: more state (LR schedulers, a list or dict of
        objects with ``state_dict`` / ``load_state_dict``) that travels with the model where state travels;
        ``accumulation_steps``: micro-batches per optimizer step before ``before_step`` is called; ``scaler``: an
        fp16 ``GradScaler`` if one drives the steps (refused where the sync cannot follow it)."""

    def backward_done(self) -> None:
        """After every backward returns (micro-batches included): a sync that meters its hooks' traffic marks it."""

    def checkpoint_sites(self) -> dict:
        """``{}``, or where ``sites_differ`` ``{"site": this site's index, "diloco": the DiLoCo state to store (None
        when not training)}``: a checkpoint then holds each site's model and optimizers under ``site_<k>``."""
        return {}

    def release_ddp(self) -> None:
        """Before the front-end destroys the process group itself while DDP models may outlive it: free their
        reducers (the models cannot train afterwards)."""

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


def cross_site_sync(*, wan=None, diloco=None, elastic: bool = False, **site_options) -> CrossSite:
    """The job's ``CrossSite`` sync, built with the front-end (no process group needed yet).

    Args:
        wan: ``WanConfig`` of the WAN hop; default ``WanConfig()`` (env ``MULTIDC_WAN_*``).
        diloco: a ``DiLoCoConfig``: DiLoCo / streaming DiLoCo (``DiLoCoSync``); None: per-step hierarchical
            all-reduce (``GradientSync``).
        elastic: this launch is one site of an elastic job on torchft (``ElasticSync``, the elastic variant of either).
        **site_options: ``site``, ``lighthouse``, ``sites`` of an elastic site (see ``ElasticSite``); ignored
            otherwise (a front-end's ``build_topology`` takes the site layout).

    Raises:
        ValueError: a ``wan`` or ``diloco`` of the wrong type, settings elastic DiLoCo cannot run.
    """
    if elastic:
        from multidc.hierarchical.elastic.steps import ElasticSync

        return ElasticSync(wan, diloco, **site_options)
    from multidc.hierarchical._gradient_sync import DiLoCoSync, GradientSync

    return DiLoCoSync(wan, diloco) if diloco is not None else GradientSync(wan)
