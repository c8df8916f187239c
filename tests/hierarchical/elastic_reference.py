"""The model, data and single-process reference of tests/hierarchical/test_elastic.py, and what the sites' scripts
inject (a failure) or record (the checkpoints they write)."""

from __future__ import annotations

import os
import time

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


def fail_after_sync(site, step: int) -> None:
    """Make the ``ElasticSite`` ``site`` see a failure of its own at job step ``step``, once, after the step's
    transfers completed everywhere (say, its last acknowledgement lost): it discards the step, which the other sites
    commit."""
    sync = site.sync_gradients

    def sync_then_fail(module: nn.Module) -> None:
        sync(module)
        if site.step == step:
            site.manager.report_error(RuntimeError(f"injected after the sync of step {step}"))

    site.sync_gradients = sync_then_fail


def record_writes() -> list[int]:
    """The steps of the checkpoints this process writes (``multidc.plugins.Checkpointer.save``, which the
    Lightning strategies and ``MultiDCAccelerator.save_state`` call), appended as it writes them."""
    from multidc.plugins import Checkpointer

    written, save = [], Checkpointer.save

    def recorded(self, state, *, step, **kwargs):
        written.append(step)
        return save(self, state, step=step, **kwargs)

    Checkpointer.save = recorded
    return written


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
                     outer_lr: float, outer_momentum: float, scheduled: bool = False, fragments: int = 1,
                     overlap: int = 0, alpha: float = 0.5, heals: list[dict] = (), until: int | None = None,
                     with_local: bool = False, rates: dict[int, float] | None = None):
    """One process replays elastic DiLoCo rounds from the parameters ``initial`` (every site's at the first round).

    ``log``: the rounds in order, ``{"t0", "sites"}`` (first inner step, the sites that took part) and optionally
    ``"t1"`` (the inner step whose sync ends the round; default ``t0 + sync_every``) and ``"committed"`` (default
    True). In every round every site trains its own copy for inner steps ``t0 .. t1 - 1`` (inner step ``t`` of
    site ``s``: the mean gradient over its ranks on ``rows(s, rank, t)``; with ``scheduled`` at ``LR *
    lr_factor(t)``); the round's sync starts after inner step ``t1 - overlap - 1`` and takes the fragment due
    there (the model's two Linear layers are blocks 0 and 1, block ``i`` in fragment ``i mod fragments``; fragment
    ``f`` syncs when the steps done are ``(f + 1) * sync_every // fragments`` mod ``sync_every``), with each site's
    ``global - local`` of that moment. A committed sync steps the fragment's global parameters by outer SGD
    (Nesterov momentum) with the mean over the round's sites; committed or not, every site's fragment then takes
    the global values (``overlap``: ``alpha * local + (1 - alpha) * global``). ``heals``: ``{"site", "source",
    "t0"}``: before the round starting at ``t0`` the site takes the source's parameters. ``until``: the inner
    steps the job ran (more than the last round's ``t1`` when it ended mid-round: every site trains on to it).
    ``rates``: ``{site: samples each of its ranks reports per inner step}`` (``DiLoCo.count``): a committed sync
    averages the round's sites weighted by what each trained since the fragment's last sync (a healed site takes its
    source's counts with its parameters); None: every rank counts one per step.
    Returns the global parameters, and with ``with_local`` also ``{site: its parameters}``."""
    glob = model()
    glob.load_state_dict(initial)
    names = [name for name, _ in glob.named_parameters()]
    params = [p.detach().float().clone() for p in glob.parameters()]
    outer = torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum, nesterov=True)  # skips grad-less ones
    offsets = [(f + 1) * sync_every // fragments % sync_every for f in range(fragments)]
    fragment_of = [(0 if name.startswith("0.") else 1) % fragments for name in names]
    nets = {site: model() for site in sorted({s for e in log for s in e["sites"]} | {h["site"] for h in heals})}
    for net in nets.values():
        net.load_state_dict(initial)
    counts = {site: [0.0] * fragments for site in nets}  # what each site trained since each fragment's last sync

    def train(site: int, steps: range) -> None:
        _train(nets[site], site, steps, per_site, scheduled)
        counts[site] = [c + (rates or {}).get(site, 1.0) * per_site * len(steps) for c in counts[site]]
    for entry in log:
        t0 = entry["t0"]
        t1 = entry.get("t1", t0 + sync_every)
        for heal in heals:
            if heal["t0"] == t0:
                nets[heal["site"]].load_state_dict(nets[heal["source"]].state_dict())
                counts[heal["site"]] = list(counts[heal["source"]])
        start = t1 - overlap  # steps done when the sync starts
        synced = [f for f in range(fragments) if offsets[f] == start % sync_every]
        due = [i for i, f in enumerate(fragment_of) if f in synced]
        for site in nets:
            train(site, range(t0, start))
        deltas = {site: {i: params[i] - list(net.parameters())[i].detach() for i in due} for site, net in nets.items()}
        weights = {site: sum(counts[site][f] for f in synced) for site in nets}
        for site in nets:
            counts[site] = [0.0 if f in synced else c for f, c in enumerate(counts[site])]
            train(site, range(start, t1))
        local = {site: [p.detach() for p in net.parameters()] for site, net in nets.items()}
        if entry.get("committed", True):
            total = sum(weights[site] for site in entry["sites"])
            for i in due:
                params[i].grad = sum(deltas[site][i] * (weights[site] / total) for site in entry["sites"])
            outer.step()
            outer.zero_grad(set_to_none=True)
        weight = alpha if overlap else 0.0
        with torch.no_grad():
            for values in local.values():
                for i in due:
                    values[i].copy_(params[i] if weight == 0.0 else weight * values[i] + (1.0 - weight) * params[i])
    end = log[-1].get("t1", log[-1]["t0"] + sync_every) if log else 0
    for site in nets:
        train(site, range(end, until if until is not None else end))
    result = {name: p for name, p in zip(names, params)}
    if not with_local:
        return result
    return result, {site: {n: p.detach().clone() for n, p in net.named_parameters()} for site, net in nets.items()}


def _train(net: nn.Module, site: int, steps: range, per_site: int, scheduled: bool) -> None:
    inner = torch.optim.SGD(net.parameters(), lr=LR)  # stateless: a new one per round is the same
    for t in steps:
        inner.param_groups[0]["lr"] = LR * lr_factor(t) if scheduled else LR
        net.zero_grad()
        for local in range(per_site):
            x, y = rows(site, local, t)
            (nn.functional.mse_loss(net(x), y) / per_site).backward()
        inner.step()


def job_end(path: str, otherwise: int) -> int:
    """The step (or round) a test wrote into ``path`` (atomically: renamed into place), else ``otherwise``."""
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return otherwise


def wait_for_file(path: str, timeout_s: float = 120.0) -> None:
    """Wait until ``path`` exists (a test tells a site's script it may go on), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def full_parameters(net: nn.Module) -> dict[str, torch.Tensor]:
    """``net``'s whole parameters on the CPU, copied; a layout's shards gathered (collective over the site)."""
    with torch.no_grad():
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                for n, p in net.named_parameters()}
