"""Elastic sites under Accelerate: ``MultiDCPlugin(elastic=True)`` (env ``MULTIDC_ELASTIC=1``).

Each site is its own ``accelerate launch`` (its own rendezvous; ``--num_processes`` counts that site's processes) and
a torchft replica group. The first quorum forms at the site's first ``accelerator.job_step``, training forward
(``model.train()``, gradients enabled) or ``zero_grad``, whichever comes first (a site that starts late or restarts
receives the live model, optimizer and LR scheduler states there, not from storage), so a ``load_state`` right after
``prepare`` comes before it. Each of these is collective over the site's ranks: read ``job_step`` on every rank, and
keep rank-0-only forwards (a sample, an evaluation) in ``model.eval()`` or ``torch.no_grad()`` before training
starts. Then:

* ``cross_site="allreduce"``: one quorum per optimizer step. The prepared optimizer's ``step`` averages the
  gradients over the sites present (DDP has averaged them inside the site) and steps only if the site's ranks
  commit the step; a discarded step changes no weight, optimizer or scheduler state (the prepared LR schedulers
  see it as skipped). Its ``zero_grad`` starts the next step's quorum, so call it once per step (before the
  forward or after ``step``: both work). Gradient accumulation (``accelerator.accumulate``) works: the quorum and
  the average happen at sync steps only.
* ``cross_site="diloco"``: one quorum per outer round (``multidc.hierarchical.elastic.ElasticDiLoCo``).

Both are the job's ``CrossSite`` sync (``multidc.hierarchical.elastic.steps.elastic_sync``), driven from the prepared
optimizer by ``OptimizerDriver`` (``accelerator.elastic_steps``).

Loop on ``accelerator.job_step`` (the job's optimizer steps: committed steps, or inner steps under DiLoCo), which a
rejoined site takes from the live ones. Checkpoints: ``save_state(url)`` on every site, as usual; only one site
writes (``ElasticSite.save_once``; one copy of the job's state, named by ``job_step``), and ``load_state(url)``
right after ``prepare`` resumes the job at the checkpoint's step (see ``multidc.plugins.accelerate.state``).
With ``dp_shard`` (FSDP2 inside each site) each rank's shards are averaged with, and healed from, the same-index
rank of the other sites; every site must use the same layout. ``dp_replicate``, pipeline and tensor parallelism are
refused in this mode.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def site_options(plugin) -> dict:
    """``ElasticSite`` keyword arguments from a ``MultiDCPlugin`` (but ``wan``)."""
    return {"site": None if plugin.site is None else str(plugin.site), "lighthouse": plugin.lighthouse,
            "sites": plugin.num_sites}


def ensure_process_group() -> bool:
    """A one-process site started without a launcher (``python train.py``: Accelerate starts no process group): a
    one-rank gloo group of its own, as torchrun would make, whose store (``MASTER_ADDR`` / ``MASTER_PORT``, on
    ``MULTIDC_ELASTIC_HOST`` or the host's name) the site's manager also serves its rail rendezvous from. Returns
    whether it made one (to destroy at the end)."""
    if dist.is_initialized():
        return False
    from multidc.hierarchical.elastic.site import advertised_host

    host = advertised_host()
    store = dist.TCPStore(host, 0, world_size=1, is_master=True, timeout=datetime.timedelta(minutes=30))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(store.port)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    return True
