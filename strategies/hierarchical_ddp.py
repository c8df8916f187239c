"""``HierarchicalDDPStrategy``: Lightning's DDP, with each gradient bucket averaged inside its site first and then
across sites over the WAN (chunked, optionally compressed), via ``multidc.hierarchical.register_ddp_hook``.

Importing ``multidc.strategies`` registers ``"hierarchical_ddp"`` and ``"hierarchical_ddp_spawn"`` with
Lightning's ``StrategyRegistry`` (Trainer) and Fabric's ``STRATEGY_REGISTRY`` (see ``multidc.strategies._registry``);
with a string name the site layout and WAN settings come from ``MULTIDC_NUM_SITES`` / ``MULTIDC_SITE`` /
``MULTIDC_WAN_*``.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import _env
from multidc.hierarchical._compat import destroy_process_groups_at_exit
from multidc.hierarchical._gradient_sync import HasGradientSync
from multidc.hierarchical.config import WanConfig

try:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "multidc's Lightning strategies need Lightning: pip install 'multidc[lightning]' (lightning>=2.5,<2.7)."
    ) from exc

from multidc.strategies._checkpointing import CheckpointingMixin
from multidc.strategies._cross_site import CrossSiteMixin
from multidc.strategies._registry import register as _register
from multidc.strategies._registry import register_all
from multidc.strategies._wan_metrics import WanMetricsCallback

# DDPStrategy arguments that would install a second comm hook; DDP accepts only one per model.
_HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class _HierarchicalSync(HasGradientSync):
    """What both strategies share: the site settings; what crosses the WAN is the ``CrossSite`` sync
    ``gradient_sync`` (``multidc.hierarchical.cross_site_sync``)."""

    _diloco_arg = None  # DiLoCoStrategy's DiLoCoConfig

    def _init_sites(self, num_sites: int | None, site: int | str | None, wan: WanConfig | None,
                    elastic: bool | None, lighthouse: str | None) -> None:
        self.num_sites = _resolve_num_sites(num_sites)
        self.site = site
        self._init_cross_site(wan=wan, diloco=self._diloco_arg, elastic=elastic, lighthouse=lighthouse, site=site,
                              sites=self.num_sites)

    @property
    def wan(self) -> WanConfig:
        """The WAN settings (``wan=``, default ``WanConfig()``, env ``MULTIDC_WAN_*``)."""
        return self.gradient_sync.wan

    def _check_site_split(self, world_size: int) -> None:
        # Fails in the launching process, before any rank starts, for the one layout known there: contiguous
        # equal blocks. Explicit per-node sites (MULTIDC_SITE / site=) are checked collectively at setup.
        if self.num_sites is None or self.site is not None or _env.read(_env.SITE) is not None:
            return
        if world_size % self.num_sites:
            raise ValueError(
                f"{world_size} ranks (devices x num_nodes) cannot be split into num_sites={self.num_sites} equal "
                f"contiguous sites (num_sites / {_env.NUM_SITES}); use a num_sites that divides {world_size}, or "
                f"set {_env.SITE} on each node for unequal sites."
            )

    def _configure_launcher(self) -> None:
        if not self.elastic:  # elastic: this job is one site; num_sites counts the jobs
            self._check_site_split(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _build_topology(self) -> None:
        # collective; every rank reaches it in setup_environment (an elastic site builds none: its quorum decides)
        self.gradient_sync.build_topology(num_sites=self.num_sites, site=self.site)


class HierarchicalDDPStrategy(CrossSiteMixin, _HierarchicalSync, CheckpointingMixin, DDPStrategy):
    """Lightning ``DDPStrategy`` whose gradient all-reduce is hierarchical: site first, then the WAN.

    Checkpoints go through multidc's ``Checkpointer`` to any fsspec URL (``default_root_dir`` /
    ``ModelCheckpoint(dirpath=...)`` / ``ckpt_path`` may be ``s3://...``): every rank uploads a stripe of the
    replicated state, one copy is stored, a commit marker makes it loadable, and it loads into another world size
    or site layout; ``ckpt_path="last"`` is the newest committed one (see ``multidc.strategies._checkpointing``).
    Everything else is Lightning's DDP (launchers, ``no_sync`` during gradient accumulation). The
    WAN figures of every optimizer step are logged with ``LightningModule.log``: ``wan/bytes_sent``,
    ``wan/comm_s``, and ``wan/MBps`` / ``wan/wait_s`` also in the progress bar (see ``WanStepMeter``), as this
    rank sees them (rank 0's in the logger).

    Args:
        num_sites: sites as contiguous equal blocks of ranks; default env ``MULTIDC_NUM_SITES``, else 1 site
            unless ``MULTIDC_SITE`` is set per node (see ``multidc.hierarchical.Topology.build``).
        site: this process's site index or name; default env ``MULTIDC_SITE``.
        wan: WAN settings; default ``WanConfig()`` (env ``MULTIDC_WAN_*``).
        checkpoint_async: upload checkpoints in the background (training blocks only for the host copy); the next
            save and the end of ``fit`` wait for it and raise its error.
        checkpoint_storage_options: fsspec / s3fs options for checkpoints (``endpoint_url``, ``key``, ...), or
            for checkpoint paths with ``{site}`` (one store per site) a mapping site -> options; default env
            ``MULTIDC_CKPT_STORAGE_OPTIONS`` (JSON), else the standard AWS environment / config. Never logged.
        checkpoint_replicas: with one checkpoint store per site (a ``{site}`` or mapping path), how many other
            regions also hold each site's own state, for a load after its region is lost (``Checkpointer``'s
            ``replicas``); default env ``MULTIDC_CKPT_REPLICAS``, else 0.
        elastic: elastic sites on torchft (default env ``MULTIDC_ELASTIC``): this Trainer is one site (launch one
            job per site, each with its own rendezvous; ``site`` / ``MULTIDC_SITE`` names it, ``num_sites`` /
            ``MULTIDC_NUM_SITES`` counts the sites the job starts with); a failed site leaves the others
            training and rejoins live when restarted (see ``multidc.strategies._cross_site``). Checkpoints are written
            once per save, by the first site of the step's quorum; no gradient accumulation in this mode.
        lighthouse: the torchft lighthouse's ``host:port`` (default ``MULTIDC_LIGHTHOUSE``), elastic mode only.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``timeout``,
            ``process_group_backend``, ``find_unused_parameters``, ...). Comm-hook arguments are rejected:
            this strategy installs its own. A ``checkpoint_io`` (here or in ``Trainer(plugins=...)``) brings back
            Lightning's single-file checkpoints written by rank 0.

    Raises:
        ValueError: bad settings, at construction; a layout that cannot split the ranks, at ``Trainer(...)``
            (contiguous sites) or on every rank at setup, before any training collective.
    """

    strategy_name = "hierarchical_ddp"

    def __init__(
        self,
        *,
        num_sites: int | None = None,
        site: int | str | None = None,
        wan: WanConfig | None = None,
        checkpoint_async: bool = False,
        checkpoint_storage_options: dict | None = None,
        checkpoint_replicas: int | None = None,
        elastic: bool | None = None,
        lighthouse: str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        _reject_hook_args(ddp_kwargs)
        super().__init__(**ddp_kwargs)
        self._init_sites(num_sites, site, wan, elastic, lighthouse)
        self._init_checkpointing(checkpoint_async, checkpoint_storage_options, checkpoint_replicas)
        self._user_checkpoint_io = self._checkpoint_io is not None

    def _sharded_checkpoints(self) -> bool:
        return not self._user_checkpoint_io  # a user's CheckpointIO: Lightning's rank-0 single-file checkpoints

    @property
    def checkpoint_io(self):
        return DDPStrategy.checkpoint_io.fget(self)  # the getter installs a default CheckpointIO: not the user's

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:  # Trainer(plugins=[SomeCheckpointIO()]) arrives here
        self._checkpoint_io = io
        self._user_checkpoint_io = io is not None

    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_process_groups_at_exit()  # Lightning does so for NCCL only; gloo aborts at exit without it
        self._build_topology()

    def _register_ddp_hooks(self) -> None:
        # Lightning registers user comm hooks on CUDA only; the hierarchical hook runs on every device type.
        assert isinstance(self.model, DistributedDataParallel)
        self.gradient_sync.attach_ddp(self.model)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._attach_sync(trainer)
        WanMetricsCallback.add_to(trainer, self)

    def teardown(self) -> None:
        WanMetricsCallback.remove_from(self.lightning_module)
        try:
            self._close_sync()  # the worker thread; groups stay valid and the next fit reuses them
        finally:
            super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        _register_ddp_names(strategy_registry, cls)


class HierarchicalDDPFabricStrategy(_HierarchicalSync, _FabricDDPStrategy):
    """Fabric ``DDPStrategy`` with the hierarchical gradient all-reduce; see ``HierarchicalDDPStrategy``.

    Fabric has no automatic logging: log ``fabric.strategy.wan_metrics()`` yourself once per optimizer step,
    e.g. ``fabric.log_dict(fabric.strategy.wan_metrics())``.

    ``elastic=True`` (env ``MULTIDC_ELASTIC=1``): this Fabric job is one site of an elastic job (launch one per site,
    each with its own rendezvous); the sites present average every step's gradients (DDP averages inside the site)
    and a failed site rejoins live when restarted. The step's quorum forms at ``fabric.strategy.job_step`` or the
    model's first training forward of the step, whichever comes first (a site that is behind receives the live
    model, optimizer and ``elastic_state`` there); ``optimizer.step()`` steps only if the step commits
    (``fabric.strategy.elastic_committed``: step your LR schedulers only then). Loop on ``job_step``, read once per
    step at its top (a read after a step starts the next step's quorum), which a rejoined site takes from the live
    ones. One model and one optimizer (``fabric.setup(model, optimizer)``). Call ``fabric.strategy.teardown()``
    when training ends to leave the job (Fabric never calls it; multidc also does at interpreter exit).

    Args:
        num_sites: as for ``HierarchicalDDPStrategy`` (elastic: the sites the job starts with).
        site: as for ``HierarchicalDDPStrategy`` (elastic: this site's name).
        wan: as for ``HierarchicalDDPStrategy``.
        elastic: elastic sites on torchft (default env ``MULTIDC_ELASTIC``).
        lighthouse: the torchft lighthouse's ``host:port`` (default ``MULTIDC_LIGHTHOUSE``), elastic mode only.
        **ddp_kwargs: passed to Fabric's ``DDPStrategy``.
    """

    def __init__(
        self,
        *,
        num_sites: int | None = None,
        site: int | str | None = None,
        wan: WanConfig | None = None,
        elastic: bool | None = None,
        lighthouse: str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(**ddp_kwargs)
        self._init_sites(num_sites, site, wan, elastic, lighthouse)
        self.elastic_state: dict[str, Any] = {}
        """Elastic mode: more objects with ``state_dict()`` / ``load_state_dict()`` (LR schedulers) that a
        (re)joining site receives with the model and optimizer; fill it before the first step."""
        self._sync_models: list[DistributedDataParallel] = []
        self._sync_optimizers: list[torch.optim.Optimizer] = []
        self._hook, self._joined, self._open = None, False, False

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        destroy_process_groups_at_exit()
        self._build_topology()

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        ddp_model = super().setup_module(module)
        self.gradient_sync.attach_ddp(ddp_model)
        self._sync_models.append(ddp_model)
        if self.gradient_sync.drives_steps and self._hook is None:  # the step's quorum at its first training forward
            self._hook = ddp_model.register_forward_pre_hook(self._before_forward, prepend=True)
        return ddp_model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        sync = self.gradient_sync
        self._sync_optimizers.append(optimizer)  # elastic: one model and one optimizer, else attach says what is wrong
        sync.attach(self._sync_models, self._sync_optimizers, carry=self.elastic_state)
        if sync.drives_steps:
            # Fabric never tears its strategy down: leave the job at exit at the latest (a torchft group left to
            # interpreter shutdown aborts the process; see ElasticSite.close)
            atexit.register(self._close_sync)
        return optimizer

    @property
    def job_step(self) -> int:
        """Elastic mode: the job's committed steps; the first read of a step joins its quorum (collective over the
        site: read it on every rank, once per step, at its top)."""
        if self.elastic_sync is None:
            raise RuntimeError("job_step is the elastic job's step: build the strategy with elastic=True (or "
                               "MULTIDC_ELASTIC=1) and set up the model and its optimizer first (fabric.setup).")
        self._start_step()
        return self.elastic_sync.job_step

    def _before_forward(self, module, _args) -> None:
        if self.elastic_sync is not None and module.training and torch.is_grad_enabled():
            with torch.inference_mode(False):
                self._start_step()

    def _start_step(self) -> None:
        sync = self.elastic_sync
        if self._open:
            return
        if self._joined:
            sync.after_step()
        sync.before_step()
        self._joined = self._open = True

    def backward(self, tensor: torch.Tensor, module: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        self.gradient_sync.backward_done()

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        sync = self.elastic_sync
        if sync is None:  # the sync's work runs in hooks
            return super().optimizer_step(optimizer, **kwargs)
        if not self._open:
            raise RuntimeError("elastic mode: optimizer.step() without a training forward (or job_step) since the "
                               "last step: every step's gradients come from a forward after its quorum.")
        self._open = False
        sync.after_backward(self._sync_models[0])
        self.elastic_committed = sync.commit()
        return super().optimizer_step(optimizer, **kwargs) if self.elastic_committed else None

    def _close_sync(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        atexit.unregister(self._close_sync)
        self._sync_models, self._sync_optimizers = [], []
        self.gradient_sync.close()

    def teardown(self) -> None:
        try:
            self._close_sync()
        finally:
            super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        _register_ddp_names(strategy_registry, cls)


def _resolve_num_sites(num_sites: int | None) -> int | None:
    source = "num_sites"
    if num_sites is None:
        num_sites, source = _env.read_int(_env.NUM_SITES), _env.NUM_SITES
    if num_sites is not None and (isinstance(num_sites, bool) or not isinstance(num_sites, int) or num_sites < 1):
        raise ValueError(f"{source}={num_sites!r} must be a positive integer number of sites, e.g. 2.")
    return num_sites


def _reject_hook_args(ddp_kwargs: dict) -> None:
    given = sorted(k for k in _HOOK_ARGS if ddp_kwargs.get(k) is not None)
    if given:
        raise ValueError(
            f"HierarchicalDDPStrategy installs its own DDP comm hook, so {given} cannot be used with it (DDP "
            f"allows one hook per model). For WAN compression pass wan=WanConfig(compression='bf16'|'int8'); "
            f"for another hook use Lightning's DDPStrategy."
        )


def _register_ddp_names(registry, cls: type) -> None:
    for name, start_method in (("hierarchical_ddp", "popen"), ("hierarchical_ddp_spawn", "spawn")):
        description = f"multidc hierarchical (site-first, then WAN) DDP with start_method={start_method!r}"
        _register(registry, name, cls, description=description, start_method=start_method)


register_all()  # the names, also when this module's own import of Lightning came first (see _registry)
