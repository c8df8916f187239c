"""The model, data and single-process reference of tests/hierarchical/test_elastic.py."""

from __future__ import annotations

import torch
from torch import nn

LR, MAX_SITES, ROWS = 0.05, 4, 4


def model(hidden: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))


def rows(site: int, local: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * site + 1000 * local + step)
    x = torch.randn(ROWS, 8, generator=g)
    return x, torch.sin(x[:, :4] * (1 + site))


def lr_factor(step: int) -> float:
    """The LR schedule of the Lightning test (``LambdaLR``): the factor at the job's committed step ``step``."""
    return 1.0 / (1.0 + 0.05 * step)


def reference(log: list[dict], per_site: int, initial: dict[str, torch.Tensor],
              scheduled: bool = False) -> dict[str, torch.Tensor]:
    """One process replays the committed steps from the parameters ``initial``: each step's gradient is the mean
    over the ranks of the sites that took part (``log``: ``{"step", "sites"}`` per committed step, in order); with
    ``scheduled``, step ``k`` runs at ``LR * lr_factor(k)``."""
    net = model()
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for entry in log:
        if scheduled:
            opt.param_groups[0]["lr"] = LR * lr_factor(entry["step"])
        grads = None
        for site in entry["sites"]:
            for local in range(per_site):
                net.zero_grad()
                x, y = rows(site, local, entry["step"])
                nn.functional.mse_loss(net(x), y).backward()
                g = [p.grad.clone() for p in net.parameters()]
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(net.parameters(), grads):
            p.grad = g / (len(entry["sites"]) * per_site)
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def diloco_reference(log: list[dict], per_site: int, initial: dict[str, torch.Tensor], *, sync_every: int,
                     outer_lr: float, outer_momentum: float, scheduled: bool = False) -> dict[str, torch.Tensor]:
    """One process replays the committed DiLoCo rounds from the global parameters ``initial``: in each round
    (``log``: ``{"step", "sites", "t0"}``, in order) every site that took part trains a copy of the global
    parameters for ``sync_every`` inner SGD steps (inner step ``t`` of site ``s``: the mean gradient over its ranks
    on ``rows(s, rank, t)``, ``t`` from ``t0``); the outer SGD (Nesterov momentum) steps the global parameters
    with the mean of ``global - local`` over the sites; with ``scheduled``, inner step ``t`` runs at
    ``LR * lr_factor(t)``."""
    glob = model()
    glob.load_state_dict(initial)
    params = [p.detach().float().clone() for p in glob.parameters()]
    outer = torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=True)
    for entry in log:
        deltas = []
        for site in entry["sites"]:
            net = model()
            with torch.no_grad():
                for p, g in zip(net.parameters(), params):
                    p.copy_(g)
            inner = torch.optim.SGD(net.parameters(), lr=LR)
            for t in range(entry["t0"], entry["t0"] + sync_every):
                inner.param_groups[0]["lr"] = LR * lr_factor(t) if scheduled else LR
                net.zero_grad()
                for local in range(per_site):
                    x, y = rows(site, local, t)
                    (nn.functional.mse_loss(net(x), y) / per_site).backward()
                inner.step()
            deltas.append([g - p.detach() for g, p in zip(params, net.parameters())])
        for i, p in enumerate(params):
            p.grad = sum(d[i] for d in deltas) / len(deltas)
        outer.step()
        outer.zero_grad()
    return {name: p for (name, _), p in zip(glob.named_parameters(), params)}
