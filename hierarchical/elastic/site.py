"""One site of an elastic job: a torchft replica group whose quorum decides, step by step, which sites train.

Each site is its own job (its own ``torchrun``, its own rendezvous): its default process group holds its ranks
only, and the intra-site stages of the hierarchical all-reduce run there. Every rank holds a torchft ``Manager``
(rank 0 of the site serves the site's ``ManagerServer``, which registers with the lighthouse) whose reconfigurable
gloo group joins the ranks with the same local index in every site present: the rail. The WAN hop of
``multidc.hierarchical.all_reduce`` runs over it, chunked as configured.

A training step::

    site = ElasticSite(state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                       load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])))
    while site.step < steps:
        topology = site.start_step()      # quorum; a (re)joining site receives the live sites' state here
        loss_fn(model(x), y).backward()   # model: plain, or DDP over the site's ranks
        site.sync_gradients(model)        # average over the sites present (failures make the step be discarded)
        if site.commit():                 # this site's ranks vote together
            opt.step()
        opt.zero_grad()

A site that dies (or whose link is cut) fails the WAN transfers of the step in flight: the sites that see the failure
discard that step (``commit()`` is False; one that completed it commits, and the next quorum heals the sites behind
it from one that committed), the next quorum leaves the dead site out once the lighthouse stops hearing it, and the
others go on, averaging over the sites present. A restarted site joins at the next quorum and receives the model,
optimizer and step from a live site's same-index rank (torchft's HTTP checkpoint transport), not from storage.
A site's name is held by one member at a time: a site started while a live member of that name is in the job fails
before joining any quorum (a restart right after a crash waits until the lighthouse drops the dead member).

torchft logs at ``MULTIDC_TORCHFT_LOG_LEVEL`` (default ``warn``); each site logs one line per change of the quorum's
members (sites joined and left, the step) on its rank 0, at INFO on the ``multidc.hierarchical.elastic`` logger.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from multidc.hierarchical import _env
from multidc.hierarchical._error_feedback import refuse_sparse_per_step
from multidc.hierarchical.all_reduce import all_reduce
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.elastic._patches import wrap_quorum_client
from multidc.hierarchical.elastic.lighthouse import check_lighthouse, import_torchft
from multidc.hierarchical.elastic.members import in_quorum_twice, quorum_change, wait_for_site_name
from multidc.hierarchical.elastic.shards import local_tensor, placed_like
from multidc.hierarchical.elastic.transport import QuorumIdentity, state_server
from multidc.hierarchical.elastic.writer import CheckpointWriter, run_all
from multidc.hierarchical.stats import WanStats
from multidc.hierarchical.topology import SiteLayout, Topology

_log = logging.getLogger("multidc.hierarchical.elastic")
# The longest the name check waits for a dead member to be dropped: well under the site group's timeout (30 min),
# in which the site's other ranks wait meanwhile, and far above any lighthouse heartbeat timeout.
_NAME_WAIT_S = 300.0


class DiscardStep:
    """The failure policy of an elastic step: a failed WAN transfer is reported to the site's torchft manager instead
    of raised, so the step is discarded (by every site that sees a failure: see ``ElasticSite.commit``).

    Attributes:
        error: the step's first failure (the later ones follow from it), or None.
    """

    def __init__(self, manager, site_name: str) -> None:  # noqa: D107
        self._manager, self._site_name = manager, site_name
        self.error: Exception | None = None

    def usable(self) -> bool:
        return self._manager.errored() is None  # e.g. a failed recovery: peers time out and discard the step too

    def tolerate(self, error: Exception) -> bool:
        if self.error is None:
            _log.warning("site %r discards this step: %s", self._site_name, error)
            self.error = error
        self._manager.report_error(error)
        return True


def torchft_rail_all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> dist.Work:
    """The compressed WAN hop's all-gather over torchft's rail group, which is not in torch's group map (``dist.*``
    refuses it): called on the group directly."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    return group.allgather_into_tensor_coalesced([output], [tensor], AllgatherOptions())


