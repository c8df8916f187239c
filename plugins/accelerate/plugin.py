"""``MultiDCPlugin``: the settings of ``MultiDCAccelerator`` (sites, WAN, parallel layout, checkpoints).

Kept apart from ``accelerator.py`` because it needs nothing from Accelerate: it is plain validated configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from multidc.hierarchical import _env
from multidc.hierarchical.config import WanConfig
from multidc.hierarchical.diloco.config import DiLoCoConfig, resolve_cross_site

if TYPE_CHECKING:  # the layout imports FSDP2, tensor and pipeline parallelism: only layout code pays
    from multidc.hierarchical.parallel import ParallelLayout, PipelineConfig

_SIZE_ENV = {"dp_replicate": _env.DP_REPLICATE, "dp_shard": _env.DP_SHARD,
             "pipeline_parallel_size": _env.PP_SIZE, "tensor_parallel_size": _env.TP_SIZE}


@dataclass(kw_only=True)
class MultiDCPlugin:
    """Where this process's site is, how gradients cross the WAN and (optionally) the parallel layout, for
    ``MultiDCAccelerator``.

    Every field left at ``None`` falls back to its ``MULTIDC_*`` environment variable, so ``accelerate launch``
    plus env works without code changes. Validated at construction. With none of the four parallel sizes given
    (argument or env) the layout is plain data parallelism: DDP with the hierarchical gradient hook, sites of any
    sizes. Otherwise ``layout`` is a ``ParallelLayout`` with its defaults (``dp_shard`` inferred), as Lightning's
    ``Parallel3DStrategy``.
    """

    num_sites: int | None = field(
        default=None, metadata={"help": "Sites as contiguous equal blocks of ranks. Env MULTIDC_NUM_SITES."}
    )
    """Sites as contiguous equal blocks of ranks. Env ``MULTIDC_NUM_SITES``; unset = one site, or the sites
    named by ``site`` / ``MULTIDC_SITE`` on each machine."""

    site: int | str | None = field(
        default=None, metadata={"help": "This process's site index or name, e.g. 'us-east'. Env MULTIDC_SITE."}
    )
    """This process's site index or name (e.g. ``"us-east"``). Env ``MULTIDC_SITE``, read at topology build.
    With a parallel layout sites are contiguous blocks: name them with ``MULTIDC_SITE`` or count them."""

    wan: WanConfig | None = field(
        default=None, metadata={"help": "WAN settings; default WanConfig() (env MULTIDC_WAN_*)."}
    )
    """WAN settings for the inter-site hop; default ``WanConfig()``, which reads ``MULTIDC_WAN_*``."""

    cross_site: str | None = field(
        default=None, metadata={"help": "'allreduce' (every step) or 'diloco'. Env MULTIDC_CROSS_SITE."}
    )
    """How sites meet: ``"allreduce"`` (default: every step's gradients cross the WAN, hierarchically) or
    ``"diloco"`` (DDP inside each site; DiLoCo across sites every ``diloco.sync_every`` optimizer steps, see
    ``multidc.hierarchical.DiLoCo``). Env ``MULTIDC_CROSS_SITE``. With a parallel layout each site trains alone
    under FSDP2 / pipeline / tensor parallelism and each rank syncs its own shard
    (``multidc.hierarchical.parallel.build_diloco``); ``load_state`` then needs the layout that saved."""

    diloco: DiLoCoConfig | None = field(default=None, metadata={"help": "DiLoCo settings (env MULTIDC_DILOCO_*)."})
    """DiLoCo settings with ``cross_site="diloco"``; default ``DiLoCoConfig()`` (env ``MULTIDC_DILOCO_*``,
    ``MULTIDC_DILOCO_SYNC_EVERY`` required), resolved at construction."""

    dp_replicate: int | str | None = field(default=None, metadata={"help": "Replicas/site. Env MULTIDC_DP_REPLICATE."})
    """Data-parallel replicas inside each site. Env ``MULTIDC_DP_REPLICATE``."""
    dp_shard: int | str | None = field(default=None, metadata={"help": "FSDP2 shard degree. Env MULTIDC_DP_SHARD."})
    """FSDP2 shard degree inside a site (``-1``/``"auto"``: inferred). Env ``MULTIDC_DP_SHARD``."""
    pipeline_parallel_size: int | str | None = field(default=None, metadata={"help": "Stages. Env MULTIDC_PP_SIZE."})
    """Pipeline stages. Env ``MULTIDC_PP_SIZE``."""
    tensor_parallel_size: int | str | None = field(default=None, metadata={"help": "TP degree. Env MULTIDC_TP_SIZE."})
    """Tensor-parallel degree. Env ``MULTIDC_TP_SIZE``."""
    pipeline_schedule: str | None = field(default=None, metadata={"help": "gpipe|1f1b|interleaved_1f1b."})
    """``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``. Env ``MULTIDC_PP_SCHEDULE``; default ``"1f1b"``."""
    microbatches: int | None = field(default=None, metadata={"help": "Microbatches. Env MULTIDC_PP_MICROBATCHES."})
    """Microbatches per pipeline step. Env ``MULTIDC_PP_MICROBATCHES``; default ``2 * pipeline_parallel_size``."""
    split_points: Sequence[int] | None = field(default=None, metadata={"help": "Block indices where stages start."})
    """Block indices where stages ``1..n-1`` start; default balanced by block count."""
    tensor_parallel: str | Callable | None = field(default=None, metadata={"help": "None | 'transformer' | fn."})
    """``None`` (tp = 1 or applied by you before ``prepare``), ``"transformer"`` (the common block plan on the
    blocks, see ``multidc.hierarchical.parallel.transformer_block_plan``) or ``fn(model, tp_mesh)``."""

    storage_options: dict | None = field(default=None, metadata={"help": "fsspec/s3fs options for save_state."})
    """fsspec / s3fs options for ``save_state`` / ``load_state`` URLs (``endpoint_url``, ...); with one URL per site
    also a mapping site -> options (each region its endpoint and credentials). ``None``:
    ``MULTIDC_CKPT_STORAGE_OPTIONS`` (a JSON object) if set, else the standard places (AWS env / config). Never
    logged."""
    async_save: bool = field(default=False, metadata={"help": "save_state uploads in the background."})
    """``save_state`` returns after the snapshot to host memory; the upload runs in the background."""
    keep_last_k: int | None = field(default=None, metadata={"help": "Committed checkpoints kept per root."})
    """Keep only the newest ``k`` committed checkpoints under a root; default ``ProjectConfiguration.total_limit``."""
    checkpoint_replicas: int | None = field(default=None, metadata={"help": "Other regions holding a site's state."})
    """With one URL per site: how many other regions also hold each site's own state (its DiLoCo model), for a
    ``load_state`` after its region is lost (``Checkpointer``'s ``replicas``). Env ``MULTIDC_CKPT_REPLICAS``, else 0."""
    shard_local_checkpoints: bool = field(default=False, metadata={"help": "Local dirs through multidc too."})
    """Also save / load plain local directories through multidc's sharded checkpoints in a data-parallel run
    (URLs and parallel layouts always go through multidc; see ``MultiDCAccelerator.save_state``)."""

    elastic: bool | None = field(default=None, metadata={"help": "Elastic sites on torchft. Env MULTIDC_ELASTIC."})
    """Elastic sites on torchft (env ``MULTIDC_ELASTIC``): this ``accelerate launch`` is one site (launch one per
    site, each with its own rendezvous; ``site`` / ``MULTIDC_SITE`` names it, ``num_sites`` /
    ``MULTIDC_NUM_SITES`` counts the sites the job starts with); a failed site leaves the others training and
    rejoins live when restarted. Data parallelism: DDP, or FSDP2 inside the site (``dp_shard``;
    ``dp_replicate``, pipeline and tensor parallelism are refused); ``save_state`` is written by one site,
    ``load_state`` right after ``prepare`` resumes the job; see ``multidc.plugins.accelerate.elastic``."""

    lighthouse: str | None = field(default=None, metadata={"help": "Lighthouse host:port. Env MULTIDC_LIGHTHOUSE."})
    """The lighthouse's ``host:port`` (``multidc lighthouse``), elastic mode only; env ``MULTIDC_LIGHTHOUSE``."""

    layout: ParallelLayout | None = field(default=None, init=False)
    """The validated (not yet resolved) layout, or ``None`` for plain data parallelism."""
    pipeline: PipelineConfig | None = field(default=None, init=False)
    """The validated pipeline settings (used when ``pipeline_parallel_size > 1``)."""

    def __post_init__(self) -> None:
        from multidc.hierarchical.elastic import resolve_elastic

        self.elastic = resolve_elastic(self.elastic, self.lighthouse)  # a missing or bad address fails here
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
        k = self.keep_last_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"MultiDCPlugin.keep_last_k={k!r} must be a positive int or None (keep all).")
        r = self.checkpoint_replicas
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ValueError(f"MultiDCPlugin.checkpoint_replicas={r!r} must be an int >= 0 (other regions that also "
                             "hold each site's own state) or None.")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError(f"MultiDCPlugin.storage_options must be a dict of fsspec options, not "
                             f"{type(self.storage_options).__name__}.")
        tp = self.tensor_parallel
        if tp is not None and tp != "transformer" and not callable(tp):
            raise ValueError(f"MultiDCPlugin.tensor_parallel={tp!r}: use None, 'transformer' or fn(model, tp_mesh).")
        self.diloco = resolve_cross_site(self.cross_site, self.diloco, owner="MultiDCPlugin")
        self.cross_site = "allreduce" if self.diloco is None else "diloco"
        if self.elastic and self.diloco is not None:  # an unsupported DiLoCo setting fails here, not at prepare
            from multidc.hierarchical.elastic.diloco import check_elastic_config

            check_elastic_config(self.diloco)
        sizes = {name: getattr(self, name) for name in _SIZE_ENV}
        pipeline_args = (self.pipeline_schedule, self.microbatches, self.split_points)
        if all(v is None and _env.read(_SIZE_ENV[name]) is None for name, v in sizes.items()):
            if any(v is not None for v in pipeline_args):
                raise ValueError(
                    "MultiDCPlugin pipeline_schedule / microbatches / split_points need pipeline_parallel_size "
                    f"(or {_env.PP_SIZE}) > 1."
                )
            return  # plain data parallelism: DDP + hierarchical hook, any site sizes
        from multidc.hierarchical.parallel import ParallelLayout, PipelineConfig

        self.pipeline = PipelineConfig(schedule=self.pipeline_schedule, microbatches=self.microbatches,
                                       split_points=self.split_points)
        if self.elastic:  # this launch is one site: the layout is the site's (num_sites counts the job's sites)
            self.layout = ParallelLayout(num_sites=1, **sizes)
            return
        if self.site is not None:
            raise ValueError(
                f"MultiDCPlugin.site={self.site!r} with a parallel layout: the layout's sites are contiguous blocks "
                f"of ranks; give num_sites, or name each machine's site with {_env.SITE}."
            )
        self.layout = ParallelLayout(num_sites=self.num_sites, **sizes)
