"""Pipeline parallelism: split a model's ordered blocks into stages and run a ``torch.distributed.pipelining``
schedule (GPipe, 1F1B, interleaved 1F1B) over the layout's ``"pp"`` axis.

The model is declared as an ordered sequence of blocks: block ``i + 1`` takes block ``i``'s output (one tensor),
block 0 takes the batch's input tensor, and the last block's output goes to the loss. Stage ``s`` holds the blocks
``ranges[s]`` (contiguous); with ``stages_per_rank = v`` pipeline rank ``r`` holds stages ``r, r + pp, ...``
(the looped placement interleaved 1F1B expects), so the last stage always sits on pipeline rank ``pp - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from multidc.hierarchical import _env
from multidc.hierarchical.parallel.layout import submesh

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(kw_only=True)
class PipelineConfig:
    """How the pipeline runs. Fields left at ``None`` take ``MULTIDC_PP_*`` environment variables, else defaults."""

    schedule: str | None = None
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``. Env ``MULTIDC_PP_SCHEDULE``; default ``"1f1b"``."""
    microbatches: int | None = None
    """Microbatches per step; the per-rank batch must divide by it. Env ``MULTIDC_PP_MICROBATCHES``; default
    ``2 * pipeline_parallel_size`` (bubble share at most 1/3 for 1F1B and GPipe)."""
    stages_per_rank: int | None = None
    """Stages each pipeline rank holds; default 2 for ``interleaved_1f1b``, else 1 (which they require)."""
    split_points: Sequence[int] | None = None
    """Block indices where stages ``1 .. n-1`` start, strictly increasing; default: balanced by block count."""

    def __post_init__(self) -> None:
        if self.schedule is None:
            self.schedule = _env.read(_env.PP_SCHEDULE) or "1f1b"
        schedule = str(self.schedule).lower().replace("-", "_")
        if schedule not in SCHEDULES:
            raise ValueError(
                f"PipelineConfig.schedule={self.schedule!r} is not supported; use one of {SCHEDULES} "
                f"(also via {_env.PP_SCHEDULE})."
            )
        self.schedule = schedule
        if self.microbatches is None:
            self.microbatches = _env.read_int(_env.PP_MICROBATCHES)
        if self.microbatches is not None and (_not_int(self.microbatches) or self.microbatches < 1):
            raise ValueError(
                f"PipelineConfig.microbatches={self.microbatches!r} must be a positive int "
                f"(also via {_env.PP_MICROBATCHES})."
            )
        interleaved = schedule == "interleaved_1f1b"
        if self.stages_per_rank is None:
            self.stages_per_rank = 2 if interleaved else 1
        if _not_int(self.stages_per_rank) or self.stages_per_rank < 1:
            raise ValueError(f"PipelineConfig.stages_per_rank={self.stages_per_rank!r} must be a positive int.")
        if interleaved != (self.stages_per_rank > 1):
            raise ValueError(
                f"PipelineConfig: schedule={schedule!r} with stages_per_rank={self.stages_per_rank}; "
                f"'interleaved_1f1b' needs stages_per_rank >= 2 and 'gpipe'/'1f1b' need exactly 1."
            )
        if self.split_points is not None:
            self.split_points = tuple(self.split_points)

    def resolved_microbatches(self, pp: int) -> int:
        """Microbatches for ``pp`` pipeline ranks; ValueError when the schedule cannot run them."""
        m = self.microbatches if self.microbatches is not None else 2 * pp
        stages = pp * self.stages_per_rank
        if self.schedule == "1f1b" and m < pp:
            raise ValueError(f"schedule '1f1b' needs microbatches >= pipeline_parallel_size={pp}; got {m}.")
        if self.schedule == "interleaved_1f1b" and m % pp:
            raise ValueError(
                f"schedule 'interleaved_1f1b' needs microbatches to be a multiple of pipeline_parallel_size={pp} "
                f"({stages} stages); got {m}. Use e.g. microbatches={max(pp, m - m % pp)}."
            )
        return m


