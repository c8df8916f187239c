"""``ElasticDiLoCo``: DiLoCo whose syncs are the steps of an elastic job (torchft quorum per outer sync).

A round is the inner steps up to the next sync: ``sync_every`` of them in plain DiLoCo, ``sync_every / fragments``
in streaming DiLoCo, where each sync averages one fragment (the fragments take turns). A round's quorum forms at its
start, right after the previous sync (a site that (re)joins receives the live global parameters, outer optimizer
states, its peer's local parameters, inner optimizer state and step counts there, and trains the whole round with
the others). At its end the fragment's pseudo-gradients ``global - local`` are averaged over the round's sites (the
hierarchical all-reduce in ``replicated`` mode over each rail, compressed as configured), and the sites' ranks vote:
a committed round steps the fragment's outer optimizer; a discarded one (a site died or its link was cut during the
round) changes no global parameter and puts the fragment's local parameters back to the global ones, so no
half-reduced update is ever applied. Either way every site then starts its next round from the same global
parameters, and the next quorum heals a site that discarded a round another committed.

With ``overlap_steps`` (tau) a fragment's all-reduce runs in the background for tau inner steps (over a group of
the site's own, apart from DDP's) and the round ends when its result merges (local ``alpha * local + (1 - alpha) *
global``, also after a discard, with the unchanged global ones): the vote and the next quorum come there, so a sync
never spans a change of the sites present, and a joining site arrives with no transfer in flight (after a resume
from a checkpoint saved mid-flight, the loaded result travels with the state). ``overlap_steps`` must stay below the
smallest gap between two fragments' syncs, so a round's merge never falls on the next sync's first step.

A site that heals (a restarted one, or a live one that discarded a round another committed) takes all of its
source's parameters: in streaming or overlapped DiLoCo also the local values of the fragments not synced last, so
its own progress on them since their last sync is replaced by the source's.

Top-k error feedback (see ``DiLoCo``): a discarded round puts the fragment's residual back to what it was before the
round (its contribution was not applied anywhere); a healing site's residuals restart at zero (the source's
residuals are the source's own shares, and its own no longer match the global parameters it receives). They are
not in ``state_dict()`` (one site saves the job's checkpoints): a resumed job restarts them at zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.cross_site import CrossSite
from multidc.hierarchical.diloco.config import DiLoCoConfig, config_or_default
from multidc.hierarchical.diloco.diloco import DiLoCo
from multidc.hierarchical.elastic.shards import load_module_state, load_optimizer_state, module_state, optimizer_state
from multidc.hierarchical.elastic.site import ElasticSite, _to_cpu
from multidc.hierarchical.topology import SiteLayout, Topology


class ElasticDiLoCo(DiLoCo, CrossSite):
    """DiLoCo across the sites of an elastic job. Every rank of a site builds one, after ``init_process_group``
    (the site's own job: its own ``torchrun``); construction joins the first quorum (a late or restarted site
    receives the live state here). Then train as usual: ``step()`` runs after each inner optimizer step (its step
    post-hook) and at each sync (every ``sync_every`` inner steps, or ``sync_every / fragments`` in streaming
    DiLoCo) it ends the round (average, vote, outer step) and joins the next quorum. Loop on ``inner_steps``, which
    a rejoined site takes from the live ones::

        diloco = ElasticDiLoCo(model, inner_opt, DiLoCoConfig(sync_every=100), site="us-east")
        while diloco.inner_steps < total:
            loss_fn(model(next_batch(diloco.inner_steps)), ...).backward()
            inner_opt.step()           # the post-hook: at a round's end, the sync and the next quorum
            inner_opt.zero_grad()
        diloco.close()

    Args:
        model: as for ``DiLoCo``.
        inner_optimizer: as for ``DiLoCo``, but required (its state travels to a rejoining site).
        outer_optimizer: as for ``DiLoCo``.
        blocks: as for ``DiLoCo``.
        config: ``DiLoCoConfig`` (plain, streaming, overlapped); ``None``: ``DiLoCoConfig()``.
        wan: WAN settings of the syncs (``timeout_s``: how long a round's sync waits for a dead site before the
            round is discarded); ``config.compression`` is its codec.
        state_dict: more state that travels to a rejoining site (LR schedulers, data loader position), called on a
            live site's ranks.
        load_state_dict: loads what ``state_dict`` returned, called on the rejoining site's ranks.
        start_rounds: ``step()`` joins the next round's quorum right after a sync; False: call ``start_round()``
            yourself between steps, after stepping what ``state_dict`` holds (LR schedulers), so a rejoining site
            receives it in the state it has between steps (the Lightning and Accelerate front-ends do).
        join: construction joins the first round's quorum; False: the first ``start_round()``, before the first
            inner step, does, so a checkpoint can be restored first (``load_state_dict``; see below).
        **site_options: ``site``, ``lighthouse``, ``min_sites``, ``sites``, ``quorum_timeout_s`` (default 3600
            here: a joining site waits for the live sites' next round), ``heal_timeout_s``, ``max_failed_steps``
            (counted in rounds), ``host``: see ``ElasticSite``. Set ``sites`` (or ``MULTIDC_NUM_SITES``): a site
            that has not trained with the job waits for them, instead of training alone.

    Checkpoints: ``state_dict()`` is DiLoCo's outer state plus the job's committed rounds; store it with the model
    and inner optimizer of one site: ``site.save_once(save)`` (every site alike) runs it on one. A site built with
    ``join=False`` that loads it (``load_state_dict``) resumes the job at that round: the first quorum gives its
    state to sites that start without one, and it takes the live sites' state instead if they are further on.
    Saved right after a round of plain DiLoCo without overlap (inner steps a multiple of ``sync_every``) every site
    holds the global parameters and a resumed run continues as an unbroken one; saved at any other step (and always
    in streaming or overlapped DiLoCo, where a site's parameters are not all global) every site resumes from the
    saving site's parameters.
    Saved while an overlapped sync is in flight, the checkpoint holds its averaged result, which the resumed job
    merges (and votes on) at its step; a sync whose transfer failed on the saving site is left out.

    Raises:
        ValueError: bad settings, or settings that differ inside the site; a site
            whose model or settings differ from the live sites' fails when it joins, and they go on without it.
        ImportError: torchft is missing.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: DiLoCoConfig | None = None,
        *,
        wan: WanConfig | None = None,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        blocks: Sequence[nn.Module] | None = None,
        state_dict: Callable[[], dict] | None = None,
        load_state_dict: Callable[[dict], None] | None = None,
        start_rounds: bool = True,
        join: bool = True,
        **site_options,
    ) -> None:
        config = check_elastic_config(config_or_default(config))
        if inner_optimizer is None:
            raise ValueError("ElasticDiLoCo needs the inner optimizer: its state travels to a rejoining site.")
        wan = wan if wan is not None else WanConfig()
        wan.refuse_auto("elastic DiLoCo")
        # DiLoCo's own set-up (settings agreed, fragments, outer optimizer) runs inside the site (among the ranks
        # that hold this rank's shards, under a layout); the sites are made equal by the first quorum instead
        # (torchft's step-0 sync from one site)
        replicas = site_options.get("replica_group")
        if replicas is not None and config.overlap_steps and dist.get_world_size(replicas) > 1:
            raise ValueError("elastic DiLoCo with overlap_steps under a layout with dp_replicate > 1 is not supported "
                             "yet: set overlap_steps=0, or dp_replicate=1.")
        super().__init__(model, inner_optimizer, _site_topology(wan, replicas), config, wan=wan,
                         outer_optimizer=outer_optimizer, blocks=blocks)
        self._model, self._inner = model, inner_optimizer
        # top-k with overlap merges by taking the global parameters here: a healing site takes another site's state,
        # whose in-flight local fragment is not its own, so the in-flight progress kept by DiLoCo is not kept
        self._kept = None
        self._residual_before: torch.Tensor | None = None
        self._user_state, self._load_user_state = state_dict, load_state_dict
        self._start_rounds, self.round_pending = start_rounds, False
        self.synced: bool | None = None
        """After each inner step: None if it ended no round, else whether the round committed."""
        # a joining site waits for the live sites' next round, which may be a long way off
        site_options.setdefault("quorum_timeout_s", 3600.0)
        try:
            self.site = ElasticSite(state_dict=self._live_state, load_state_dict=self._load_live_state,
                                    wan=self.wan, **site_options)
        except BaseException:
            DiLoCo.close(self)  # the step hook and the site's own topology must not outlive a failed start
            self.topology.close()
            raise
        self._own_group = None
        if self.config.overlap_steps and self.topology.site_size > 1:  # the background sync's intra-site stages
            self._own_group = self.site.intra_group = dist.new_group()
        self._round = None
        self.round_pending = True  # the first round: joined here, or by the caller's first start_round()
        if join:
            try:
                self.start_round()
            except BaseException:
                self.close()
                raise

    @property
    def inner_steps(self) -> int:
        """Inner steps of the job so far (a rejoined site takes the live sites' count)."""
        return self.stats.inner_steps

    @property
    def outer_steps(self) -> int:
        """Rounds committed by the job so far."""
        return self.site.step

    @property
    def num_sites(self) -> int:
        """Sites in the current round."""
        return self.site.num_sites

    def _settings(self) -> dict:
        """What every site must share beyond the shapes: the DiLoCo settings and the outer optimizers' settings."""
        groups = [{key: value for key, value in group.items() if key != "params"}
                  for fragment in self._fragments for group in fragment.outer.param_groups]
        return {"config": repr(self.config), "outer": repr(groups)}

    def state_dict(self) -> dict:
        """For a checkpoint: ``DiLoCo.state_dict()`` and the rounds the job committed (``outer_steps``). An
        overlapped sync in flight is waited for; if its transfer failed on this site (the site will discard the
        round) it is left out, so a resumed job never merges a half-reduced result."""
        state = {**super().state_dict(), "outer_steps": torch.tensor(self.outer_steps)}
        round_ = self._round
        if self._in_flight is not None and round_ is not None and (round_.policy.error is not None or
                                                                   not round_.wan_usable()):
            state["in_flight_fragment"], state["in_flight_merge_at"] = torch.tensor(-1), torch.tensor(-1)
            state["in_flight_delta"].zero_()  # a new tensor of state_dict(), not the live one
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's ``state_dict()`` before the first round (``join=False``): its quorum, at the first
        ``start_round()``, resumes the job at the checkpoint's round (see the class docstring). Every rank of the
        site.

        Raises:
            RuntimeError: the site joined a round already (a rejoining site receives the live state instead).
        """
        if self.joined:
            raise RuntimeError("ElasticDiLoCo.load_state_dict restores a checkpoint before the first round: build it "
                               "with join=False and load before the first start_round().")
        super().load_state_dict(state)
        self.site.resume(int(state["outer_steps"]))

    @property
    def joined(self) -> bool:
        """Whether the site has joined its first round's quorum."""
        return self._round is not None

    def _live_state(self) -> dict:
        # A snapshot: torchft serves CPU tensors by reference while this site trains on through the round
        diloco = DiLoCo.state_dict(self)
        if self.config.weighting == "samples":  # a healing rank takes its source's counts with its local values
            diloco["trained"] = {f"rank_{dist.get_rank()}": torch.tensor(self._trained, dtype=torch.float64)}
        state = {"model": module_state(self._model), "inner": optimizer_state(self._inner),
                 "diloco": diloco, "user": self._user_state() if self._user_state else None}
        return {**_to_cpu(state, copy=True), "settings": self._settings()}

    def _load_live_state(self, state: dict) -> None:
        mine = self._settings()
        differ = [f"{key}: {mine[key]} here, {state['settings'][key]} there" for key in mine
                  if mine[key] != state["settings"][key]]
        if differ:
            raise ValueError(f"the DiLoCo settings differ: {'; '.join(differ)}")
        DiLoCo.load_state_dict(self, state["diloco"])  # zeroes the residuals (see the module docstring)
        self._residual_before = None
        load_module_state(self._model, state["model"])
        load_optimizer_state(self._inner, state["inner"])
        if self._load_user_state is not None:
            self._load_user_state(state["user"])

    @torch.no_grad()
    def step(self) -> None:
        """Count one inner step. When a fragment's turn comes, average its pseudo-gradients over the round's sites
        (with ``overlap_steps``, in the background while training goes on). When that result is due (at once, or
        ``overlap_steps`` later) the round ends: the site's ranks vote, a committed round steps the fragment's
        outer optimizer, the fragment's local parameters take the global ones (merged with weight ``alpha`` under
        overlap), and the site joins the next quorum (with ``start_rounds=False`` the caller does that:
        ``start_round()``). Every rank of the site. The inner optimizer's step post-hook calls it: calling it
        yourself too raises a RuntimeError (it would count each inner step twice), as ``DiLoCo.step`` does."""
        if self.round_pending:
            raise RuntimeError("ElasticDiLoCo: start_round() must come before the first inner step (join=False) and, "
                               "with start_rounds=False, between a round's end and the next inner step.")
        t = self._count_inner_step()
        self.synced = None
        if self._in_flight is not None and self._in_flight.merge_at <= t:
            return self._end_round()
        due = self._due(t)
        if due is None:
            return None
        started = time.perf_counter()
        self._start(due, t)  # a failed transfer does not raise: the round will not commit
        self.stats.exposed_s += time.perf_counter() - started
        return self._end_round() if self.config.overlap_steps == 0 else None

    def _sync_target(self) -> tuple[Topology, WanConfig]:
        return self._round, self._round.wan  # this round's sites (one WAN stream per rail)

    def _per_rank_state(self) -> dict:
        # One site saves the job's checkpoints and a healing site must not take its source's residuals: none kept
        return {}

    def _load_residuals(self, saved: dict) -> None:
        # the state of another site or of a checkpoint holds none: a healing site's residuals restart at zero
        for fragment in self._fragments:
            if fragment.residual is not None:
                fragment.residual.zero_()

    def _restore_residual(self, index: int) -> None:
        """A discarded round's fragment: its residual as before the round (zero if it had none)."""
        residual, before = self._fragments[index].residual, self._residual_before
        if residual is None:
            return
        if before is not None and before.numel() == residual.numel():
            residual.copy_(before)
        else:
            residual.zero_()

    def _start(self, index: int, t: int) -> None:
        residual = self._fragments[index].residual  # kept so that a discarded round can put it back
        self._residual_before = None if residual is None else residual.clone()
        super()._start(index, t)

    def _end_round(self) -> None:
        """The sync in flight is due: wait for it, vote, merge (the outer step only if committed; the fragment
        starts the next round from its global parameters, merged under overlap, also after a discard), and end the
        round."""
        started = time.perf_counter()
        flight, self._in_flight = self._in_flight, None
        self._wait(flight)
        self.synced = self.site.commit()
        if not self.synced:
            self._restore_residual(flight.fragment)
        self._merge(flight, outer_step=self.synced)
        self.stats.exposed_s += time.perf_counter() - started
        self.round_pending = True
        if self._start_rounds:
            self.start_round()

    def _wan_bytes(self) -> int:
        return self.site.wan_stats.snapshot()["bytes_sent"]

    def _wan_seconds(self) -> float:
        return self.site.wan_stats.snapshot()["seconds"]

    def start_round(self) -> None:
        """Join the next round's quorum; a site that is behind receives the live state here. Called by ``step()``
        at a round's end, or, with ``start_rounds=False``, by the caller between that step and the next one, once
        whatever else it steps per step (LR schedulers) has stepped: the live state then matches what a site that
        joins between steps holds. Every rank of the site; nothing when no round ended."""
        if not self.round_pending:
            return
        started = time.perf_counter()
        self._round = self.site.start_step()
        self.round_pending = False  # after the quorum: one that failed is tried again by the next call
        self.stats.exposed_s += time.perf_counter() - started

    # CrossSite: the points a front-end calls (multidc.hierarchical.cross_site)
    def before_step(self) -> None:
        self.start_round()  # the first round (after a checkpoint's restore), or one a sync left pending

    def after_step(self) -> None:
        self.start_round()  # a round that ended with this step: its quorum, once the LR schedulers stepped

    @property
    def job_step(self) -> int:
        return self.inner_steps

    @property
    def writes_checkpoints(self) -> bool:
        return self.site.is_leader

    def save_once(self, save) -> None:
        self.site.save_once(save)

    def close(self) -> None:
        """Stop stepping with the inner optimizer and leave the job (this site's manager). Every rank."""
        self.round_pending = False
        try:
            super().close()
        finally:
            self.site.close()
            if self._own_group is not None and dist.is_initialized():
                dist.destroy_process_group(self._own_group)
                self._own_group = None
            self.topology.close()


def _site_topology(wan: WanConfig, replicas) -> Topology:
    """DiLoCo's own topology, inside the site: its ranks (``Topology.build`` over the site's job), or, under a
    layout, the ranks holding this rank's shards (``replicas``)."""
    if replicas is None:
        return Topology.build(num_sites=1, site=0, wan=wan)
    size = dist.get_world_size(replicas)
    return Topology(layout=SiteLayout.contiguous(1, size), site=0, local_rank_in_site=dist.get_rank(replicas),
                    intra_group=replicas, rail_groups=[], rail_row=None, wan=wan, group=replicas)


def check_elastic_config(config: DiLoCoConfig) -> DiLoCoConfig:
    """``config``, if elastic DiLoCo can run it; else a ValueError saying what to change. A round ends where its
    sync merges, so an overlapped sync must merge before the next fragment's sync starts. Rounds by time are refused:
    their plan is agreed by a fixed set of sites at each round's end, while an elastic job's sites change there."""
    if config.sync_every_s is not None:
        raise ValueError(
            f"elastic DiLoCo does not support rounds by time yet (DiLoCoConfig.sync_every_s={config.sync_every_s}): "
            f"a time round's plan is agreed by a fixed set of sites, while an elastic job's sites change from round "
            f"to round. Unset sync_every_s / MULTIDC_DILOCO_SYNC_EVERY_S, or train without elastic=True."
        )
    if config.sync_every_auto:
        raise ValueError(
            "elastic DiLoCo does not support sync_every='auto' yet: its H is agreed by a fixed set of sites at a "
            "round's end, while an elastic job's sites change from round to round. Give sync_every a number (multidc "
            "plan suggests one), or train without elastic=True."
        )
    if config.overlap_steps:
        offsets = sorted(config.offset(i) for i in range(config.fragments))
        gap = min((b - a) % config.sync_every or config.sync_every for a, b in zip(offsets, offsets[1:] + offsets[:1]))
        if config.overlap_steps >= gap:
            raise ValueError(
                f"elastic DiLoCo ends a round where its sync merges, so overlap_steps={config.overlap_steps} must be "
                f"below the smallest gap between two fragments' syncs ({gap} steps with sync_every="
                f"{config.sync_every}, fragments={config.fragments}); lower MULTIDC_DILOCO_OVERLAP_STEPS, or make "
                f"sync_every a multiple of fragments."
            )
    return config
