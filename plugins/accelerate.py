"""Hugging Face Accelerate integration: ``MultiDCPlugin`` (settings) and ``MultiDCAccelerator``.

An ordinary Accelerate loop trains across sites by swapping ``Accelerator`` for ``MultiDCAccelerator``; under
``accelerate launch`` the site layout and WAN settings come from ``MULTIDC_*`` environment variables::

    accelerator = MultiDCAccelerator()                 # was: Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ...                                                # accumulate / backward / gather / save_state unchanged
    if accelerator.sync_gradients:
        accelerator.log(accelerator.wan_metrics(), step=step)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from multidc.hierarchical import _env
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.ddp_hook import HierarchicalHookState, register_ddp_hook
from multidc.hierarchical.stats import WanStepMeter
from multidc.hierarchical.topology import Topology

try:
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "multidc's Accelerate integration needs Accelerate: pip install 'multidc[accelerate]' (accelerate>=1.10)."
    ) from exc


@dataclass(kw_only=True)
class MultiDCPlugin:
    """Where this process's site is and how gradients cross the WAN, for ``MultiDCAccelerator``.

    Every field left at ``None`` falls back to its ``MULTIDC_*`` environment variable, so ``accelerate launch``
    plus env works without code changes. Validated at construction.
    """

    num_sites: int | None = field(
        default=None, metadata={"help": "Sites as contiguous equal blocks of ranks. Env MULTIDC_NUM_SITES."}
    )
    """Sites as contiguous equal blocks of ranks. Env ``MULTIDC_NUM_SITES``; unset = one site, or the sites
    named by ``site`` / ``MULTIDC_SITE`` on each machine."""

    site: int | str | None = field(
        default=None, metadata={"help": "This process's site index or name, e.g. 'us-east'. Env MULTIDC_SITE."}
    )
    """This process's site index or name (e.g. ``"us-east"``). Env ``MULTIDC_SITE``, read at topology build."""

    wan: WanConfig | None = field(
        default=None, metadata={"help": "WAN settings; default WanConfig() (env MULTIDC_WAN_*)."}
    )
    """WAN settings for the inter-site hop; default ``WanConfig()``, which reads ``MULTIDC_WAN_*``."""

    def __post_init__(self) -> None:
        source = "MultiDCPlugin.num_sites"
        if self.num_sites is None:
            self.num_sites, source = _env.read_int(_env.NUM_SITES), _env.NUM_SITES
        n = self.num_sites
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{source}={n!r} must be a positive integer number of sites, e.g. 2.")
        if self.site is not None and (isinstance(self.site, bool) or not isinstance(self.site, (int, str))):
            raise ValueError(f"MultiDCPlugin.site={self.site!r} must be an int index or a name such as 'us-east'.")
        if self.wan is None:
            self.wan = WanConfig()
        elif not isinstance(self.wan, WanConfig):
            raise ValueError(f"MultiDCPlugin.wan must be a multidc.hierarchical.WanConfig, not {type(self.wan)}.")


