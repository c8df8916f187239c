"""A 2-rank MultiDCAccelerator job that ends while the gloo worker of the default group still holds work.

Run with ``accelerate launch --num_processes 2``. Rank 1 joins the last all-gather 3 s late, so on rank 0 that
work is still held by the group's worker thread when ``end_training`` destroys the group and ``main`` returns:
the widest form of the exit race of any Accelerate loop (``gather`` + ``wait_for_everyone`` + ``end_training``).
If DDP's reducer is the group's last holder, rank 0 frees the group with the GIL held while the worker needs the
GIL to free the all-gather's output, and it hangs forever. Each rank prints ``exited <rank>`` after ``main``.
"""

import time

import torch
import torch.distributed as dist

from multidc.plugins import MultiDCAccelerator, MultiDCPlugin


def main() -> int:
    accelerator = MultiDCAccelerator(multidc_plugin=MultiDCPlugin(num_sites=2))
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()
    if accelerator.process_index == 1:
        time.sleep(3)
    out = torch.empty(accelerator.num_processes)
    dist.all_gather_into_tensor(out, torch.ones(1), async_op=True)  # its Work and output dropped at once
    del out
    accelerator.end_training()
    return accelerator.process_index


if __name__ == "__main__":
    rank = main()
    print(f"exited {rank}", flush=True)
