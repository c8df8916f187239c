"""One ranged GET of an object straight into a caller's buffers, stoppable between chunks.

On S3 the response body is streamed in ``chunk_bytes`` pieces into ``out`` (no whole-range ``bytes`` object); on
other filesystems it is one ``cat_file(path, start, end)``. Either way ``stop`` is checked before every chunk is
written: once it is set (the load failed on some rank), nothing more lands in ``out``.
"""

from __future__ import annotations

from multidc.plugins.checkpoint.object_store import ObjectStore, ObjectStoreError
from multidc.plugins.checkpoint.stop import check_stop

CHUNK_BYTES = 1 << 20


def read_into(store: ObjectStore, key: str, start: int, out, *, stop=None, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Fill ``out`` with bytes ``[start, start + len(out))`` of object ``key`` (retried by ``store.retry``).

    ``out``: a writable memoryview, or ``(offset, view)`` parts in order and not overlapping: each view takes bytes
    ``[start + offset, start + offset + len(view))``; one ranged GET reads from ``start`` to the end of the last
    part, and the bytes between parts are dropped.
    ``stop``: optional ``threading.Event`` (or anything with ``is_set()``); once set, the read raises
    the error ``check_stop`` (checkpoint/stop.py) gives, before writing more.
    Raises ``ObjectStoreError`` if the object is shorter than the range.
    """
    parts = [(0, out)] if isinstance(out, memoryview) else out
    parts = [(offset, view) for offset, view in parts if len(view)]  # S3 refuses an empty range
    if not parts:
        return
    length = parts[-1][0] + len(parts[-1][1])
    what = f"reading bytes [{start}, {start + length}) of {store.where(key)}"
    if store.is_s3:
        bucket, s3key = store.path(key).split("/", 1)
        store._call(lambda: store._sync(_stream(store, bucket, s3key, start, length, parts, stop, chunk_bytes, what)),
                    key)
        return

    def whole():
        data = store.fs.cat_file(store.path(key), start=start, end=start + length)
        _check_length(len(data), length, what)
        check_stop(stop, what)
        _scatter(memoryview(data), 0, parts, 0)

    store._call(whole, key)


async def _stream(store, bucket, s3key, start, length, parts, stop, chunk_bytes, what) -> None:
    resp = await store.fs._call_s3("get_object", Bucket=bucket, Key=s3key, Range=f"bytes={start}-{start + length - 1}")
    body, filled, k = resp["Body"], 0, 0
    try:
        while True:
            chunk = await body.read(chunk_bytes)
            if not chunk:
                break
            check_stop(stop, what)
            if filled + len(chunk) > length:
                _check_length(filled + len(chunk), length, what)
            k = _scatter(memoryview(chunk), filled, parts, k)
            filled += len(chunk)
    finally:
        body.close()
    _check_length(filled, length, what)


def _scatter(data: memoryview, at: int, parts: list, k: int) -> int:
    """Copy ``data`` (bytes ``[at, at + len(data))`` of the range) into the parts it overlaps, from part ``k`` on;
    returns the first part it did not fill to the end."""
    end = at + len(data)
    while k < len(parts):
        offset, view = parts[k]
        lo, hi = max(at, offset), min(end, offset + len(view))
        if lo < hi:
            view[lo - offset:hi - offset] = data[lo - at:hi - at]
        if offset + len(view) > end:  # the part goes on in the next chunk
            break
        k += 1
    return k


def _check_length(got: int, wanted: int, what: str) -> None:
    if got != wanted:  # not transient: the object is not the one the commit record describes
        raise ObjectStoreError(f"{what}: got {got} bytes, expected {wanted} (the object is shorter or longer "
                               "than the commit record says)")