class MultiDCAccelerator(Accelerator):
    """An ``Accelerator`` whose prepared DDP models average gradients site-first, then across sites.

    ``prepare`` / ``prepare_model`` attach ``multidc.hierarchical.register_ddp_hook`` to every model Accelerate
    wraps in ``DistributedDataParallel``; everything else is Accelerate's own (``accumulate`` and ``no_sync`` skip
    the WAN on accumulation steps, ``backward``, ``gather``, ``save_state``, trackers).

    Args:
        *args: passed to ``Accelerator``.
        multidc_plugin: site and WAN settings; default ``MultiDCPlugin()`` (``MULTIDC_*`` env).
        **accelerator_kwargs: passed to ``Accelerator``. A DDP comm hook in ``kwargs_handlers``
            (``DistributedDataParallelKwargs(comm_hook=...)``) is rejected: DDP takes one hook per model.

    Attributes:
        topology: the ``Topology`` over all processes (``None`` in a single-process run).
        hook_states: one ``HierarchicalHookState`` per prepared DDP model.

    Raises:
        ValueError: bad settings, a layout that cannot split the processes (on every rank, during construction,
            before any training collective), or sites asked for in a single-process run.
    """

    def __init__(self, *args, multidc_plugin: MultiDCPlugin | None = None, **accelerator_kwargs) -> None:
        plugin = multidc_plugin if multidc_plugin is not None else MultiDCPlugin()
        if not isinstance(plugin, MultiDCPlugin):
            raise ValueError(f"multidc_plugin must be a MultiDCPlugin, not {type(plugin).__name__}.")
        if "cpu" not in accelerator_kwargs and _launched_without_device():
            accelerator_kwargs["cpu"] = True
        super().__init__(*args, **accelerator_kwargs)
        self.multidc_plugin = plugin
        _check_launch(self)
        if self.ddp_handler is not None and self.ddp_handler.comm_hook != DDPCommunicationHookType.NO:
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_hook={self.ddp_handler.comm_hook}) cannot be combined with "
                f"MultiDCAccelerator, which installs its own DDP comm hook. For WAN compression use "
                f"MultiDCPlugin(wan=WanConfig(compression='bf16'|'int8')) or MULTIDC_WAN_COMPRESSION."
            )
        self.topology: Topology | None = self._build_topology()
        self.hook_states: list[HierarchicalHookState] = []
        self._wan_meter: WanStepMeter | None = None

    def _build_topology(self) -> Topology | None:
        plugin = self.multidc_plugin
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return Topology.build(num_sites=plugin.num_sites, site=plugin.site, wan=plugin.wan)  # every rank
        if plugin.num_sites not in (None, 1):
            raise ValueError(
                f"MultiDCAccelerator was asked for num_sites={plugin.num_sites} (num_sites / {_env.NUM_SITES}) but "
                f"runs as a single process ({self.distributed_type}); start it with `accelerate launch "
                f"--num_processes N ...` (N a multiple of {plugin.num_sites}) or unset {_env.NUM_SITES}."
            )
        return None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode=False):
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        ddp_model = getattr(prepared, "_orig_mod", prepared)  # torch.compile wraps the DDP module
        if isinstance(ddp_model, DistributedDataParallel):
            assert self.topology is not None, "a DDP model implies a multi-process run, which built a topology"
            self.hook_states.append(register_ddp_hook(ddp_model, self.topology, wan=self.multidc_plugin.wan))
            if self._wan_meter is None:
                self._wan_meter = WanStepMeter(self.topology.wan_stats, [])
            self._wan_meter.watch(ddp_model.parameters())
        elif self.topology is not None and self.topology.num_sites > 1 and not evaluation_mode:
            if any(p.requires_grad for p in prepared.parameters()):
                raise ValueError(
                    f"MultiDCAccelerator sends gradients across sites for DDP models; with "
                    f"distributed_type={self.distributed_type} Accelerate did not wrap this model in DDP, so its "
                    f"gradients would not go through the hierarchical all-reduce. Use multi-GPU / multi-CPU DDP."
                )
        return prepared

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        super().backward(loss, **kwargs)
        if self._wan_meter is not None:
            self._wan_meter.backward_done()

    def wan_metrics(self) -> dict[str, float]:
        """This rank's WAN figures since the previous call; call once per optimizer step (when
        ``sync_gradients``) and pass to ``accelerator.log``. Keys: ``wan/bytes_sent`` (bytes), ``wan/comm_s``,
        ``wan/MBps``, ``wan/wait_s`` (see ``multidc.hierarchical.stats.WanStepMeter``); ``{}`` before a DDP model
        is prepared."""
        return self._wan_meter.take() if self._wan_meter is not None else {}

    def end_training(self) -> None:
        if self._wan_meter is not None:
            self._wan_meter.close()
            self._wan_meter = None
        if self.topology is not None:
            self.topology.close()  # before Accelerate destroys the process group
        super().end_training()


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _launched_without_device() -> bool:
    """True when torchrun (``accelerate launch --multi_gpu`` / a ``MULTI_GPU`` config) started several processes on
    a machine with no accelerator device.

    Accelerate 1.15's torchrun launcher does not pass ``use_cpu`` / ``--cpu`` on to the processes (and ``--cpu``
    selects the one-process launcher, which needs ``mpirun`` for more); each process would then train alone. On
    such a machine gloo on the CPU is the only way the processes can train together, so it is chosen.
    """
    if "LOCAL_RANK" not in os.environ or _launched_world_size() < 2:
        return False
    accelerator = getattr(torch, "accelerator", None)
    return not (accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


def _check_launch(accelerator: Accelerator) -> None:
    world = _launched_world_size()
    if world > 1 and accelerator.num_processes == 1:
        raise ValueError(
            f"the launcher started {world} processes (WORLD_SIZE={world}) but Accelerate runs this one alone "
            f"(distributed_type={accelerator.distributed_type}), so they would not train together. On CPUs set "
            f"ACCELERATE_USE_CPU=1 or leave `cpu` unset (MultiDCAccelerator then picks gloo on the CPU)."
        )