def quorum_topology(manager, rail, wan: WanConfig, site_name: str, stats: WanStats, intra_group=None) -> Topology:
    """The sites of the current quorum, as the hierarchical all-reduce sees them: inside the site, the ranks of
    ``intra_group`` (default: the site's job, the default group; under a parallel layout the ranks holding this
    rank's shards); its one rail group is torchft's, reconfigured at each new quorum; the site index is the site's
    rank in the quorum, and so its rank in the rail group (torchft configures the rail with the replica rank, which
    the participating rank equals without async quorum); a failed WAN transfer discards the step (``DiscardStep``,
    the topology's ``policy``)."""
    intra_group = intra_group if intra_group is not None else dist.group.WORLD
    num_sites, per_site = manager.num_participants(), dist.get_world_size(intra_group)
    site = manager.participating_rank()
    if site is None:  # torchft leaves a group out of a quorum it asked for only in modes we do not use
        raise RuntimeError(f"site {site_name!r} is not in the quorum it joined; torchft's world-size mode must be "
                           f"DYNAMIC (the default).")
    layout = SiteLayout.contiguous(num_sites, per_site)
    rails = [rail] if num_sites > 1 else []
    return Topology(layout=layout, site=site, local_rank_in_site=dist.get_rank(intra_group),
                    intra_group=intra_group, rail_groups=rails,
                    rail_row=site if rails else None, wan=wan, streams=1, policy=DiscardStep(manager, site_name),
                    rail_all_gather=torchft_rail_all_gather, wan_stats=stats, site_name=site_name,
                    rail_sites=list(range(num_sites)) if rails else None)


