"""An Accelerate loop with ``MultiDCPlugin(cross_site="diloco")``, run by tests/plugins/test_accelerate_diloco.py.

    accelerate launch --config_file CONFIG tests/plugins/_accelerate_diloco_script.py --config JSON --steps N \\
        --accumulate 2 --ckpt URL (--save-at S | --resume) --out DIR [--layout '{"dp_shard": 2}']

4 processes as 2 sites (``MULTIDC_NUM_SITES=2``). Each rank trains the model of tests/hierarchical/test_diloco.py
on its own rows: micro-batch ``k`` of rank (site ``s``, local rank ``l``) is ``test_diloco._rows(s, l, k)``, so a
single-process reference can replay it. ``--save-at S`` calls ``save_state(URL)`` after optimizer step S;
``--resume`` loads it and trains on. Every rank writes DIR/rank{r}.pt: its parameters, the global ones (through
``accelerator.diloco.global_parameters()``), ``wan_metrics()`` per optimizer step, DiLoCo's stats and the WAN
bytes its start (in ``prepare``) sent.
``--more``: further runs in the same processes (other DiLoCo settings, checkpoints to save or resume from), each
with a fresh ``MultiDCAccelerator`` on the same process group, writing DIR/<name>_rank{r}.pt (also this rank's
parameters and top-k residuals after the load, and the residuals at the end).
``--layout`` adds plugin sizes (e.g. ``dp_shard=2``: FSDP2 inside each site): the model's blocks go into the
layout, rank (site ``s``, data-parallel index ``l`` in the site) trains on the same rows. Every optimizer step
``accelerator.clip_grad_norm_`` (with a bound that never clips) reports the norm it clips by.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
from multidc.hierarchical import DiLoCoConfig
from multidc.plugins import MultiDCAccelerator, MultiDCPlugin
from tests.diloco_reference import LR
from tests.diloco_reference import model as _model
from tests.diloco_reference import rows as _rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", default=None)
    parser.add_argument("--more", default="[]", help="more runs after the first, in the same processes (a fresh "
                        "MultiDCAccelerator each): a JSON list of {name, config, ckpt, save_at, resume_from}; each "
                        "writes DIR/<name>_rank{r}.pt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layout = json.loads(args.layout) if args.layout else {}
    first = {"name": None, "config": json.loads(args.config), "ckpt": args.ckpt, "save_at": args.save_at,
             "resume_from": args.ckpt if args.resume else None}
    runs = [first, *json.loads(args.more)]
    for index, spec in enumerate(runs):
        run(spec, layout, args, last=index == len(runs) - 1)


def run(spec: dict, layout: dict, args, *, last: bool) -> None:
    """One training run of ``spec``; ``last``: ``end_training``, else the accelerator is closed and Accelerate's
    singletons reset for the next run on the same process group."""
    plugin = MultiDCPlugin(cross_site="diloco", diloco=DiLoCoConfig(**spec["config"]), **layout)
    accelerator = MultiDCAccelerator(multidc_plugin=plugin, gradient_accumulation_steps=args.accumulate)
    model = _model()
    blocks = {"blocks": list(model)} if layout else {}
    if not layout:  # a frozen model prepared first (a distillation teacher): DiLoCo takes the one it trains
        accelerator.prepare_model(_model().requires_grad_(False), evaluation_mode=True)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR), **blocks)
    start_bytes = accelerator.topology.wan_stats.snapshot()["bytes_sent"]  # DiLoCo started in prepare
    first = 1
    if spec["resume_from"]:
        accelerator.load_state(spec["resume_from"])
        first = accelerator.diloco.stats.inner_steps + 1
    start, start_residual = _full(accelerator.unwrap_model(model)), _residuals(accelerator.diloco)
    site, local = accelerator.topology.site, accelerator.topology.local_rank_in_site
    if layout:
        from multidc.hierarchical.parallel import data_parallel_coordinate

        index, size = data_parallel_coordinate(accelerator.device_mesh)
        site, local = divmod(index, size // accelerator.topology.num_sites)
    metrics, norms = [], []
    for step in range(first, args.steps + 1):
        for micro in range(1, args.accumulate + 1):
            x, y = _rows(site, local, (step - 1) * args.accumulate + micro)
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e9)))
                opt.step()
                opt.zero_grad()
        assert accelerator.sync_gradients
        metrics.append(accelerator.wan_metrics())
        if step == spec["save_at"]:
            accelerator.save_state(spec["ckpt"], step=step)
    net = accelerator.unwrap_model(model)
    with accelerator.diloco.global_parameters():
        glob = _full(net)
    report = {"site": site, "rank_in_site": local, "local": _full(net), "global": glob, "metrics": metrics,
              "norms": norms, "stats": dataclasses.asdict(accelerator.diloco.stats), "first": first,
              "start_bytes": start_bytes, "start": start, "residual": _residuals(accelerator.diloco),
              "start_residual": start_residual}
    name = f"{spec['name']}_" if spec["name"] else ""
    torch.save(report, os.path.join(args.out, f"{name}rank{accelerator.process_index}.pt"))
    if last:
        accelerator.end_training()
        return
    from accelerate.state import AcceleratorState, GradientState

    accelerator._close_checkpointers()
    accelerator.gradient_sync.close()
    AcceleratorState._reset_state(reset_partial_state=True)  # the next run: a fresh Accelerator, same group
    GradientState._reset_state()


def _residuals(diloco) -> dict[str, torch.Tensor]:
    """This rank's top-k error-feedback residuals as its checkpoints hold them (``{}`` without top-k)."""
    mine = diloco.state_dict().get("residual", {}).get(f"rank_{torch.distributed.get_rank()}", {})
    return {name: value.clone() for name, value in mine.items() if name.startswith("fragment_")}  # not the layout


def _full(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameter values (FSDP2 shards gathered inside the site)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in net.named_parameters()}


if __name__ == "__main__":
    main()
