"""One ranged GET of an object straight into a caller's buffer, stoppable between chunks.

On S3 the response body is streamed in ``chunk_bytes`` pieces into ``out`` (no whole-range ``bytes`` object); on
other filesystems it is one ``cat_file(path, start, end)``. Either way ``stop`` is checked before every chunk is
written: once it is set (the load failed on some rank), nothing more lands in ``out``.
"""

from __future__ import annotations

from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreError

CHUNK_BYTES = 1 << 20


class Abandoned(RuntimeError):
    """Work of a checkpoint collective that already failed on this rank: stopped before writing anything more."""

    retryable = False  # ObjectStore's retries must end at once, not try again


def check_stop(stop, what: str) -> None:
    """Raise :class:`Abandoned` if ``stop`` (anything with ``is_set()``, e.g. a ``threading.Event``) is set."""
    if stop is not None and stop.is_set():
        raise Abandoned(f"{what} stopped: a checkpoint collective of this rank failed meanwhile")


def read_into(store: ObjectStore, key: str, start: int, out: memoryview, *, stop=None,
              chunk_bytes: int = CHUNK_BYTES) -> None:
    """Fill ``out`` with bytes ``[start, start + len(out))`` of object ``key`` (retried by ``store.retry``).

    ``stop``: optional ``threading.Event`` (or anything with ``is_set()``); once set, the read raises
    :class:`Abandoned` before writing more.
    Raises ``ObjectStoreError`` if the object is shorter than the range.
    """
    if not len(out):
        return
    end = start + len(out)
    what = f"reading bytes [{start}, {end}) of {store.where(key)}"
    if store.is_s3:
        bucket, s3key = store.path(key).split("/", 1)
        store._call(lambda: store._sync(_stream(store, bucket, s3key, start, out, stop, chunk_bytes, what)), key)
        return

    def whole():
        data = store.fs.cat_file(store.path(key), start=start, end=end)
        _check_length(len(data), len(out), what)
        check_stop(stop, what)
        out[:] = data

    store._call(whole, key)


async def _stream(store, bucket, s3key, start, out, stop, chunk_bytes, what) -> None:
    resp = await store.fs._call_s3("get_object", Bucket=bucket, Key=s3key,
                                   Range=f"bytes={start}-{start + len(out) - 1}")
    body, filled = resp["Body"], 0
    try:
        while True:
            chunk = await body.read(chunk_bytes)
            if not chunk:
                break
            check_stop(stop, what)
            if filled + len(chunk) > len(out):
                _check_length(filled + len(chunk), len(out), what)
            out[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
    finally:
        body.close()
    _check_length(filled, len(out), what)


def _check_length(got: int, wanted: int, what: str) -> None:
    if got != wanted:  # not transient: the object is not the one the commit record describes
        raise ObjectStoreError(f"{what}: got {got} bytes, expected {wanted} (the object is shorter or longer "
                               "than the commit record says)")
