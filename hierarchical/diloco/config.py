"""``DiLoCoConfig``: when and how sites exchange pseudo-gradients under DiLoCo / streaming DiLoCo."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from multidc.hierarchical import _env
from multidc.hierarchical.compression import is_sparse
from multidc.hierarchical.config import compression_name, positive_number
from multidc.hierarchical.diloco.auto import DEFAULT_TARGET, warmup_sync_every
from multidc.hierarchical.diloco.fragments import digest, local_tensor, split_fragments


@dataclass(kw_only=True)
class DiLoCoConfig:
    """DiLoCo settings (Douillard et al. 2023; streaming: 2025). Every rank of every site must use the same ones.

    A field left at ``None`` takes its ``MULTIDC_DILOCO_*`` environment variable, else the default below, so
    ``torchrun`` / ``accelerate launch`` users can tune it without code changes. ``sync_every`` has no default.
    ``DiLoCo`` compares every rank's settings at construction and raises the same ValueError on all of them when
    they differ.

    Raises:
        ValueError: naming the field (and the variable, when the value came from one) and the fix.
    """

    sync_every: int | str | None = None
    """H: inner optimizer steps between two syncs of the same fragment, or ``"auto"``: DiLoCo measures the step time
    and the WAN throughput of its syncs and picks the smallest H that reaches ``target_utilization`` (see
    docs/guides/plan.md#auto-in-the-job); ``sync_every`` then holds the warm-up H of the first round (8, or
    ``fragments * (overlap_steps + 1)`` when larger) and ``sync_every_auto`` is True. Env
    ``MULTIDC_DILOCO_SYNC_EVERY`` (a number or ``auto``)."""

    fragments: int | None = None
    """P: the parameters are split into P fragments by block (strided: block i in fragment i mod P); a fragment
    syncs every H steps, one fragment every H/P steps. 1 = plain DiLoCo. Env ``MULTIDC_DILOCO_FRAGMENTS``."""

    overlap_steps: int | None = None
    """tau: inner steps that run while a fragment's sync crosses the WAN; its result is merged tau steps after it
    started, as ``alpha * local + (1 - alpha) * global``. 0 = the sync blocks and the local parameters become the
    global ones. Must be < H / P. Env ``MULTIDC_DILOCO_OVERLAP_STEPS``; default 0."""

    alpha: float | None = None
    """Weight of the local parameters in the merge when ``overlap_steps >= 1``, in [0, 1]; must be 0 with a top-k
    codec, whose merge is ``global + (local - local as the sync started)``: it keeps what the site trained while
    the sync was in flight, and what the sync did not send stays in the residual, not also in the local parameters.
    Env ``MULTIDC_DILOCO_ALPHA``; default 0.5."""

    outer_lr: float | None = None
    """Learning rate of the outer SGD. Env ``MULTIDC_DILOCO_OUTER_LR``; default 0.7."""

    outer_momentum: float | None = None
    """Momentum of the outer SGD, in [0, 1). Env ``MULTIDC_DILOCO_OUTER_MOMENTUM``; default 0.9."""

    nesterov: bool | None = None
    """Nesterov momentum for the outer SGD (needs momentum > 0). Env ``MULTIDC_DILOCO_NESTEROV``; default True."""

    compression: str | None = None
    """Codec of the pseudo-gradients on the WAN hop: ``"none"``, ``"bf16"``, ``"fp16"``, ``"int8"``, ``"int4"``,
    or sparse top-k: ``"topk"`` (density 1/64, 2-bit values, chunks of 256: 0.28 bit per parameter) or
    ``"topk:DENSITY[:BITS[:CHUNK]]"`` (bounds in ``multidc.hierarchical.compression``). Under top-k each rank
    keeps what a sync did not send (error feedback, see ``DiLoCo``). Env ``MULTIDC_DILOCO_COMPRESSION``; default
    ``"none"``."""

    sync_every_s: float | None = None
    """Rounds by time: each site runs as many inner steps per round as fit in ``sync_every_s`` seconds (measured),
    so a faster site no longer idles at the syncs; ``sync_every`` is then the steps of the first round, before
    anything is measured. A round holds one sync of every fragment; site ``s`` runs ``H_s = round(sync_every_s /
    its step time)`` steps in it (at least ``fragments * (overlap_steps + 1)``). Use it with ``weighting="samples"``:
    equal weights would over-weight the slow site. Each site counts its own inner steps (and steps its own LR
    schedulers); see docs/guides/diloco.md#rounds-by-time. Not with elastic sites. Env
    ``MULTIDC_DILOCO_SYNC_EVERY_S``; default None: every site syncs every ``sync_every`` steps."""

    weighting: str | None = None
    """How the sites' pseudo-gradients are merged: ``"samples"``: each site weighs what it trained since that
    fragment's last sync: the samples its ranks reported with ``DiLoCo.count(samples)`` (tokens, if you like), one
    per inner step per rank when not reported, so a site of 3 ranks weighs 3 times a site of 1 at equal batches per
    rank; ``"equal"``: the plain mean over sites. Equal weights give the plain mean bitwise. Elastic DiLoCo weighs
    the sites of each round the same way (a site that healed takes its source's counts with its parameters). Env
    ``MULTIDC_DILOCO_WEIGHTING``; default ``"samples"``."""

    sync_every_auto: bool = False
    """H is decided by the job from its measurements (set by ``sync_every="auto"``; with ``sync_every=N`` and
    ``sync_every_auto=True``, N is the warm-up H). Not with rounds by time (``sync_every_s``) or elastic sites."""

    target_utilization: float | None = None
    """With ``sync_every="auto"``: the compute utilization (step time without WAN waits over step time with them)
    the chosen H must reach by the planning model, in (0, 1). Env ``MULTIDC_DILOCO_TARGET_UTILIZATION``; default
    0.95; refused without ``sync_every="auto"`` (it would do nothing)."""

    def __post_init__(self) -> None:
        self._env_names = _env.fill_fields(self, (
            ("sync_every", _env.DILOCO_SYNC_EVERY, _env.read_int_or_auto, None),
            ("target_utilization", _env.DILOCO_TARGET_UTILIZATION, _env.read_float, None),
            ("fragments", _env.DILOCO_FRAGMENTS, _env.read_int, 1),
            ("overlap_steps", _env.DILOCO_OVERLAP_STEPS, _env.read_int, 0),
            ("alpha", _env.DILOCO_ALPHA, _env.read_float, 0.5),
            ("outer_lr", _env.DILOCO_OUTER_LR, _env.read_float, 0.7),
            ("outer_momentum", _env.DILOCO_OUTER_MOMENTUM, _env.read_float, 0.9),
            ("nesterov", _env.DILOCO_NESTEROV, _env.read_bool, True),
            ("compression", _env.DILOCO_COMPRESSION, _env.read, "none"),
            ("weighting", _env.DILOCO_WEIGHTING, _env.read, "samples"),
            ("sync_every_s", _env.DILOCO_SYNC_EVERY_S, _env.read_float, None),
        ))
        self._validate()

    def _validate(self) -> None:
        if self.sync_every is None:
            raise ValueError(
                f"DiLoCoConfig.sync_every is not set: pass sync_every=<inner steps between syncs, e.g. 50> or set "
                f"{_env.DILOCO_SYNC_EVERY}."
            )
        self._resolve_auto()
        if not _whole(self.sync_every, 1):
            raise ValueError(f"{self._source('sync_every')} must be an integer >= 1 (inner steps), e.g. 50.")
        if not _whole(self.fragments, 1) or self.fragments > self.sync_every:
            raise ValueError(
                f"{self._source('fragments')} must be an integer from 1 to sync_every={self.sync_every} (one "
                f"fragment syncs every sync_every / fragments steps)."
            )
        if not _whole(self.overlap_steps, 0) or self.overlap_steps * self.fragments >= self.sync_every:
            raise ValueError(
                f"{self._source('overlap_steps')} must be an integer >= 0 and < sync_every / fragments = "
                f"{self.sync_every}/{self.fragments} (a fragment's sync must finish before the next one starts)."
            )
        if not _number(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{self._source('alpha')} must be a number in [0, 1], e.g. 0.5.")
        if not positive_number(self.outer_lr):
            raise ValueError(f"{self._source('outer_lr')} must be a positive number, e.g. 0.7.")
        if not _number(self.outer_momentum) or not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"{self._source('outer_momentum')} must be a number in [0, 1), e.g. 0.9.")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"{self._source('nesterov')} must be True or False.")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError(f"{self._source('nesterov')} needs outer_momentum > 0; set nesterov=False or a momentum.")
        self.compression = compression_name(self.compression, self._source("compression"))
        if is_sparse(self.compression) and self.overlap_steps and self.alpha:
            raise ValueError(
                f"{self._source('alpha')} with compression={self.compression!r} and overlap_steps="
                f"{self.overlap_steps}: set alpha=0. The merge would keep alpha of what a sync did not send in the "
                f"local parameters while the error-feedback residual keeps all of it, so it would be sent again "
                f"(counted 1 + alpha times)."
            )
        weighting = str(self.weighting).strip().lower()
        if weighting not in WEIGHTINGS:
            raise ValueError(f"{self._source('weighting')}: choose 'samples' (each site weighs what it trained since "
                             f"the fragment's last sync) or 'equal' (the plain mean over sites).")
        self.weighting = weighting
        if self.sync_every_s is not None and not (positive_number(self.sync_every_s) and _number(self.sync_every_s)):
            raise ValueError(f"{self._source('sync_every_s')} must be a positive number of seconds (e.g. 30.0), or "
                             f"None for rounds of sync_every steps.")

    def _resolve_auto(self) -> None:
        """``sync_every="auto"``: the warm-up H in ``sync_every``, ``sync_every_auto`` set, the target checked."""
        if isinstance(self.sync_every, str):
            if self.sync_every.strip().lower() != "auto":
                raise ValueError(f"{self._source('sync_every')} must be an integer >= 1 (inner steps) or 'auto'.")
            fragments = self.fragments if _whole(self.fragments, 1) else 1
            overlap = self.overlap_steps if _whole(self.overlap_steps, 0) else 0
            self.sync_every, self.sync_every_auto = warmup_sync_every(fragments, overlap), True
        if not isinstance(self.sync_every_auto, bool):
            raise ValueError(f"DiLoCoConfig.sync_every_auto={self.sync_every_auto!r} must be True or False "
                             f"(or pass sync_every='auto').")
        if not self.sync_every_auto:
            if self.target_utilization is not None:
                raise ValueError(f"{self._source('target_utilization')} is set but sync_every is not 'auto', so "
                                 f"nothing would use it: pass sync_every='auto', or unset target_utilization.")
            return
        if self.target_utilization is None:
            self.target_utilization = DEFAULT_TARGET
        if not _number(self.target_utilization) or not 0 < self.target_utilization < 1:
            raise ValueError(f"{self._source('target_utilization')} must be a utilization in (0, 1), e.g. 0.95.")
        if self.sync_every_s is not None:
            raise ValueError(f"{self._source('sync_every_s')} with sync_every='auto': both decide a round's length; "
                             f"unset sync_every_s (rounds by time) or give sync_every a number.")

    def _source(self, name: str) -> str:
        return _env.describe(self, name, self._env_names, _FIELD_ENV)

    def offset(self, fragment: int) -> int:
        """The inner step (mod ``sync_every``) at which ``fragment``'s sync starts: fragments are spread evenly,
        the last one at multiples of ``sync_every`` (so with one fragment, steps H, 2H, ...)."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every


_FIELD_ENV = {
    "sync_every": _env.DILOCO_SYNC_EVERY,
    "fragments": _env.DILOCO_FRAGMENTS,
    "overlap_steps": _env.DILOCO_OVERLAP_STEPS,
    "alpha": _env.DILOCO_ALPHA,
    "outer_lr": _env.DILOCO_OUTER_LR,
    "outer_momentum": _env.DILOCO_OUTER_MOMENTUM,
    "nesterov": _env.DILOCO_NESTEROV,
    "compression": _env.DILOCO_COMPRESSION,
    "weighting": _env.DILOCO_WEIGHTING,
    "sync_every_s": _env.DILOCO_SYNC_EVERY_S,
    "target_utilization": _env.DILOCO_TARGET_UTILIZATION,
    "sync_every_auto": _env.DILOCO_SYNC_EVERY,
}
WEIGHTINGS = ("samples", "equal")


def _whole(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


CROSS_SITE_MODES = ("allreduce", "diloco")


def resolve_cross_site(cross_site: str | None, diloco: DiLoCoConfig | None, *, owner: str) -> DiLoCoConfig | None:
    """How a front-end's replicas meet across sites: ``None`` for per-step gradient all-reduce (``"allreduce"``,
    the default), or the ``DiLoCoConfig`` for ``"diloco"`` (``diloco``, else ``DiLoCoConfig()`` from
    ``MULTIDC_DILOCO_*``, built now so a missing ``sync_every`` fails at construction). ``cross_site`` None takes
    ``MULTIDC_CROSS_SITE``. ``owner`` names the front-end in messages.

    Raises:
        ValueError: an unknown mode, a ``diloco`` that is not a ``DiLoCoConfig``, ``diloco`` given without
            ``cross_site="diloco"``, or rounds by time (``sync_every_s``), which only ``DiLoCoStrategy`` and the raw
            ``DiLoCo`` drive so far (their sites end at the same round; these front-ends would hang at the end).
    """
    source = f"{owner}.cross_site"
    if cross_site is None:
        cross_site, source = _env.read(_env.CROSS_SITE) or "allreduce", _env.CROSS_SITE
    mode = str(cross_site).strip().lower()
    if mode not in CROSS_SITE_MODES:
        raise ValueError(f"{source}={cross_site!r}: choose 'allreduce' (every step's gradients cross the WAN) or "
                         f"'diloco' (sites sync every DiLoCoConfig.sync_every steps).")
    if diloco is not None and not isinstance(diloco, DiLoCoConfig):
        raise ValueError(f"{owner}.diloco must be a multidc.hierarchical.DiLoCoConfig, not {type(diloco).__name__}.")
    if mode == "allreduce":
        if diloco is not None:
            raise ValueError(f"{owner}.diloco is set but cross_site is 'allreduce' ({source}); add "
                             f"cross_site='diloco' to train with DiLoCo.")
        return None
    config = diloco if diloco is not None else DiLoCoConfig()
    if config.sync_every_s is not None:
        raise ValueError(
            f"{owner} does not support rounds by time yet ({config._source('sync_every_s')}): "
            f"its sites would stop at different rounds and wait on each other. Unset sync_every_s / "
            f"MULTIDC_DILOCO_SYNC_EVERY_S (rounds of sync_every steps), or use DiLoCoStrategy or the raw DiLoCo."
        )
    return config


def config_or_default(config) -> DiLoCoConfig:
    """``config``, or ``DiLoCoConfig()`` (env ``MULTIDC_DILOCO_*``) for ``None``; ValueError for anything else."""
    config = config if config is not None else DiLoCoConfig()
    if not isinstance(config, DiLoCoConfig):
        raise ValueError(f"the DiLoCo config must be a multidc.hierarchical.DiLoCoConfig, not {type(config).__name__}.")
    return config


def agree(error: str | None, config: DiLoCoConfig | None, extra=None, *, group=None, where: str = "") -> list:
    """Compare every rank's check over ``group`` (collective): raise the same ValueError on every rank when one rank
    failed (``error``, its message) or the ranks' settings differ. ``extra`` rides along for the caller's own
    comparison. Returns ``[(error, config, extra)]`` per rank of ``group``."""
    claims: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(claims, (error, config if error is None else None, extra), group=group)
    for rank, (message, _, _) in enumerate(claims):
        if message:
            raise ValueError(f"DiLoCo on rank {rank}{where}: {message}")
    if any(claim[1] != claims[0][1] for claim in claims):
        seen = {rank: claim[1] for rank, claim in enumerate(claims)}
        raise ValueError(f"ranks disagree on the DiLoCo settings ({seen}); pass the same DiLoCoConfig / "
                         f"MULTIDC_DILOCO_* on every rank of every site.")
    return claims


_LOSS_SCALING_HARM = {
    "DiLoCo": "the GradScaler skips optimizer steps on overflow, each site on its own, which would put the sites' "
              "DiLoCo schedules apart",
    "elastic": "the GradScaler's scale is neither averaged over the sites nor part of the state a rejoining site "
               "receives, so the sites would sum gradients scaled differently",
}


def refuse_loss_scaling(scaler, *, mode: str = "DiLoCo") -> None:
    """A ValueError when fp16 loss scaling (a ``GradScaler``) would drive a training mode that cannot follow it:
    ``"DiLoCo"`` (the scaler skips optimizer steps per site, so the sites' schedules drift apart) or
    ``"elastic"`` (the scale differs between a rejoined site and the others). Front-ends call it on every rank
    before training."""
    if scaler is not None:
        raise ValueError(
            f"{mode} with fp16 loss scaling (precision '16-mixed' / mixed_precision 'fp16'): "
            f"{_LOSS_SCALING_HARM[mode]}. Use bf16 mixed precision (no scaler) or full precision."
        )


def agree_model(model, topology, config: DiLoCoConfig | None, blocks,
                common=None) -> tuple[list, DiLoCoConfig, list[bool], list | None]:
    """Collective over ``topology.group``: this rank's fragments of ``model`` and the settings, after every rank
    compared theirs (the same ValueError everywhere), and per fragment whether the ranks' parameters differ: decided
    from the gathered digests, so alike everywhere. With one site there is nothing to copy and nothing is hashed.
    ``common``: a ``DiLoCo`` ``common_layout``; sizes and digests are then those of each fragment in it, whose
    plans come back last (``None`` without)."""
    split, error, sizes, digests, plans = None, None, None, None, None
    try:
        config = config_or_default(config)
        split = split_fragments(model, config.fragments, blocks)
        if common is not None:  # collective inside the site (its shard sizes), before anything can differ
            plans = [common.fragment(params, [local_tensor(p) for p in params]) for params in split]
        sizes = [plan.numel for plan in plans] if plans else [
            sum(local_tensor(p).numel() for p in params) for params in split]
        plans_or_none = plans or [None] * len(split)
        digests = [_digest(params, plan, topology.num_sites) for params, plan in zip(split, plans_or_none)]
    except Exception as exc:  # noqa: BLE001  (any failure: told to every rank, or the others wait in the gather)
        error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    claims = agree(error, config, (sizes, digests), group=topology.group, where=" of the sites' group")
    if any(c[2][0] != claims[0][2][0] for c in claims):
        seen = {rank: c[2][0] for rank, c in enumerate(claims)}
        raise ValueError(f"ranks hold different models: parameter elements per DiLoCo fragment differ ({seen}); "
                         f"every site must train the same model with the same layout.")
    apart = [len({c[2][1][i] for c in claims}) > 1 for i in range(len(split))]
    return split, config, apart, plans


def _digest(params, plan, num_sites: int) -> str:
    """The fragment's digest (``""`` with one site): of this rank's tensors, or of the full tensors in ``plan``'s
    layout (collective inside the site)."""
    if num_sites == 1:
        return ""
    if plan is None:
        return digest(params)
    flat = torch.cat([local_tensor(p).detach().reshape(-1).float() for p in params])
    return digest([plan.gather(flat)])
