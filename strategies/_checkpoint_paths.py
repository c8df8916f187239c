"""Lightning checkpoint paths for the multidc strategies, one store or one store per site.

A path is one URL (``s3://b/run/ckpts/last.ckpt``), a template whose ``{site}`` names each site's region
(``s3://ckpt-{site}/run/ckpts/last.ckpt``), or a mapping site -> URL, each as ``ModelCheckpoint(dirpath=...)``,
``trainer.save_checkpoint`` or ``ckpt_path``. The ranks agree on a path as text: a mapping travels as its canonical
JSON (:func:`path_key`), to which ``ModelCheckpoint`` joins its file names (``{"eu": "s3://a/run"}/last.ckpt``).
Which region holds what, and when a step is committed, is ``multidc.plugins.checkpoint.regions``'s protocol.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidc.hierarchical import _env
from multidc.plugins.checkpoint.format import COMMIT, parse_step
from multidc.plugins.checkpoint.object_store import ObjectStoreAuthError, ObjectStoreError, ObjectStoreNotFoundError
from multidc.plugins.checkpoint.regions import Regions, is_regional, path_key, site_urls, url_of


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


def regions_of(key: str, storage_options, topology, *, setting: str = "checkpoint_storage_options") -> Regions:
    """The regions of the regional path ``key`` as this rank sees them (its own site's region local); ``setting``
    names the storage options in errors (``checkpoint_storage_options``, or the environment variable they came from).

    Raises:
        ValueError: the strategy has no topology (no sites) to tell which region a rank writes to.
    """
    if topology is None:
        raise ValueError(f"checkpoint path {url_of(key)!r} names one store per site, but this strategy has no sites "
                         "(e.g. Parallel3DStrategy without replicas across sites): give one URL.")
    names = tuple(topology.layout.site_names)
    urls, options = site_urls(url_of(key), storage_options, site_names=names, setting="checkpoint path")
    return Regions(urls, options, local=names[topology.site], setting=setting)


def options_setting(given) -> str:
    """What a user changes to fix the strategies' storage options: ``checkpoint_storage_options`` when ``given``,
    else ``MULTIDC_CKPT_STORAGE_OPTIONS`` (where the options came from then)."""
    return "checkpoint_storage_options" if given is not None else _env.CKPT_STORAGE_OPTIONS


def exists_anywhere(regions: Regions) -> bool:
    """Whether any region holds something at the regions' root (rank 0: ``ModelCheckpoint`` versions a name that
    exists). A region whose bucket is gone holds nothing.

    Raises:
        ObjectStoreError: a region could not be read (unreachable after the retries), naming it: the name might be
            in use there, and a save would overwrite it. ``ObjectStoreAuthError``: refused credentials, naming the
            region and the setting to fix.
    """
    for region in regions.stores:
        try:
            if regions.call(region, _holds_anything):
                return True
        except ObjectStoreNotFoundError:
            continue  # the bucket is gone: nothing is there
        except ObjectStoreAuthError:
            raise
        except ObjectStoreError as exc:
            raise type(exc)(f"cannot tell whether checkpoint {regions.stores[region].url} exists (ModelCheckpoint "
                            f"asks before it names a checkpoint): {exc}. Bring region {region!r} back, or save "
                            "under a path in regions that are available.") from None
    return False


def _holds_anything(store) -> bool:
    return store.exists("") or bool(store.list_dirs())


def newest_committed(dirs, storage_options, topology, *, setting: str = "checkpoint_storage_options") -> str | None:
    """The commit record path (a template when the directory is one) of the newest checkpoint committed in every
    available region under the ``ModelCheckpoint`` directories ``dirs``: each directory's checkpoint paths are
    Checkpointer roots of step folders. Newest: the latest commit record in the first available region (the local
    one first), then (S3 stamps have 1 s resolution) the highest step. ``None`` if there is none. Rank 0."""
    candidates = []
    for directory in dirs:
        key = path_key(directory)
        regions = regions_of(key, storage_options, topology, setting=setting)
        up, _ = regions.available()
        if not up:
            continue
        lister = regions.local if regions.local in up else up[0]
        store = regions.stores[lister]
        for root in ["", *(f"{name}/" for name in regions.call(lister, lambda s: s.list_dirs()))]:
            sub = regions_of(f"{key}/{root}".rstrip("/"), storage_options, topology, setting=setting)
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


__all__ = ["exists_anywhere", "is_regional", "locate", "newest_committed", "options_setting", "path_key",
           "refuse_single_file", "regions_of", "site_leader", "stores", "url_of"]
