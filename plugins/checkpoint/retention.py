"""Which checkpoints exist (committed only), which one ``"latest"`` means, and deleting the ones not kept.

Deleting never comes before the commit that makes it safe: a new checkpoint is committed first, then what it
supersedes is removed, and a committed checkpoint loses its ``COMMIT.json`` before anything else, so a crash
mid-delete never leaves a partial checkpoint that looks committed.
"""

from __future__ import annotations

import logging
import uuid

from multidc.plugins.checkpoint.format import COMMIT, checkpoint_name, parse_step
from multidc.plugins.checkpoint.object_store import ObjectStore

_log = logging.getLogger("multidc.plugins.checkpoint")


def _candidates(store: ObjectStore) -> list[tuple[int, str]]:
    found = [(parse_step(name), name) for name in store.list_dirs()]
    return sorted((step, name) for step, name in found if step is not None)


def committed(store: ObjectStore) -> list[tuple[int, str]]:
    """``(step, name)`` of every committed checkpoint under ``store``, oldest first."""
    return [(step, name) for step, name in _candidates(store) if store.exists(f"{name}/{COMMIT}")]


def newest_committed(store: ObjectStore) -> tuple[int, str] | None:
    """``(step, name)`` of the committed checkpoint with the highest step, or ``None`` (few requests: newest first)."""
    for step, name in reversed(_candidates(store)):
        if store.exists(f"{name}/{COMMIT}"):
            return step, name
    return None


def resolve(store: ObjectStore, which) -> str:
    """Folder name for ``which``: ``"latest"``, a step, a name or a CheckpointInfo; FileNotFoundError if absent."""
    which = getattr(which, "name", which)
    if which == "latest":
        found = newest_committed(store)
        if found is None:
            raise FileNotFoundError(f"no committed checkpoint under {store.where()}")
        return found[1]
    return require_committed(store, name_of(which))


def name_of(which) -> str:
    """The folder name ``which`` (a step, a name or a CheckpointInfo; not ``"latest"``) means; ValueError if none."""
    which = getattr(which, "name", which)
    if isinstance(which, bool) or not isinstance(which, (int, str)):
        raise ValueError(f"which={which!r}: pass 'latest', a step number or a checkpoint name.")
    name = checkpoint_name(which) if isinstance(which, int) else which.strip("/").rsplit("/", 1)[-1]
    if parse_step(name) is None:
        raise ValueError(f"which={which!r} is not 'latest', a step number or a name like {checkpoint_name(100)!r}.")
    return name


def require_committed(store: ObjectStore, name: str) -> str:
    """``name``, if folder ``name`` holds a committed checkpoint; else FileNotFoundError."""
    if not store.exists(f"{name}/{COMMIT}"):
        raise FileNotFoundError(f"checkpoint {store.where(name)} does not exist or was never committed")
    return name


def claim(store: ObjectStore, name: str, step: int, *, replace: bool) -> str | None:
    """Before saving checkpoint ``name`` of ``step`` (one rank): enforce the step order, then ``claim_folder``.

    Raises:
        ValueError: without ``replace``, a committed checkpoint of this or a later step exists: the save would not
            become ``latest`` and ``keep_last_k`` could delete it at once.
    """
    check_order(newest_committed(store), step, replace=replace, where=store.where, name=name)
    return claim_folder(store, name)


def check_order(newest: tuple[int, str] | None, step: int, *, replace: bool, where, name: str) -> None:
    """ValueError unless a save of ``step`` (folder ``name``) may follow the ``newest`` committed ``(step, name)``
    (see :func:`claim`); ``where(name)`` names a folder in messages."""
    if newest is not None and newest[0] >= step and not replace:
        if newest[0] == step:
            raise ValueError(f"checkpoint {where(name)} is already committed; save under a higher step, "
                             "delete it first, or pass replace=True to replace it.")
        raise ValueError(
            f"step {step} is not after the newest committed checkpoint {where(newest[1])}: latest() and "
            f"keep_last_k order checkpoints by step, so this save would not be the latest and retention could "
            f"delete it at once. Save a step > {newest[0]}, delete the newer checkpoints, save under another URL, "
            "or pass replace=True to supersede them. Nothing was written.")


def clear_file(store: ObjectStore, name: str = "") -> None:
    """Delete a plain file at ``name`` (``""``: the root), e.g. a single-file checkpoint of another format: a
    checkpoint folder cannot take its place while it exists."""
    if store.fs.isfile(store.path(name)):
        store.delete(name)


