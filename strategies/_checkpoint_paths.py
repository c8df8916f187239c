"""Lightning checkpoint paths for the multidc strategies, one store or one store per site.

A path is one URL (``s3://b/run/ckpts/last.ckpt``), a template whose ``{site}`` names each site's region
(``s3://ckpt-{site}/run/ckpts/last.ckpt``: ``ModelCheckpoint(dirpath=...)``, ``trainer.save_checkpoint``,
``ckpt_path``), or a mapping site -> URL (``trainer.save_checkpoint`` / ``ckpt_path`` only: ``ModelCheckpoint``
takes a string). The ranks agree on a path as text: a mapping travels as its canonical JSON (:func:`path_key`).
Which region holds what, and when a step is committed, is ``multidc.plugins.checkpoint.regions``'s protocol.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from multidc.plugins.checkpoint.format import COMMIT, parse_step
from multidc.plugins.checkpoint.object_store import ObjectStoreAuthError, ObjectStoreError
from multidc.plugins.checkpoint.regions import Regions, is_regional, site_urls

_log = logging.getLogger("multidc.plugins.checkpoint")


def path_key(path) -> str:
    """``path`` as the text the ranks agree on: a URL / template ``/``-stripped, a mapping as canonical JSON."""
    if isinstance(path, Mapping):
        return json.dumps({str(k): str(v).rstrip("/") for k, v in path.items()}, sort_keys=True)
    return str(path).rstrip("/")


def url_of(key: str):
    """The URL / template / mapping a :func:`path_key` stands for."""
    return json.loads(key) if key.startswith('{"') else key


def _locate_one(text: str) -> tuple[str, str]:
    if text.endswith(f"/{COMMIT}"):
        text = text[: -len(COMMIT) - 1]
    root, _, leaf = text.rpartition("/")
    if root and parse_step(leaf) is not None:
        return root, leaf
    return text, "latest"


def locate(path) -> tuple[str, str]:
    """``(Checkpointer root, which)`` for a Lightning checkpoint path, one of its step folders, or its commit file;
    for a mapping (given or as its :func:`path_key`) the root is a key too, and every site's URL must name the same
    checkpoint."""
    url = url_of(path_key(path))
    if not isinstance(url, Mapping):
        return _locate_one(url)
    found = {site: _locate_one(u) for site, u in url.items()}
    which = {w for _, w in found.values()}
    if len(which) > 1:
        raise ValueError(f"checkpoint path {url!r} names different checkpoints per site ({sorted(which)}): give every "
                         "site the same checkpoint (its root, step folder or COMMIT.json).")
    return path_key({site: root for site, (root, _) in found.items()}), which.pop()


def regions_of(key: str, storage_options, topology) -> Regions:
    """The regions of the regional path ``key`` as this rank sees them (its own site's region local).

    Raises:
        ValueError: the strategy has no topology (no sites) to tell which region a rank writes to.
    """
    if topology is None:
        raise ValueError(f"checkpoint path {url_of(key)!r} names one store per site, but this strategy has no sites "
                         "(e.g. Parallel3DStrategy without replicas across sites): give one URL.")
    names = tuple(topology.layout.site_names)
    urls, options = site_urls(url_of(key), storage_options, site_names=names, setting="checkpoint path")
    return Regions(urls, options, local=names[topology.site], setting="checkpoint_storage_options")


def exists_anywhere(regions: Regions) -> bool:
    """Whether any available region holds something at the regions' root (rank 0: ``ModelCheckpoint`` versions a
    name that exists). An unavailable region counts as holding nothing; refused credentials raise."""
    for region in regions.stores:
        try:
            if regions.call(region, lambda s: s.fs.exists(s.path("")) or bool(s.list_dirs())):
                return True
        except ObjectStoreAuthError:
            raise
        except (ObjectStoreError, OSError) as exc:
            _log.warning("checkpoint region %r is unavailable, left out: %s", region, exc)
    return False


def newest_committed(dirs, storage_options, topology) -> str | None:
    """The commit record path (a template when the directory is one) of the newest checkpoint committed in every
    available region under the ``ModelCheckpoint`` directories ``dirs``: each directory's checkpoint paths are
    Checkpointer roots of step folders. Newest: the latest commit record in the first available region (the local
    one first), then (S3 stamps have 1 s resolution) the highest step. ``None`` if there is none. Rank 0."""
    candidates = []
    for directory in dirs:
        key = path_key(directory)
        regions = regions_of(key, storage_options, topology)
        up, _ = regions.available()
        if not up:
            continue
        lister = regions.local if regions.local in up else up[0]
        store = regions.stores[lister]
        for root in ["", *(f"{name}/" for name in regions.call(lister, lambda s: s.list_dirs()))]:
            sub = regions_of(f"{key}/{root}".rstrip("/"), storage_options, topology)
            for step, name in sub.committed():
                stamp = store.fs.modified(store.path(f"{root}{name}/{COMMIT}"))
                candidates.append((stamp, step, f"{key}/{root}{name}/{COMMIT}"))
    return max(candidates)[2] if candidates else None


def site_leader(ckpt) -> bool:
    """Whether this rank writes what Lightning keeps once (its loops, callbacks, hyper-parameters): rank 0, and under
    regions the first rank of each site, so each region holds it and no site reads it across the WAN."""
    sites = ckpt._sites  # rank -> site, as the Checkpointer gathered it
    return ckpt.comm.rank == 0 or (ckpt.regions is not None and sites.index(sites[ckpt.comm.rank]) == ckpt.comm.rank)


def stores(ckpt) -> list:
    """Every store the Checkpointer writes: its regions' (in site order), or its one."""
    return list(ckpt.regions.stores.values()) if ckpt.regions is not None else [ckpt.store]


def refuse_single_file(ckpt) -> None:
    if ckpt.store.fs.isfile(ckpt.store.path("")):
        raise ValueError(
            f"{ckpt.url} is a single-file Lightning checkpoint; multidc strategies read the directory checkpoints "
            "they write. Load it with the strategy that wrote it, or give HierarchicalDDPStrategy a CheckpointIO "
            "(Trainer(plugins=[...])) / Parallel3DStrategy(save_distributed_checkpoint=False)."
        )


__all__ = ["exists_anywhere", "is_regional", "locate", "newest_committed", "path_key", "refuse_single_file",
           "regions_of", "site_leader", "stores", "url_of"]
