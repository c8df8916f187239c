"""A DDP communication hook that sends each gradient bucket through the hierarchical all-reduce."""

# No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` compares the hook's annotations
# with the real ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects and rejects strings.

import torch
import torch.distributed as dist

from multidc.hierarchical._error_feedback import ErrorFeedback, default_error_feedback, refuse_sparse_per_step
from multidc.hierarchical.all_reduce import _check, submit
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.topology import Topology


class HierarchicalHookState:
    """State of one registered hook: the topology, the WAN settings and per-bucket error-feedback residuals.

    With error feedback, each rank keeps, for every bucket, what WAN compression dropped from the shards it
    sent, and adds it to the next step's shards, so the compression error does not accumulate over steps.
    """

    def __init__(self, topology: Topology, wan: WanConfig, error_feedback: bool) -> None:
        self.topology = topology
        self.wan = wan
        self.error_feedback = error_feedback
        self._feedback = ErrorFeedback(topology, wan)
        self.residuals: dict[int, torch.Tensor] = self._feedback.residuals

    def _residual(self, bucket: dist.GradBucket) -> torch.Tensor | None:
        """This rank's float32 error-feedback buffer for ``bucket``, zeroed when the bucket is new or changed."""
        if not self.error_feedback:
            return None
        # DDP rebuilds its buckets after the first step (in gradient-ready order): the same index can then
        # hold other parameters, even at the same size, and an old residual would land on the wrong elements.
        params = tuple(id(p) for p in bucket.parameters())
        return self._feedback.residual(bucket.index(), bucket.buffer(), owners=params)


def hierarchical_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over all ranks hierarchically; the future resolves to the bucket's buffer."""
    buffer = bucket.buffer()
    return submit(buffer, state.topology, state.wan, op="avg", residual=state._residual(bucket))


def register_ddp_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    topology: Topology,
    *,
    wan: WanConfig | None = None,
    error_feedback: bool | None = None,
) -> HierarchicalHookState:
    """Route every gradient bucket of ``ddp_model`` through ``all_reduce`` (``op="avg"``), asynchronously.

    Communication overlaps backward: each bucket is queued as soon as DDP hands it over. Call once, before the
    first backward, on every rank.

    Args:
        ddp_model: a ``DistributedDataParallel`` model over the same ranks as ``topology``.
        topology: from ``Topology.build``.
        wan: WAN settings; default ``topology.wan`` (agreed by every rank in ``Topology.build``).
        error_feedback: keep per-bucket compression residuals; default on for ``int8`` and ``int4``, off otherwise.

    Returns:
        The hook state (its ``residuals`` are inspectable).
    """
    wan = _check(torch.empty(0), topology, wan, "avg")
    refuse_sparse_per_step(wan.compression, "register_ddp_hook")
    wan.refuse_auto("register_ddp_hook (hierarchical DDP's per-step all-reduce)")
    _check_spans(ddp_model, topology)
    if error_feedback is None:
        error_feedback = default_error_feedback(wan.compression)
    state = HierarchicalHookState(topology, wan, error_feedback)
    ddp_model.register_comm_hook(state, hierarchical_hook)
    return state


def _check_spans(ddp_model: torch.nn.parallel.DistributedDataParallel, topology: Topology) -> None:
    ddp_ranks = sorted(dist.get_process_group_ranks(ddp_model.process_group))
    topology_ranks = sorted(
        dist.get_process_group_ranks(topology.group) if topology.group is not None else range(dist.get_world_size())
    )
    if ddp_ranks != topology_ranks:
        raise ValueError(
            f"the DDP model spans {len(ddp_ranks)} ranks {_short(ddp_ranks)} but the topology spans "
            f"{len(topology_ranks)} ranks {_short(topology_ranks)}; build the topology over the DDP model's "
            f"process group (Topology.build(group=...))."
        )


class SiteHookState:
    """The group a site-only DDP hook averages over: a group of its own, not ``topology.intra_group``, so DiLoCo's
    syncs (issued on the topology's worker thread over its groups) never interleave with inner-step traffic."""

    def __init__(self, topology: Topology) -> None:
        members = dist.get_process_group_ranks(topology.group) if topology.group is not None else None
        self.group = None
        for ranks in topology.layout.site_ranks:  # torch creates groups collectively: every rank, every site
            group = dist.new_group([members[r] for r in ranks] if members else list(ranks))
            if topology.rank in ranks:
                self.group = group
        self.size = topology.site_size


def site_hook(state: SiteHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks of this site only; nothing crosses the WAN."""
    buffer = bucket.buffer().div_(state.size)
    if state.size == 1:
        future = torch.futures.Future()
        future.set_result(buffer)
        return future
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_site_ddp_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, topology: Topology) -> SiteHookState:
    """Average every gradient bucket of ``ddp_model`` inside its site only, over a group made for it.

    For DiLoCo: each site trains as ordinary DDP over its own ranks while the model's process group still spans
    every site (so DDP's start-up broadcast makes all sites start equal). Collective: call once on every rank
    of the default group (the site groups are created here), before the first backward; ``ddp_model`` must
    span the topology's ranks.
    """
    _check_spans(ddp_model, topology)
    state = SiteHookState(topology)
    ddp_model.register_comm_hook(state, site_hook)
    return state


def release_reducer(ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Free ``ddp_model``'s C++ reducer and logger now, so its process group is not last released by them.

    Why: DDP's reducer holds the process group from C++ and is freed with the GIL held. When the reducer is the
    group's last holder (Accelerate's ``end_training`` destroys the group while the user's model lives on), the
    gloo group's destructor joins its worker threads under the GIL; a worker still releasing finished work (the
    output of the last ``gather`` under the last barrier) needs the GIL to free that tensor, and the rank hangs at
    exit forever. Freed here, while the group is still registered, the reducer is never the last holder; the group
    is then freed from Python, where torch releases the GIL first.

    Call on every rank after the last backward and before the process group is destroyed. Afterwards the DDP
    wrapper cannot run forward or backward (it raises saying so); its ``module`` is unchanged.
    """
    for name in ("logger", "reducer"):  # the logger holds the reducer
        if not isinstance(getattr(ddp_model, name, None), _Released):
            setattr(ddp_model, name, _Released(name))


class _Released:
    """Stands in for a DDP wrapper's freed reducer / logger: any use says what happened."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        raise RuntimeError(
            f"this DistributedDataParallel model's {self._name} was freed when training ended (end_training / "
            f"teardown), together with its process group; use the unwrapped model (accelerator.unwrap_model(model) "
            f"or model.module) after training."
        )


def _short(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