class ElasticSite:
    """This rank's part in an elastic job. Every rank of the site builds one, after ``init_process_group`` (the
    site's own job: ``torchrun`` with its own rendezvous).

    Args:
        state_dict: what a rejoining site receives (model, optimizer, ...): called on a live site's ranks.
        load_state_dict: applies it on the rejoining site's ranks, before its first step.
        site: this site's name (default ``MULTIDC_SITE``); sites must have distinct names, and one process group
            holds a name at a time (see ``start_step``).
        wan: WAN settings of the rail hop (``timeout_s``: how long a step waits for a dead site before the step
            is discarded; ``chunk_mb``); default ``WanConfig()``. One WAN stream per rail (torchft reconfigures
            one group per rank), whatever ``streams`` says.
        lighthouse: ``host:port`` of ``multidc lighthouse`` (default ``MULTIDC_LIGHTHOUSE``).
        min_sites: sites a step needs to commit. Use a majority of the sites (and the same ``--min-sites`` on
            the lighthouse) if the lighthouse may restart mid-run: with fewer, a restarted lighthouse can form two
            quorums on the same step, and their sites' weights stay apart (docs/guides/elastic.md, "The
            lighthouse").
        sites: the sites the job starts with (default ``MULTIDC_NUM_SITES``, else 1). A site that has not trained
            with the job yet waits until it either receives the live state from a peer or, at step 0, every one of
            these sites is present: a (re)started site never trains alone beside the job.
        quorum_timeout_s: how long a quorum may take (a site starting or healing waits this long at most).
        heal_timeout_s: how long sending or receiving the live state may take (HTTP between same-index ranks of
            two sites), and how long a site's ranks wait for each other's commit vote. Larger than
            ``wan.timeout_s``, which bounds each WAN transfer of a step: a large model heals for longer.
        host: the address of this host that the other sites reach (default ``MULTIDC_ELASTIC_HOST``, else the
            host's name): torchft advertises it for the site's manager (rank 0) and for each rank's state server.
        max_failed_steps: after this many steps in a row discarded because of a failure (a WAN transfer, a
            recovery), every rank of the site raises the last failure instead of trying again; None: never.
        replica_group: the ranks of this site that hold the same parameters as this one, a parallel layout's
            ``ParallelModel.replica_group`` (FSDP2 / tensor parallelism inside the site: each rank's shards cross
            the WAN to the same-index rank of the other sites); None: every rank of the site (DDP).

    Raises:
        ImportError: torchft is missing.
        ValueError: bad settings, before connecting.
        LighthouseUnreachable: no lighthouse answers within ``quorum_timeout_s``, on every rank.
    """

    def __init__(
        self,
        *,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
        site: str | None = None,
        wan: WanConfig | None = None,
        lighthouse: str | None = None,
        min_sites: int = 1,
        sites: int | None = None,
        quorum_timeout_s: float = 120.0,
        heal_timeout_s: float = 600.0,
        max_failed_steps: int | None = 10,
        host: str | None = None,
        replica_group=None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ElasticSite needs the site's process group: call init_process_group first.")
        site = site if site is not None else _env.read(_env.SITE)
        if not site:
            raise ValueError(f"elastic sites need a name per site: pass site= or set {_env.SITE} (e.g. us-east).")
        # torchft reconfigures one group per rank: one WAN stream per rail (WanConfig.streams does not apply)
        wan = dataclasses.replace(wan if wan is not None else WanConfig(), streams=1)
        if isinstance(min_sites, bool) or not isinstance(min_sites, int) or min_sites < 1:
            raise ValueError(f"min_sites={min_sites!r} must be a positive integer.")
        sites = sites if sites is not None else (_env.read_int(_env.NUM_SITES) or 1)
        if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
            raise ValueError(f"sites={sites!r} must be a positive integer (the sites the job starts with).")
        for name, value in (("quorum_timeout_s", quorum_timeout_s), ("heal_timeout_s", heal_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be a positive number of seconds.")
        if max_failed_steps is not None and (not isinstance(max_failed_steps, int) or max_failed_steps < 1):
            raise ValueError(f"max_failed_steps={max_failed_steps!r} must be a positive integer or None.")
        self.start_sites, self._joined, self._quorum_timeout_s = sites, False, quorum_timeout_s
        self.writer = CheckpointWriter()  # who saves the job's checkpoints (is_leader, save_once)
        self._twice: tuple[list[str], bool] | None = None  # see members.in_quorum_twice: of the last quorum
        self.max_failed_steps, self._failed_steps, self._min_sites = max_failed_steps, 0, min_sites
        # the site's votes and its step-0 state go over gloo, whatever the default group's backend (NCCL)
        self._votes = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        # every rank: a lighthouse that does not answer (within the quorum timeout: it may be restarting) is a
        # clear error on each rank of the site, before torchft's manager starts
        url = check_lighthouse(lighthouse, timeout_s=quorum_timeout_s)
        import_torchft()  # a clear ImportError before anything starts
        from torchft.process_group import ProcessGroupGloo

        self.name = str(site)
        self.wan = wan
        self.wan_stats = WanStats()
        self.rail = ProcessGroupGloo(timeout=datetime.timedelta(seconds=wan.timeout_s))
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        host = advertised_host(host)
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 literal in a URL
        heal_timeout = datetime.timedelta(seconds=max(heal_timeout_s, wan.timeout_s))
        self._transport = transport = state_server(host, heal_timeout, wan.timeout_s)
        self._manager_options = dict(
            pg=self.rail, state_dict=self._send_state, load_state_dict=self._receive_state, min_replica_size=min_sites,
            hostname=host, checkpoint_transport=transport,
            use_async_quorum=False, timeout=heal_timeout,
            quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s), lighthouse_addr=url, replica_id=self.name,
            # the site's manager retries an unreachable lighthouse about once a second (a restart, a flap)
            # instead of failing the quorum at the first refused connection
            quorum_retries=max(1, int(quorum_timeout_s)),
            rank=dist.get_rank(), world_size=dist.get_world_size(),
        )
        self._manager, self._resumed_at = None, 0
        self.replica_group = replica_group
        self.intra_group = replica_group
        """The site's group for the intra-site stages of the WAN all-reduces; None: the default group. An
        all-reduce that runs while the site trains on (overlapped DiLoCo) needs one of its own, apart from DDP's."""
        self.topology: Topology | None = None

    @property
    def manager(self):
        """The site's torchft ``Manager``, started at the first ``start_step()`` (or here, if read before it).

        Not at construction: its server (rank 0) heartbeats to the lighthouse from its start, and a new quorum
        waits for every heartbeating site to ask to join. A site built in a framework's setup (data loaders, a
        validation sanity check before the first step) would hold the other sites' quorums meanwhile (observed: a
        one-site job's first quorum, until its quorum timeout)."""
        if self._manager is None:
            manager = import_torchft().Manager(**self._manager_options)
            wrap_quorum_client(manager, lambda client: QuorumIdentity(client, on_quorum=self._on_quorum))
            if self._resumed_at:
                manager.load_state_dict({"step": self._resumed_at, "batches_committed": manager.batches_committed()})
            self._manager = manager
        return self._manager

    def _on_quorum(self, quorum) -> None:
        """Each quorum answer (every rank): whether it makes this rank a source of the live state, and whether this
        site holds the job's latest state as the first of the sites that hold it (``is_leader``)."""
        self._transport.expect(quorum)
        change = quorum_change(self.writer.members, tuple(quorum.replica_ids))  # the last quorum's, then this one's
        self.writer.quorum(quorum)
        if change is not None and dist.get_rank() == 0:  # once per change and site, not per step
            _log.info("site %r, step %d: the quorum has %s", self.name, quorum.max_step, change)
        self._twice = in_quorum_twice(quorum)
        if self._twice is not None and not self._twice[1] and change is not None and dist.get_rank() == 0:
            _log.warning("site %r, step %d: another member of this site, %s, is in the quorum: it leaves if it is "
                         "behind the job's step, else this step counts the site twice; run one member per site",
                         self.name, quorum.max_step, ", ".join(self._twice[0]))

    def _claim(self, state: dict) -> dict:
        """What a joining site must share with the live ones: the site size, the WAN settings, tensor shapes."""
        return {"site": self.name, "site_size": dist.get_world_size(),
                "wan": {"compression": self.wan.compression, "chunk_mb": self.wan.chunk_mb},
                "tensors": dict(_tensor_shapes(state))}

    def _send_state(self) -> dict:
        state = self._state_dict()
        return {"user": state, "multidc": self._claim(state)}

    def _receive_state(self, received: dict) -> None:
        """Check the live state against this site before loading it: a site started with another model, site size
        or WAN settings fails here, with what differs, and the live sites go on without it."""
        theirs, mine = received["multidc"], self._claim(self._state_dict())
        problems = [f"{key}: {mine[key]} here, {theirs[key]} there" for key in ("site_size", "wan")
                    if mine[key] != theirs[key]]
        shapes = [f"{path} {mine['tensors'][path]} here, {theirs['tensors'][path]} there"
                  for path in mine["tensors"].keys() & theirs["tensors"].keys()
                  if mine["tensors"][path] != theirs["tensors"][path]]
        problems += [f"tensor shapes differ: {', '.join(sorted(shapes)[:5])}"] if shapes else []
        self.writer.healing()
        try:
            if not problems:
                self._load_state_dict(received["user"])
        except (RuntimeError, KeyError, ValueError) as exc:
            problems.append(f"the live state does not load: {exc}")
        if problems:
            raise ValueError(
                f"site {self.name!r} cannot join: it differs from site {theirs['site']!r}, which sent the live "
                f"state: {'; '.join(problems)}. Start every site with the same model, optimizer, ranks per site and "
                f"WAN settings."
            )

    @property
    def step(self) -> int:
        """Steps committed by the job so far (a rejoined site takes the live sites' count)."""
        return self._manager.current_step() if self._manager is not None else self._resumed_at

    def start_step(self) -> Topology:
        """Join this step's quorum (collective over the site, blocks until the quorum forms); a site that needs
        the live state receives it here. Returns the topology of the sites present.

        The first call, before this site registers with the lighthouse, waits while another member of the job holds
        this site's name and has been heard within the lighthouse's heartbeat timeout (a crashed one: until the
        lighthouse drops it). One still heartbeating 5 s after this site first looked is a live one: this site
        then fails, and the job goes on without noticing it.

        Raises:
            RuntimeError: (first call, every rank) a live member of the job holds this site's name; the message
                names it and its manager's address.
        """
        if self.topology is not None:
            self.topology.close()
        if self._manager is None:  # before this site registers with the lighthouse
            self._wait_for_name()
        deadline, manager, pause = time.monotonic() + self._quorum_timeout_s, self.manager, 0.1
        while True:
            try:
                manager.start_quorum()
            finally:  # a source serves its state by now, or never will: held requests need not wait longer
                self._transport.quorum_done()
            if self._twice is not None and self._twice[1]:
                self._leave_twice(manager.current_step())
            # trained with the job before, received the live state, or the job starts with every site
            ready = self._joined or manager.current_step() > 0 or manager.num_participants() >= self.start_sites
            step = manager.current_step()
            votes = _site_votes(_Vote(ready=ready, late=time.monotonic() > deadline, step=step,
                                      leads=self.writer.leads, write=self.writer.proposes_to_write(step)), self._votes)
            steps = {vote.step for vote in votes}
            ready, late = all(vote.ready for vote in votes) and len(steps) == 1, any(vote.late for vote in votes)
            self.writer.leads = all(vote.leads for vote in votes) and len(steps) == 1  # the site leads as one
            write = self.writer.leads and all(vote.write for vote in votes)
            if len(steps) > 1:  # a rank failed to heal: the whole site registers as behind, and heals next quorum
                manager.load_state_dict({"step": min(steps), "batches_committed": manager.batches_committed()})
            if ready:
                break
            if late:
                raise TimeoutError(
                    f"site {self.name!r} found no live site to join and not all {self.start_sites} sites to start "
                    f"with within {self._quorum_timeout_s:g} s (quorum of {self.manager.num_participants()}): start "
                    f"the other sites, or check that they reach the lighthouse (multidc doctor)."
                )
            # each quorum of a job that has not started sends the whole state to the sites behind its first site
            # (torchft's step-0 sync): while the others are awaited, not ten times a second
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2.0, pause * 2)
        deferred = self.writer.settle(write)
        # the same on every rank of the site: one step everywhere, one quorum
        if manager.current_step() == 0 and manager.num_participants() > 1 and self._replicas() > 1:
            self._share_in_site()
        self._joined = True
        self.topology = quorum_topology(self.manager, self.rail, self.wan, self.name, self.wan_stats,
                                        self.intra_group)
        if deferred:
            _log.info("site %r writes the checkpoint of step %d: the first site of that step's quorum discarded it",
                      self.name, manager.current_step())
            run_all(deferred)
        return self.topology

    def _leave_twice(self, step: int) -> None:
        """Leave the job, on every rank of the site (they all read the same quorum answer): its quorum holds another
        member of this site's name (see ``members.in_quorum_twice``). The manager and rails are shut down here; the
        others' transfers of this step fail when this process's connections close (at its exit at the latest, else
        after ``wan.timeout_s``), and they discard the step."""
        others = ", ".join(self._twice[0])
        self.close()
        raise RuntimeError(
            f"site {self.name!r} left the job at step {step}: its quorum also holds {others}, another member of this "
            f"site (this one is behind the job's step, or started at the same moment with a higher id). A site's name "
            f"is held by one member at a time: this process was cut off long enough for the lighthouse to drop it and "
            f"another was started in its place, or two were started at once. Check that one member of the site "
            f"trains on; start another under its own name ({_env.SITE} or site=) if you meant a new site."
        )

    def _wait_for_name(self) -> None:
        """Wait until no live member of the job holds this site's name, else raise on every rank of the site
        (collective; rank 0 asks the lighthouse, see ``multidc.hierarchical.elastic.members``)."""
        verdict, error = [None], None
        if dist.get_rank() == 0:
            try:  # the other ranks wait in the broadcast (the site's group: its timeout) for whatever happens here
                verdict[0] = wait_for_site_name(self._manager_options["lighthouse_addr"], self.name,
                                                timeout_s=min(self._quorum_timeout_s, _NAME_WAIT_S))
            except Exception as exc:  # raised below, here as it is and on the others as its text
                error = exc
                verdict[0] = f"site {self.name!r}: checking that no other member holds its name failed on rank 0: " \
                             f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(verdict, src=0, group=self._votes)
        if error is not None:
            raise error
        if verdict[0] is not None:
            raise RuntimeError(verdict[0])

    @torch.no_grad()
    def sync_gradients(self, module: torch.nn.Module) -> None:
        """Average the gradients of ``module``'s trainable parameters over the sites of this step, in place
        (parameter order, so every site lays them out alike). Under ``DistributedDataParallel`` over the site's
        group, DDP has already averaged them inside the site: then each rank sends only its share over its rail
        (``replicated``). Under a parallel layout (``replica_group``) FSDP2 has reduced them inside the site: each
        rank's shards go to the same-index ranks of the other sites. Otherwise the whole hierarchical average
        (inside the site, then across). A failed WAN transfer does not raise: the step will not commit.

        As under DDP, a parameter without a gradient counts as zeros in the average, and keeps no gradient only
        if no rank of any site has one (found by a small uncompressed exchange, skipped under DDP without
        ``find_unused_parameters``, where every parameter has a gradient).

        Not a DDP communication hook: a site that rejoins starts DDP afresh, and DDP re-buckets gradients after
        its first step, so bucket layouts would differ between sites.
        """
        assert self.topology is not None, "start_step() first"
        refuse_sparse_per_step(self.wan.compression, "ElasticSite.sync_gradients (elastic per-step sync)")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            return
        grads = [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p)) for p in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        ddp = isinstance(module, torch.nn.parallel.DistributedDataParallel)
        # DDP, or FSDP2 inside the site (a layout's reduce-scatter and replica hook): the replicas hold the site's
        # average already, and each sends its share
        all_reduce(flat, self.topology, op="avg", replicated=ddp or self.replica_group is not None)
        used = [True] * len(params)
        if not ddp or module.find_unused_parameters:
            present = torch.tensor([float(p.grad is not None) for p in params], device=flat.device)
            all_reduce(present, self.topology, wan=dataclasses.replace(self.wan, compression="none"), op="sum")
            used = (present > 0).tolist()
        offset = 0
        for p, grad, has_grad in zip(params, grads, used, strict=True):
            values = flat[offset : offset + grad.numel()].view_as(grad)
            if not has_grad:
                p.grad = None
            elif p.grad is None:
                p.grad = placed_like(p, values.clone())
            else:
                grad.copy_(values)
            offset += grad.numel()

    @property
    def is_leader(self) -> bool:
        """Whether this site saves the job's checkpoints now: at most one site per committed step, the same answer
        on every rank of the site. The rule: ``multidc.hierarchical.elastic.writer``."""
        return self.writer.leads

    def save_once(self, save: Callable[[], object]) -> None:
        """Run ``save`` (a checkpoint of the job's current state; every rank of the site calls this alike, on every
        site) on exactly one site of the job: now on the leader, or, when the step's quorum's first site may have
        discarded the step, on the first of the sites that committed it at the next ``start_step()`` (its errors
        raise there). The rule: ``multidc.hierarchical.elastic.writer``.

        A deferred ``save`` reads the state when it runs: take what may change before the next ``start_step()``
        (random streams, counters, the data position) at the call, as the Lightning strategies and
        ``MultiDCAccelerator.save_state`` do; the weights and the optimizer state do not change before it (the next
        optimizer step comes after it). It runs while the other sites wait in the step's first WAN transfer: a
        synchronous save that takes longer than ``wan.timeout_s`` fails that step everywhere (save asynchronously:
        the upload then goes on in the background). The job's last step has no next quorum: its save is written
        only if the first site of its quorum committed it (the others drop theirs, logged)."""
        self.writer.save_once(save)

    def resume(self, step: int) -> None:
        """This site's state was loaded from a checkpoint of the job's step ``step``: call before the first
        ``start_step`` (every rank of the site). The first quorum then gives the live sites' state to this site if
        they are further on, and this site's state to sites that start from scratch or are behind; one site
        resuming is enough.

        Raises:
            RuntimeError: called after the site joined the job.
        """
        if self._joined:
            raise RuntimeError("ElasticSite.resume(step) comes before the first start_step(): this site has joined "
                               "(load checkpoints before the first quorum).")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be the checkpoint's step, a non-negative integer.")
        self._resumed_at = step
        if self._manager is not None:
            self._manager.load_state_dict({"step": step, "batches_committed": self._manager.batches_committed()})

    @property
    def num_sites(self) -> int:
        """Sites in this step's quorum."""
        return self.topology.num_sites if self.topology is not None else 0

    def all_reduce(self, tensor: torch.Tensor, *, op: str = "avg") -> torch.Tensor:
        """Hierarchical all-reduce of ``tensor`` over the sites of this step, in place (``op`` ``"avg"``: over
        every rank present). A failed WAN transfer does not raise: the step will not commit. Every rank of the
        site does the intra-site stages, also after an error on one of them, so the site stays in step."""
        assert self.topology is not None, "start_step() first"
        all_reduce(tensor, self.topology, op=op)
        return tensor

    def _replicas(self) -> int:
        """Ranks of this site holding the same parameters as this one (``replica_group``'s, else the site's)."""
        return dist.get_world_size(self.replica_group) if self.replica_group is not None else dist.get_world_size()

    def _share_in_site(self) -> None:
        """At step 0 torchft makes the sites equal rank by rank, each rank index from its own source site (its
        first quorum spreads the sources over the sites), so the replicas inside one site can hold different sites'
        initial weights: every rank takes the state of its replicas' first rank, the same in every site. (Shards
        held once per site need nothing: each came from one site, the same in every site.)"""
        group = self.replica_group if self.replica_group is not None else self._votes
        first = dist.get_global_rank(group, 0) if self.replica_group is not None else 0
        box = [_to_cpu(self._state_dict()) if dist.get_rank() == first else None]
        dist.broadcast_object_list(box, src=first, group=group)
        if dist.get_rank() != first:
            self._load_state_dict(box[0])

    def commit(self) -> bool:
        """Whether every rank of this site may apply this step (collective over the site: the site's ranks vote
        together). Each site decides from what it saw: when a transfer fails on one site only, another may commit
        the step; the next quorum then heals the site that is behind from one that committed it.

        Raises:
            RuntimeError: ``max_failed_steps`` steps in a row were discarded because of a failure.
        """
        committed = self.manager.should_commit()
        first_site = self.topology is not None and self.topology.site == 0
        self.writer.commit(committed, first_site, self.manager.current_step())
        # the site's vote and quorum are the same on every rank: its ranks count (and raise) together
        failed = not committed and self.manager.num_participants() >= self._min_sites
        self._failed_steps = self._failed_steps + 1 if failed else 0
        if self.max_failed_steps is not None and self._failed_steps >= self.max_failed_steps:
            failure = (self.topology.policy.error if self.topology is not None else None) or self.manager.errored()
            failure = failure or "on another rank of this site"
            raise RuntimeError(
                f"site {self.name!r}: {self._failed_steps} steps in a row failed and were discarded (max_failed_steps="
                f"{self.max_failed_steps}); the last failure: {failure}. Check the WAN between the sites (multidc "
                f"doctor) and the other sites' logs."
            )
        return committed

    def close(self) -> None:
        """Stop the site's manager (its server on rank 0) and the topology's worker."""
        self.writer.drop(self.name, self.step)
        if self.topology is not None:
            self.topology.close()
        if self._manager is not None:
            self._manager.shutdown(wait=False)  # and its state server
        else:  # never started: the state server (built here, a socket and its thread) is the manager's to stop
            self._transport.shutdown(wait=False)
        # torchft's gloo group is not in torch's group map, so destroy_process_group() leaves it to interpreter exit,
        # where gloo's worker threads still hold finished work whose tensors need the GIL: the process then aborts
        # ("terminate called without an active exception", SIGABRT; seen in the test suite). Drop it now.
        self.rail.shutdown()


