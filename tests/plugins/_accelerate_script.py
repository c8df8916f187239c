"""An ordinary Accelerate training loop, run by tests/plugins/test_accelerate.py under a real ``accelerate launch``.

    accelerate launch --config_file CONFIG tests/plugins/_accelerate_script.py --out DIR [--plain]

``--plain`` trains with ``accelerate.Accelerator``; otherwise the one changed line makes it
``multidc.plugins.MultiDCAccelerator`` (sites and WAN settings from ``MULTIDC_*`` env). Gradient accumulation 2
through ``accelerator.accumulate``; after the compared training one more micro-step under ``accelerator.no_sync``.

Rank 0 writes DIR/weights.pt (final parameters); every rank writes DIR/rank{r}.json: after each micro-step the
cumulative WAN bytes this rank sent (``topology.wan_stats``) and whether it was a sync step, the per-optimizer-step
``wan_metrics()``, the losses, and what Accelerate chose (distributed type, process count).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

STEPS, ACCUMULATE, BATCH = 3, 2, 4


def data(processes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * ACCUMULATE * BATCH * processes, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.plain:
        accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE)
    else:
        from multidc.plugins import MultiDCAccelerator

        accelerator = MultiDCAccelerator(gradient_accumulation_steps=ACCUMULATE)  # the one changed line
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data(accelerator.num_processes), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    topology = getattr(accelerator, "topology", None)
    sent = lambda: topology.wan_stats.snapshot()["bytes_sent"] if topology is not None else 0  # noqa: E731
    micro, metrics, losses = [], [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro.append({"sync": accelerator.sync_gradients, "bytes_sent": sent()})
        losses.append(accelerator.gather(loss.detach()).mean().item())
        if accelerator.sync_gradients and hasattr(accelerator, "wan_metrics"):
            metrics.append(accelerator.wan_metrics())
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    before = sent()
    x, y = next(iter(loader))
    with accelerator.no_sync(model):
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    no_sync_bytes = sent() - before

    report = {
        "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
        "micro": micro, "metrics": metrics, "losses": losses, "no_sync_bytes": no_sync_bytes,
        "site": topology.site_name if topology is not None else None,
        "num_sites": topology.num_sites if topology is not None else None,
    }
    with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    if accelerator.is_main_process:
        torch.save(weights, os.path.join(args.out, "weights.pt"))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
