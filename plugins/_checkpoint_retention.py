"""Which checkpoints exist (committed only), which one ``"latest"`` means, and deleting the ones not kept."""

from __future__ import annotations

from multidc.plugins._checkpoint_format import COMMIT, checkpoint_name, parse_step
from multidc.plugins.object_store import ObjectStore


def _candidates(store: ObjectStore) -> list[tuple[int, str]]:
    found = [(parse_step(name), name) for name in store.list_dirs()]
    return sorted((step, name) for step, name in found if step is not None)


def committed(store: ObjectStore) -> list[tuple[int, str]]:
    """``(step, name)`` of every committed checkpoint under ``store``, oldest first."""
    return [(step, name) for step, name in _candidates(store) if store.exists(f"{name}/{COMMIT}")]


def resolve(store: ObjectStore, which) -> str:
    """Folder name for ``which``: ``"latest"``, a step, a name or a CheckpointInfo; FileNotFoundError if absent."""
    which = getattr(which, "name", which)
    if which == "latest":
        found = committed(store)
        if not found:
            raise FileNotFoundError(f"no committed checkpoint under {store.where()}")
        return found[-1][1]
    if isinstance(which, bool) or not isinstance(which, (int, str)):
        raise ValueError(f"which={which!r}: pass 'latest', a step number or a checkpoint name.")
    name = checkpoint_name(which) if isinstance(which, int) else which.strip("/").rsplit("/", 1)[-1]
    if parse_step(name) is None:
        raise ValueError(f"which={which!r} is not 'latest', a step number or a name like {checkpoint_name(100)!r}.")
    if not store.exists(f"{name}/{COMMIT}"):
        raise FileNotFoundError(f"checkpoint {store.where(name)} does not exist or was never committed")
    return name


def clean(store: ObjectStore, *, keep_last_k: int | None, just_committed: str) -> list[str]:
    """Delete half-written folders and, with ``keep_last_k``, committed ones beyond the newest ``k``.

    Runs on one rank right after ``just_committed`` was committed (no other save of this job is in flight then).
    A committed checkpoint loses its ``COMMIT.json`` first, so a crash mid-delete never leaves a partial
    checkpoint that looks committed. Returns the deleted names.
    """
    kept, deleted = [], []
    for step, name in _candidates(store):
        if name != just_committed and not store.exists(f"{name}/{COMMIT}"):
            store.delete_tree(name)
            deleted.append(name)
        else:
            kept.append(name)
    if keep_last_k is not None:
        for name in kept[:-keep_last_k]:
            store.delete(f"{name}/{COMMIT}")
            store.delete_tree(name)
            deleted.append(name)
    return deleted
