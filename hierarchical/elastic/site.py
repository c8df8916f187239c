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
        if site.commit():                 # every site present agrees, or every one discards the step
            opt.step()
        opt.zero_grad()

A site that dies (or whose link is cut) fails the WAN transfers of the step in flight: every site discards that
step (``commit()`` is False), the next quorum leaves the dead site out once the lighthouse stops hearing it, and the
others go on, averaging over the sites present. A restarted site joins at the next quorum and receives the model,
optimizer and step from a live site's same-index rank (torchft's HTTP checkpoint transport), not from storage.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from multidc.hierarchical import _env
from multidc.hierarchical.all_reduce import all_reduce
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.elastic.lighthouse import import_torchft, lighthouse_url
from multidc.hierarchical.errors import WanError
from multidc.hierarchical.stats import WanStats
from multidc.hierarchical.topology import SiteLayout, Topology


class ElasticTopology(Topology):
    """The sites of the current quorum, as the hierarchical all-reduce sees them. This site's job is the default
    group; its one rail group is torchft's, reconfigured at each new quorum; the site index is the site's rank in
    the quorum. A failed WAN transfer is reported to the manager instead of raised, so the step is discarded."""

    def __init__(self, manager, rail, wan: WanConfig, site_name: str, stats: WanStats) -> None:  # noqa: D107
        num_sites, per_site = manager.num_participants(), dist.get_world_size()
        self.layout = SiteLayout(
            site_ranks=tuple(tuple(range(s * per_site, (s + 1) * per_site)) for s in range(num_sites)),
            site_names=tuple(str(s) for s in range(num_sites)),
        )
        self.group = None
        self.wan = wan
        self.streams = 1
        self.wan_stats = stats
        self._lock = threading.Lock()
        self._executor = None
        self._manager = manager
        self.site = manager.participating_rank()
        if self.site is None:  # torchft leaves a group out of a quorum it asked for only in modes we do not use
            raise RuntimeError(f"site {site_name!r} is not in the quorum it joined; torchft's world-size mode must "
                               f"be DYNAMIC (the default).")
        self.site_name = site_name
        self.num_sites = num_sites
        self.site_size = per_site
        self.local_rank_in_site = dist.get_rank()
        self.rank = self.site * per_site + self.local_rank_in_site
        self.intra_group = dist.group.WORLD
        self.rail_groups = [rail] if num_sites > 1 else []
        self.error: WanError | None = None

    @property
    def rail_row(self) -> int | None:
        return self.site if self.rail_groups else None

    def rail_all_gather(self, output: torch.Tensor, tensor: torch.Tensor, group) -> dist.Work:
        # torchft's group is not in torch's group map (dist.* refuses it): call it directly
        from torch.distributed.distributed_c10d import AllgatherOptions

        return group.allgather_into_tensor_coalesced([output], [tensor], AllgatherOptions())

    def wan_usable(self) -> bool:
        return self._manager.errored() is None  # e.g. a failed recovery: peers time out and discard the step too

    def tolerate_wan_error(self, error: Exception) -> bool:
        self.error = error
        self._manager.report_error(error)
        return True


class ElasticSite:
    """This rank's part in an elastic job. Every rank of the site builds one, after ``init_process_group`` (the
    site's own job: ``torchrun`` with its own rendezvous).

    Args:
        state_dict: what a rejoining site receives (model, optimizer, ...): called on a live site's ranks.
        load_state_dict: applies it on the rejoining site's ranks, before its first step.
        site: this site's name (default ``MULTIDC_SITE``); sites must have distinct names.
        wan: WAN settings of the rail hop (``timeout_s``: how long a step waits for a dead site before the step
            is discarded; ``chunk_mb``); default ``WanConfig()``. One WAN stream per rail (torchft reconfigures
            one group per rank), whatever ``streams`` says.
        lighthouse: ``host:port`` of ``multidc lighthouse`` (default ``MULTIDC_LIGHTHOUSE``).
        min_sites: sites a step needs to commit.
        sites: the sites the job starts with (default ``MULTIDC_NUM_SITES``, else 1). A site that has not trained
            with the job yet waits until it either receives the live state from a peer or, at step 0, every one of
            these sites is present: a (re)started site never trains alone beside the job.
        quorum_timeout_s: how long a quorum may take (a site starting or healing waits this long at most).

    Raises:
        ImportError: torchft is missing. ValueError: bad settings, before connecting.
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
        self.start_sites, self._joined, self._quorum_timeout_s = sites, False, quorum_timeout_s
        url = lighthouse_url(lighthouse)
        torchft = import_torchft()
        from torchft.process_group import ProcessGroupGloo

        timeout = datetime.timedelta(seconds=wan.timeout_s)
        self.name = str(site)
        self.wan = wan
        self.wan_stats = WanStats()
        self.rail = ProcessGroupGloo(timeout=timeout)
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.manager = torchft.Manager(
            pg=self.rail, state_dict=self._send_state, load_state_dict=self._receive_state, min_replica_size=min_sites,
            use_async_quorum=False, timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s), lighthouse_addr=url, replica_id=self.name,
            rank=dist.get_rank(), world_size=dist.get_world_size(),
        )
        self.topology: ElasticTopology | None = None

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
        return self.manager.current_step()

    def start_step(self) -> ElasticTopology:
        """Join this step's quorum (collective over the site, blocks until the quorum forms); a site that needs
        the live state receives it here. Returns the topology of the sites present."""
        if self.topology is not None:
            self.topology.close()
        deadline = time.monotonic() + self._quorum_timeout_s
        while True:
            self.manager.start_quorum()
            if self._joined or self.manager.current_step() > 0 or self.manager.num_participants() >= self.start_sites:
                break  # trained with the job before, received the live state, or the job starts with every site
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"site {self.name!r} found no live site to join and not all {self.start_sites} sites to start "
                    f"with within {self._quorum_timeout_s:g} s (quorum of {self.manager.num_participants()}): start "
                    f"the other sites, or check that they reach the lighthouse (multidc doctor)."
                )
            time.sleep(0.1)
        self._joined = True
        self.topology = ElasticTopology(self.manager, self.rail, self.wan, self.name, self.wan_stats)
        return self.topology

    def sync_gradients(self, module: torch.nn.Module) -> None:
        """Average the gradients of ``module``'s trainable parameters over the sites of this step, in place
        (parameter order, so every site lays them out alike). Under ``DistributedDataParallel`` over the site's
        group, DDP has already averaged them inside the site: then each rank sends only its share over its rail
        (``replicated``). Otherwise the whole hierarchical average (inside the site, then across). A failed WAN
        transfer does not raise: the step will not commit.

        Not a DDP communication hook: a site that rejoins starts DDP afresh, and DDP re-buckets gradients after
        its first step, so bucket layouts would differ between sites.
        """
        assert self.topology is not None, "start_step() first"
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        site_averaged = isinstance(module, torch.nn.parallel.DistributedDataParallel)
        all_reduce(flat, self.topology, op="avg", replicated=site_averaged)
        offset = 0
        for p in params:
            values = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = values.clone()
            else:
                p.grad.copy_(values)
            offset += p.numel()

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

    def commit(self) -> bool:
        """Whether every rank of every site present may apply this step (collective over the site)."""
        return self.manager.should_commit()

    def close(self) -> None:
        """Stop the site's manager (its server on rank 0) and the topology's worker."""
        if self.topology is not None:
            self.topology.close()
        self.manager.shutdown(wait=False)


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
