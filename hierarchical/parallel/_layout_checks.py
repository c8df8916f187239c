"""``ParallelLayout``'s size arithmetic and the checks of a job's layout: pure functions, no process group.

Every check raises a ValueError that names the sizes and the fix; the job checks run on claims every rank gathered,
so every rank raises the same one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from multidc.hierarchical import _env

if TYPE_CHECKING:
    from multidc.hierarchical.parallel.layout import ParallelLayout

_DATA_PARALLEL_FIELDS = ("num_sites", "dp_replicate", "dp_shard")
AUTO = -1


def _parse(name: str, value, source: str | None = None) -> int:
    where = f" (from {source})" if source else ""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"ParallelLayout.{name}={value!r}{where} must be a positive int, -1 or 'auto'.") from None
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != AUTO):
        raise ValueError(f"ParallelLayout.{name}={value!r}{where} must be a positive int, -1 or 'auto'.")
    return value


def _resolve_sizes(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Fill the one ``AUTO`` size (if any) so the product is ``world``; ValueError naming what would fit."""
    auto = [name for name, v in sizes.items() if v == AUTO]
    fixed = math.prod(v for v in sizes.values() if v != AUTO)
    product = " x ".join(f"{n}={'auto' if v == AUTO else v}" for n, v in sizes.items())
    if auto:
        if world % fixed:
            raise ValueError(
                f"ParallelLayout: {auto[0]} cannot be inferred for world size {world}: the other sizes "
                f"({product}) multiply to {fixed}, which does not divide {world}. {_what_fits(sizes, world)}"
            )
        return {**sizes, auto[0]: world // fixed}
    if fixed != world:
        raise ValueError(
            f"ParallelLayout: {product} = {fixed} ranks, but the world has {world}. {_what_fits(sizes, world)}"
        )
    return dict(sizes)


def _fill_data_parallel(sizes: dict[str, int], data_parallel_size: int) -> dict[str, int]:
    """``sizes`` with the one ``AUTO`` data-parallel size (if any) set so that ``num_sites x dp_replicate x dp_shard
    == data_parallel_size``; ValueError naming the sizes and the fix when they cannot."""
    dp = {name: sizes[name] for name in _DATA_PARALLEL_FIELDS}
    auto = [name for name, value in dp.items() if value == AUTO]
    fixed = math.prod(v for v in dp.values() if v != AUTO)
    product = " x ".join(f"{n}={'auto' if v == AUTO else v}" for n, v in dp.items())
    if auto and data_parallel_size % fixed:
        raise ValueError(
            f"ParallelLayout: data_parallel_size={data_parallel_size} counts the data-parallel ranks of all sites "
            f"(num_sites x dp_replicate x dp_shard), so it must be a multiple of {product} = {fixed} for {auto[0]} "
            f"to be a whole number. Pass a data_parallel_size that {fixed} divides, or other sizes."
        )
    if auto:
        return {**sizes, auto[0]: data_parallel_size // fixed}
    if fixed != data_parallel_size:
        raise ValueError(
            f"ParallelLayout: data_parallel_size={data_parallel_size} counts the data-parallel ranks of all sites, "
            f"but {product} = {fixed}. Pass data_parallel_size={fixed}, or leave dp_shard unset (it then becomes "
            f"data_parallel_size / (num_sites x dp_replicate))."
        )
    return dict(sizes)


def _resolve_world(sizes: dict[str, int], data_parallel_size: int | None, world: int) -> dict[str, int]:
    """``_resolve_sizes``; with ``data_parallel_size`` (already filled into the data-parallel sizes) the check is
    ``data_parallel_size x pipeline_parallel_size x tensor_parallel_size == world``, and so is the advice."""
    if data_parallel_size is None:
        return _resolve_sizes(sizes, world)
    outer = {"data_parallel_size": data_parallel_size, "pipeline_parallel_size": sizes["pipeline_parallel_size"],
             "tensor_parallel_size": sizes["tensor_parallel_size"]}
    resolved = _resolve_sizes(outer, world)
    return {**sizes, "pipeline_parallel_size": resolved["pipeline_parallel_size"],
            "tensor_parallel_size": resolved["tensor_parallel_size"]}


def _what_fits(sizes: dict[str, int], world: int) -> str:
    """Single-size changes that would make ``sizes`` fit ``world``, as a sentence."""
    auto = AUTO in sizes.values()
    options = []
    for name, value in sizes.items():
        if value == AUTO:
            continue
        others = math.prod(v for n, v in sizes.items() if n != name and v != AUTO)
        if world % others:
            continue
        room = world // others
        if auto:  # the inferred size absorbs the rest: any divisor of what is left works
            options.append(f"{name} in {[d for d in range(1, room + 1) if room % d == 0]}")
        else:
            options.append(f"{name}={room}")
    hint = "Would fit: " + ", or ".join(options) + "." if options else f"No single change fits {world} ranks."
    return f"{hint} At most one size may be -1 (inferred); the product of the sizes must be {world}."


def _check_sizes_agree(claims: list) -> None:
    """Every rank gathered the same claims; raise the same ValueError on every rank if their sizes disagree."""
    sizes = [c[0] for c in claims]
    differing = [rank for rank, s in enumerate(sizes) if s != sizes[0]]
    if differing:
        fields_ = [name for name in sizes[0] if any(s[name] != sizes[0][name] for s in sizes)]
        where = "; ".join(f"{name}: " + ", ".join(f"{value} on {_ranks_and_sites(ranks, claims)}"
                                                   for value, ranks in _by_value(sizes, name).items())
                          for name in fields_)
        raise ValueError(
            f"ranks disagree on the parallel layout ({where}): rank 0 has {sizes[0]}, ranks {differing} have "
            f"{[sizes[r] for r in differing]}; pass the same sizes / MULTIDC_* variables on every rank. Sites of "
            f"different sizes differ in dp_shard only: leave dp_shard unset (each site's is inferred from its ranks); "
            f"pipeline_parallel_size, tensor_parallel_size and dp_replicate must be the same on every site."
        )
    given = [rank for rank, c in enumerate(claims) if not c[1]]
    if 0 < len(given) < len(claims):
        raise ValueError(
            f"ranks {given} give num_sites (argument or {_env.NUM_SITES}) and the others do not (they count "
            f"{_env.SITE} names); pass the same num_sites / {_env.NUM_SITES} on every rank, or on none."
        )


def _check_sites(layout: ParallelLayout, sites: list, *, counted: bool) -> None:
    """``MULTIDC_SITE`` per rank (``sites``) names ``layout.num_sites`` contiguous blocks, or is unset everywhere."""
    if all(s is None for s in sites):
        return
    if any(s is None for s in sites):
        missing = [r for r, s in enumerate(sites) if s is None]
        raise ValueError(f"ranks {missing} have no {_env.SITE} while others do; set it on every rank or on none.")
    if layout.unequal_sites:
        if _block_sizes(sites) != list(layout.site_sizes):
            raise ValueError(f"{_env.SITE} per rank is {sites}, but ParallelLayout(site_sizes="
                             f"{list(layout.site_sizes)}) needs contiguous blocks of those sizes, in rank order.")
        return
    blocks = [sites[s * layout.site_size : (s + 1) * layout.site_size] for s in range(layout.num_sites)]
    names = [block[0] for block in blocks]
    if any(len(set(block)) != 1 for block in blocks) or len(set(names)) != layout.num_sites:
        counted_from = f", the number of distinct {_env.SITE} names" if counted else ""
        raise ValueError(
            f"{_env.SITE} per rank is {sites}, but ParallelLayout(num_sites={layout.num_sites}{counted_from}) needs "
            f"each site to be a contiguous block of {layout.site_size} ranks (site s = ranks s*{layout.site_size}.."
            f"(s+1)*{layout.site_size}-1). Give the ranks of each site consecutive global ranks (torchrun: one "
            f"node rank range per site) and the same num_sites."
        )


def _parse_site_sizes(sizes) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"ParallelLayout.site_sizes={sizes!r} must be the ranks of each site, e.g. (2, 1).")
    sizes = tuple(sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"ParallelLayout.site_sizes={sizes!r} must hold a positive int per site, e.g. (2, 1).")
    return sizes


def _check_unequal(layout: ParallelLayout, *, explicit_dp_shard: bool) -> None:
    """Unequal sites differ in ``dp_shard`` only; ValueError naming what to change otherwise."""
    sizes, inner_names = list(layout.site_sizes), ("pipeline_parallel_size", "dp_replicate", "tensor_parallel_size")
    inferred = [n for n in inner_names if getattr(layout, n) == AUTO]
    if inferred:
        raise ValueError(f"ParallelLayout: sites of {sizes} ranks differ in dp_shard only, inferred per site; "
                         f"{inferred} cannot be inferred as well: give them a number, the same on every site.")
    if explicit_dp_shard:
        raise ValueError(
            f"ParallelLayout: dp_shard={layout.dp_shard} (or {_env.DP_SHARD}) with sites of {sizes} ranks: each "
            f"site's dp_shard is inferred from its ranks (site ranks / (pipeline_parallel_size x dp_replicate x "
            f"tensor_parallel_size)); leave dp_shard and {_env.DP_SHARD} unset."
        )
    inner = math.prod(getattr(layout, n) for n in inner_names)
    bad = [s for s, n in enumerate(sizes) if n % inner]
    if bad:
        raise ValueError(
            f"ParallelLayout: site {bad[0]} has {sizes[bad[0]]} ranks, not a multiple of pipeline_parallel_size x "
            f"dp_replicate x tensor_parallel_size = {inner} (the same on every site; sites differ in dp_shard "
            f"only). Give every site a multiple of {inner} ranks."
        )
    dp = sum(n // inner * layout.dp_replicate for n in sizes)
    given = layout._given_data_parallel_size
    if given is not None and given != dp:
        raise ValueError(f"ParallelLayout: data_parallel_size={given}, but sites of {sizes} ranks hold {dp} "
                         f"data-parallel ranks; leave it unset.")


def _block_sizes(names: list) -> list[int] | None:
    """The sizes of the runs of equal ``MULTIDC_SITE`` names, when every rank names one and each name is one
    contiguous run; else ``None``."""
    if any(n is None for n in names):
        return None
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    if len({name for name, _ in runs}) != len(runs):
        return None
    return [count for _, count in runs]


def _by_value(sizes: list[dict], name: str) -> dict:
    values: dict = {}
    for rank, s in enumerate(sizes):
        values.setdefault(s[name], []).append(rank)
    return values


def _ranks_and_sites(ranks: list[int], claims: list) -> str:
    sites = sorted({str(claims[r][2]) for r in ranks if claims[r][2] is not None})
    return f"ranks {ranks}" + (f" (site {', '.join(repr(n) for n in sites)})" if sites else "")