def claim_folder(store: ObjectStore, name: str) -> str | None:
    """Prepare folder ``name`` for a new checkpoint; return the tag its shard objects must carry, or ``None``.

    Not committed: leftovers of a crashed save are deleted and shards get their plain names (``None``).
    Committed (the caller replaces it): nothing is deleted; the new shards get a fresh tag, so the committed
    checkpoint keeps every object it references until the new ``COMMIT.json`` replaces its record.
    """
    if store.exists(f"{name}/{COMMIT}"):
        return uuid.uuid4().hex[:12]
    store.delete_tree(name)
    return None


def delete_committed(store: ObjectStore, name: str = "") -> None:
    """Delete the checkpoint folder ``name``, or with ``""`` every checkpoint under the root and the root itself.
    Commit records go first, so a half-deleted checkpoint never looks committed."""
    for folder in [name] if name else [n for _, n in committed(store)]:
        store.delete(f"{folder}/{COMMIT}")
    store.delete_tree(name)


def _remove_unreferenced(store: ObjectStore, name: str, files: set[str]) -> None:
    keep = {COMMIT, *files}
    for key in store.list_files(name):
        if key not in keep:
            store.delete(f"{name}/{key}")


def remove_replaced(store: ObjectStore, name: str, files: set[str], *, where=None) -> None:
    """After folder ``name`` (``""``: the root) committed: delete its objects the commit record does not
    reference (shards it replaced, leftovers of crashed saves); ``files`` are those it references. Never raises:
    a failure is logged as a warning (see :func:`clean_after_commit`)."""
    where, left = where or store.where, []
    _attempt(left, f"replaced shard objects of {where(name)}", _remove_unreferenced, store, name, files)
    _report(where, name, left)


def _attempt(left: list[str], what: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # the save succeeded; reported by _report, not raised
        left.append(f"{what} ({type(exc).__name__}: {exc})")


def _report(where, name: str, left: list[str]) -> None:
    if left:
        _log.warning("checkpoint %s is committed, but cleaning up after it failed; left behind: %s. The next save "
                     "retries; delete them by hand if they take space.", where(name), "; ".join(left))


def clean_after_commit(store: ObjectStore, name: str, files: set[str], *, keep_last_k: int | None,
                       supersede: bool, where=None) -> None:
    """After ``name`` committed (its shards are ``files``): remove what it replaced and what is not kept.

    In order: objects of ``name`` it no longer references; with ``supersede``, committed checkpoints of later
    steps; with ``keep_last_k``, committed checkpoints beyond the ``k`` newest (``name`` is always one of them,
    it is never deleted); half-written folders. Runs on one rank while no other save of this job is in flight.
    The checkpoint is committed, so a failed deletion is logged as a warning on ``multidc.plugins.checkpoint``
    naming what was left behind, and the next save tries again. The one exception: a superseded checkpoint whose
    commit record cannot be deleted raises RuntimeError (it would still be ``latest``). ``where(key)`` names a
    location in these messages (default ``store.where``; under regions it names the region too).
    """
    where, left = where or store.where, []
    _attempt(left, f"replaced shard objects of {where(name)}", _remove_unreferenced, store, name, files)
    try:
        candidates = _candidates(store)
    except Exception as exc:  # as above
        candidates = []
        left.append(f"every older or half-written checkpoint under {where()} (listing failed: "
                    f"{type(exc).__name__}: {exc})")
    step = parse_step(name)
    others = [(s, n) for s, n in candidates if n != name]
    done, half = [], []
    for s, n in others:
        try:
            (done if store.exists(f"{n}/{COMMIT}") else half).append((s, n))
        except Exception as exc:  # as above
            left.append(f"{where(n)} (could not tell whether it is committed: {type(exc).__name__}: {exc})")
    superseded = [n for s, n in done if supersede and s > step]
    # A superseded checkpoint that stays committed would still be `latest` (it has the higher step): a commit
    # record that cannot be deleted raises below, instead of a warning nobody reads before resuming.
    stuck = []
    for n in superseded:
        try:
            store.delete(f"{n}/{COMMIT}")
        except Exception as exc:  # raised below, after the rest of the clean-up
            stuck.append(f"{where(n)} ({type(exc).__name__}: {exc})")
            continue
        _attempt(left, where(n), store.delete_tree, n)  # uncommitted: its shards go like a half-written one's
    kept = [n for s, n in done if n not in superseded]
    doomed = kept[: max(0, len(kept) - (keep_last_k - 1))] if keep_last_k is not None else []
    for n in doomed:
        _attempt(left, where(n), delete_committed, store, n)
    for _, n in half:
        _attempt(left, f"half-written {where(n)}", store.delete_tree, n)
    _report(where, name, left)
    if stuck:
        raise RuntimeError(
            f"{where(name)} is committed, but checkpoints it was to supersede (replace=True) are still "
            f"committed, so `latest` resolves to them and not to it: {'; '.join(stuck)}. Delete their COMMIT.json "
            "by hand before resuming from `latest`, or load this checkpoint by its step.")