def split_blocks(num_blocks: int, num_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """Block index ranges of each stage: contiguous, in order, covering ``range(num_blocks)`` once.

    Without ``split_points`` stages get ``num_blocks // num_stages`` blocks and the last
    ``num_blocks % num_stages`` stages one more (the first stage keeps the most in-flight activations under
    1F1B, so it gets the lighter share). Pure arithmetic.

    Raises:
        ValueError: fewer blocks than stages, or split points that are not ``num_stages - 1`` strictly increasing
            indices inside ``1 .. num_blocks - 1``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be at least 1.")
    if num_blocks < num_stages:
        raise ValueError(
            f"the model declares {num_blocks} pipeline blocks but the layout needs {num_stages} stages "
            f"(pipeline_parallel_size x stages_per_rank); declare at least {num_stages} blocks or use fewer stages."
        )
    if split_points is None:
        base, extra = divmod(num_blocks, num_stages)
        sizes = [base + (s >= num_stages - extra) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
    else:
        points = list(split_points)
        if (
            len(points) != num_stages - 1
            or any(_not_int(p) for p in points)
            or points != sorted(set(points))
            or (points and not 0 < points[0] <= points[-1] < num_blocks)
        ):
            raise ValueError(
                f"split_points={tuple(points)} must be {num_stages - 1} strictly increasing block indices in "
                f"1..{num_blocks - 1} (where stages 1..{num_stages - 1} start) for {num_blocks} blocks and "
                f"{num_stages} stages."
            )
        starts = [0, *points]
    ends = [*starts[1:], num_blocks]
    return [range(a, b) for a, b in zip(starts, ends)]


def local_stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages held by pipeline rank ``pp_rank``: ``pp_rank, pp_rank + pp, ...`` (looped placement)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_modules(blocks: Sequence[nn.Module], mesh, config: PipelineConfig) -> dict[int, nn.Module]:
    """This rank's stages as ``{stage_index: nn.Sequential(blocks...)}``; the blocks are shared, not copied.

    Apply tensor and data parallelism to the returned modules (or to the blocks before), then ``build_pipeline``.
    """
    pp = submesh(mesh, "pp").size()
    ranges = split_blocks(len(blocks), pp * config.stages_per_rank, config.split_points)
    local = local_stage_indices(mesh.get_local_rank("pp"), pp, config.stages_per_rank)
    return {s: nn.Sequential(*(blocks[i] for i in ranges[s])) for s in local}


class Pipeline:
    """This rank's pipeline stages and the schedule that runs them. Every rank of the mesh must step it.

    Attributes:
        modules: ``{stage_index: module}`` held by this rank.
        microbatches: microbatches per step.
        num_stages: stages in the whole pipeline.
    """

    def __init__(self, modules: dict[int, nn.Module], mesh, config: PipelineConfig, device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.modules = modules
        self.config = config
        self.pp = submesh(mesh, "pp").size()
        self.num_stages = self.pp * config.stages_per_rank
        self.microbatches = config.resolved_microbatches(self.pp)
        self._group = submesh(mesh, "pp").get_group()
        self._last_rank = dist.get_global_rank(self._group, self.pp - 1)
        self._loss_fn: Callable | None = None
        stages = [
            PipelineStage(module, index, self.num_stages, device, group=self._group)
            for index, module in sorted(modules.items())
        ]
        self.has_first = 0 in modules
        self.has_last = self.num_stages - 1 in modules
        self.schedule = _make_schedule(config.schedule, stages, self.microbatches, self._compute_loss)

    def _compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target)

    def step(self, inputs: torch.Tensor, target: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of every microbatch; gradients accumulate in the stage parameters.

        Gradients come out as for ``loss_fn`` over the whole batch, provided ``loss_fn`` averages over its
        microbatch (the schedule divides by ``microbatches``). Every rank of the pipeline group passes the same
        ``inputs`` and ``target`` (only the first / last stage read them).

        Args:
            inputs: ``[batch, ...]`` input of block 0; ``batch`` must divide by ``microbatches``.
            target: ``[batch, ...]`` target for ``loss_fn``.
            loss_fn: ``loss_fn(last_block_output, target) -> scalar``, run on the last stage.

        Returns:
            The mean microbatch loss, a detached scalar, on every rank of the pipeline group.
        """
        return self._run(inputs, target, loss_fn, train=True)

    def eval_step(self, inputs: torch.Tensor, target: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Like ``step`` without backward (validation); same return value."""
        return self._run(inputs, target, loss_fn, train=False)

    def _run(self, inputs, target, loss_fn, *, train: bool) -> torch.Tensor:
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"the batch of {inputs.shape[0]} rows does not split into {self.microbatches} equal microbatches; "
                f"make the per-rank batch size a multiple of PipelineConfig.microbatches."
            )
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if train:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            self.schedule.eval(*args, **kwargs)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.has_last else torch.zeros(())
        loss = loss.to(inputs.device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss

    def parameters(self):
        for _, module in sorted(self.modules.items()):
            yield from module.parameters()


def build_pipeline(
    modules: dict[int, nn.Module], mesh, config: PipelineConfig, device: torch.device | str = "cpu"
) -> Pipeline:
    """Wrap this rank's stage modules (from ``stage_modules``, after TP/FSDP) into stages and a schedule."""
    return Pipeline(modules, mesh, config, torch.device(device))


def _make_schedule(name: str, stages: list, microbatches: int, loss_fn: Callable):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)
