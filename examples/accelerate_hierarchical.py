"""An ordinary Hugging Face Accelerate training loop that trains across 2 sites with multidc's hierarchical all-reduce.

    accelerate launch --config_file examples/accelerate_config.yaml examples/accelerate_hierarchical.py

4 processes on this machine (the config file), split into 2 emulated sites of 2 ranks: each gradient bucket is
averaged inside a site first, then across sites once per rail, chunked (and compressed with
``MULTIDC_WAN_COMPRESSION=bf16|int8``). The lines marked ``# multidc`` are the only changes to a plain Accelerate
script. Across real sites run one ``accelerate launch`` per site with ``--num_machines``, ``--machine_rank``,
``--main_process_ip`` / ``--main_process_port`` and ``MULTIDC_SITE=<name>`` (then ``--sites`` may be left at 2 or
set to the number of names).

Prints the loss (mean over all ranks) falling and, per optimizer step, the bytes this rank sent over the WAN,
the WAN throughput and the time backward waited on communication.
"""

from __future__ import annotations

import argparse

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from multidc.plugins import MultiDCAccelerator, MultiDCPlugin  # multidc (was: from accelerate import Accelerator)


def make_data(rows: int) -> TensorDataset:
    """y = tanh(x . w) + noise, generated: nothing to download."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=g)
    w = torch.randn(16, 1, generator=g) / 4
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(rows, 1, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=2, help="sites the processes form (contiguous blocks)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per process per micro-step")
    args = parser.parse_args()

    plugin = MultiDCPlugin(num_sites=args.sites)  # multidc: WAN settings from MULTIDC_WAN_* env
    accelerator = MultiDCAccelerator(gradient_accumulation_steps=args.accumulate, multidc_plugin=plugin)  # multidc
    set_seed(0)
    rows = args.steps * args.accumulate * args.batch_size * accelerator.num_processes
    loader = DataLoader(make_data(rows), batch_size=args.batch_size, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.print(f"{accelerator.num_processes} processes, {accelerator.topology}")  # multidc

    step, losses = 0, []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        if not accelerator.sync_gradients:
            continue
        step += 1
        mean_loss = accelerator.gather(torch.stack(losses)).mean().item()
        losses = []
        wan = accelerator.wan_metrics()  # multidc: this rank's WAN figures for the step
        accelerator.log({"loss": mean_loss, **wan}, step=step)
        if step == 1 or step % 5 == 0:
            accelerator.print(
                f"step {step:3d}  loss {mean_loss:.4f}  wan {wan['wan/bytes_sent'] / 1e3:7.1f} kB sent  "
                f"{wan['wan/MBps']:6.2f} MB/s  waited {wan['wan/wait_s'] * 1e3:6.1f} ms"
            )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