def advertised_host(host: str | None = None) -> str:
    """The address other sites reach this host at: ``host``, else ``MULTIDC_ELASTIC_HOST``, else the host's name."""
    return host or _env.read(_env.ELASTIC_HOST) or socket.gethostname()


class _Vote(NamedTuple):
    """A rank's vote after a quorum; the site decides from every rank's."""

    ready: bool
    """Trained with the job before, received the live state, or the job starts with every site."""
    late: bool
    """Waited past ``quorum_timeout_s`` for that."""
    step: int
    """The job's step this rank is at (a rank that failed to heal is behind)."""
    leads: bool
    """This site leads after the quorum (``CheckpointWriter.leads``)."""
    write: bool
    """The saves this site kept are its to write (``CheckpointWriter.proposes_to_write``)."""


def _site_votes(vote: _Vote, group) -> list[_Vote]:
    """Every rank's ``vote``, so that the site's ranks decide alike (collective over the site)."""
    votes: list = [None] * dist.get_world_size()
    dist.all_gather_object(votes, tuple(vote), group=group)
    return [_Vote(*v) for v in votes]


def _to_cpu(value, *, copy: bool = False):
    """A nested state with its tensors on the CPU (so any rank can unpickle it); ``copy``: CPU tensors copied too
    (a snapshot that later in-place updates do not change)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, dict):
        return {key: _to_cpu(item, copy=copy) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_to_cpu(item, copy=copy) for item in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _tensor_shapes(value, path: str = ""):
    """``(path, (shape, dtype))`` of every tensor in a nested state dict."""
    if isinstance(value, torch.Tensor):
        yield path, (tuple(value.shape), str(value.dtype))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensor_shapes(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensor_shapes(item, f"{path}.{index}")
