"""DiLoCo computed another way, for tests: one process holding one model copy per site, the outer step by hand.

Nothing here imports multidc: the schedule, the strided fragments, Nesterov SGD and the overlap merge are written
out from the algorithm's definition, so a test comparing a distributed run against this checks the real code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

ROWS, LR = 4, 0.05


def model() -> nn.Sequential:
    """The DiLoCo tests' model: three Tanh blocks and a head, seeded 0 (the same on every rank)."""
    torch.manual_seed(0)
    block = lambda i, o: nn.Sequential(nn.Linear(i, o), nn.Tanh())  # noqa: E731
    return nn.Sequential(block(8, 16), block(16, 16), block(16, 16), nn.Linear(16, 4))


def rows(site: int, local: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``local`` rank of ``site`` at ``step``: each site its own target (non-IID)."""
    g = torch.Generator().manual_seed(1000 * site + 100 * local + step)
    x = torch.randn(ROWS, 8, generator=g)
    return x, torch.sin(x[:, :4] * (1 + site)) + 0.1 * torch.randn(ROWS, 4, generator=g)


def run_reference(
    model: nn.Module,
    *,
    sites: int,
    steps: int,
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    inner_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    sync_every: int,
    fragments: int = 1,
    overlap_steps: int = 0,
    alpha: float = 0.5,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
    compress: Callable[[int, int, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    site_weights: list[float] | None = None,
    keep_in_flight: bool = False,
) -> dict:
    """Train ``sites`` copies of ``model`` (all starting from its values) and sync them as DiLoCo prescribes.

    ``batch(site, step)`` returns a site's whole batch for inner step ``step`` (1-based): with DDP inside a site, that
    is the rows of all its ranks together (equal rows per rank, a mean loss). ``blocks(model)``: the blocks dealt into
    fragments (default the top-level children). ``compress(fragment, site, delta)``: what the site's pseudo-gradient
    ``delta`` (by name, float32) arrives as at the other sites (a codec applied by hand); the sites' arrivals are summed
    in site order. ``keep_in_flight`` (top-k with overlap): the merge is ``global + (local - local as the sync
    started)`` instead of the ``alpha`` mix. ``site_weights``: what each site trains per inner step (e.g. its ranks);
    each sync then weighs a site's arrival by its share of what all trained since the fragment's last sync (float32
    products summed in site order; equal shares: the plain mean). Returns ``{"local": [per-site {name: tensor}],
    "global": {name: tensor}}`` after ``steps`` inner steps (float32).
    """
    copies = [copy.deepcopy(model) for _ in range(sites)]
    optimizers = [inner_optimizer(list(m.parameters())) for m in copies]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    glob = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    momentum = {n: torch.zeros_like(v) for n, v in glob.items()}
    fragment_of = _fragments(model, fragments, blocks)
    offsets = [((f + 1) * sync_every // fragments) % sync_every for f in range(fragments)]
    in_flight = None  # (fragment, merge_at, averaged delta per name, per-site local values as the sync started)
    for t in range(1, steps + 1):
        for site, (m, opt) in enumerate(zip(copies, optimizers)):
            x, y = batch(site, t)
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
        if in_flight is not None and in_flight[1] <= t:
            _merge(copies, glob, momentum, in_flight, overlap_steps, alpha, outer_lr, outer_momentum)
            in_flight = None
        for f in range(fragments):
            if t % sync_every == offsets[f]:
                part = [n for n in names if fragment_of[n] == f]
                locals_ = [dict(m.named_parameters()) for m in copies]
                per_site = [{n: glob[n] - loc[n].detach().float() for n in part} for loc in locals_]
                if compress is not None:
                    per_site = [compress(f, site, d) for site, d in enumerate(per_site)]
                delta = _merge_sites(per_site, part, site_weights)
                started = [{n: loc[n].detach().float().clone() for n in part} for loc in locals_] if (
                    keep_in_flight and overlap_steps) else None
                in_flight = (f, t + overlap_steps, delta, started)
                if overlap_steps == 0:
                    _merge(copies, glob, momentum, in_flight, overlap_steps, alpha, outer_lr, outer_momentum)
                    in_flight = None
    return {
        "local": [{n: p.detach().float().clone() for n, p in m.named_parameters() if p.requires_grad} for m in copies],
        "global": glob,
    }


def run_round_reference(
    model: nn.Module,
    *,
    plans: list[tuple[int, ...]],
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    inner_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    fragments: int = 1,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    site_weights: list[float] | None = None,
) -> dict:
    """Rounds by time, without overlap: round ``r`` has ``plans[r][s]`` inner steps on site ``s``; fragment ``f``'s
    sync comes at the round's step ``(f + 1) * H_s // fragments`` of each site, and the k-th syncs of all sites
    pair (the sites' step counts differ). ``batch(site, step)`` takes the site's own step count (1-based). Each sync
    weighs a site by what it trained since that fragment's last sync: its steps since then times
    ``site_weights[s]`` (default 1; e.g. its ranks), float32 shares summed in site order (equal: the plain mean).
    Returns ``{"local": [...], "global": {...}, "steps": [inner steps per site]}``."""
    sites = len(plans[0])
    per_step = site_weights or [1.0] * sites
    copies = [copy.deepcopy(model) for _ in range(sites)]
    optimizers = [inner_optimizer(list(m.parameters())) for m in copies]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    glob = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    momentum = {n: torch.zeros_like(v) for n, v in glob.items()}
    fragment_of = _fragments(model, fragments, None)
    steps, trained = [0] * sites, [[0.0] * fragments for _ in range(sites)]
    for plan in plans:
        start = list(steps)
        for f in range(fragments):
            for site, (m, opt) in enumerate(zip(copies, optimizers)):
                while steps[site] - start[site] < (f + 1) * plan[site] // fragments:
                    steps[site] += 1
                    x, y = batch(site, steps[site])
                    opt.zero_grad()
                    loss_fn(m(x), y).backward()
                    opt.step()
                    trained[site] = [w + per_step[site] for w in trained[site]]
            part = [n for n in names if fragment_of[n] == f]
            per_site = [{n: glob[n] - dict(m.named_parameters())[n].detach().float() for n in part} for m in copies]
            delta = _merge_sites(per_site, part, [trained[site][f] for site in range(sites)])
            for site in range(sites):
                trained[site][f] = 0.0
            _merge(copies, glob, momentum, (f, 0, delta, None), 0, 0.0, outer_lr, outer_momentum)
    return {
        "local": [{n: p.detach().float().clone() for n, p in m.named_parameters() if p.requires_grad} for m in copies],
        "global": glob,
        "steps": steps,
    }


def _merge_sites(per_site: list[dict], part: list[str], site_weights: list[float] | None) -> dict:
    """The sites' arrivals merged: the plain mean, or weighted by each site's share of what all trained (every site
    trains the same number of steps between two syncs of a fragment, so the shares are those of ``site_weights``)."""
    parts = None if site_weights is None else torch.tensor(site_weights, dtype=torch.float64)
    if parts is None or bool((parts == parts[0]).all()):
        return {n: sum(d[n] for d in per_site) / len(per_site) for n in part}
    shares = (parts / parts.sum()).float()
    return {n: sum(w * d[n] for w, d in zip(shares, per_site)) for n in part}


def _merge(copies, glob, momentum, in_flight, overlap_steps, alpha, lr, mu) -> None:
    _, _, delta, started = in_flight
    with torch.no_grad():
        for n, g in delta.items():
            momentum[n] = mu * momentum[n] + g  # Nesterov SGD: buf = mu*buf + g; p -= lr * (g + mu*buf)
            glob[n] = glob[n] - lr * (g + mu * momentum[n])
        for site, m in enumerate(copies):
            params = dict(m.named_parameters())
            for n in delta:
                if started is not None:
                    new = glob[n] + (params[n].float() - started[site][n])
                else:
                    new = glob[n] if overlap_steps == 0 else alpha * params[n].float() + (1 - alpha) * glob[n]
                params[n].copy_(new)


def _fragments(model: nn.Module, fragments: int, blocks) -> dict[str, int]:
    block_list = blocks(model) if blocks is not None else list(model.children())
    owner = {}
    for index, block in enumerate(block_list):
        for p in block.parameters():
            owner.setdefault(id(p), index % fragments)
    return {n: owner.get(id(p), 0) for n, p in model.named_parameters()}


def second_step_error(optimizer, diloco) -> str:
    """torchft's DiLoCo loop, ``optimizer.step()`` then ``diloco.step()``, on a DiLoCo built with ``optimizer`` (whose
    hook steps it already): what the manual ``step()`` raised, or ``"no error"``."""
    optimizer.step()
    try:
        diloco.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"
