"""S3 multipart upload of one object: parts sent concurrently, retried one by one, aborted on failure."""

from __future__ import annotations

import asyncio
import logging

from multidc.plugins.checkpoint.segments import Segments
from multidc.plugins.checkpoint.stop import check_stop

_log = logging.getLogger("multidc.plugins.object_store")
S3_MIN_PART = 5 << 20  # S3's smallest part (all but the last), bytes
_STOP_POLL_S = 0.1  # how soon an upload notices its stop flag while parts are in flight


def multipart_put(store, key: str, data: Segments, *, stop=None) -> None:
    """Upload ``data`` as object ``key`` of ``store`` (an ``ObjectStore`` on S3) in parts of ``store.part_size``
    bytes, ``store.max_concurrency`` at a time, each retried by ``store.retry``. On failure, or once ``stop`` is set
    (checked every ``_STOP_POLL_S``: parts in flight or retrying are cancelled), the multipart upload is aborted and
    the error raised; nothing becomes visible under ``key``."""
    bucket, s3key = store.bucket, store.path(key).split("/", 1)[1]
    upload = store._call(lambda: store._sync(store.fs._call_s3(
        "create_multipart_upload", Bucket=bucket, Key=s3key)), key)["UploadId"]
    starts = list(range(0, len(data), store.part_size))
    if len(data) - starts[-1] < S3_MIN_PART and len(starts) > 1:
        starts.pop()  # fold a short tail into the previous part: only the last part may be < 5 MiB
    bounds = list(zip(starts, starts[1:] + [len(data)]))
    try:
        etags = store._sync(_upload_parts(store, bucket, s3key, upload, data, bounds, key, stop))
        check_stop(stop, f"uploading {store.where(key)}")  # a stopped upload never completes
        parts = [{"PartNumber": i + 1, "ETag": etag} for i, etag in enumerate(etags)]
        store._call(lambda: store._sync(store.fs._call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=s3key, UploadId=upload,
            MultipartUpload={"Parts": parts})), key)
    except BaseException:
        try:
            store._sync(store.fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=s3key, UploadId=upload))
        except Exception as abort_error:  # the original error is the one to raise; a lifecycle rule reaps parts
            _log.warning("%s: could not abort multipart upload after a failed part (%s); its parts stay until the "
                         "bucket's lifecycle rule removes them", store.where(key),
                         store._scrub(f"{type(abort_error).__name__}: {abort_error}"))
        raise
    store.fs.invalidate_cache(store.path(key))


async def _upload_parts(store, bucket, s3key, upload, data, bounds, key, stop) -> list[str]:
    gate = asyncio.Semaphore(store.max_concurrency)
    what = f"uploading {store.where(key)}"

    async def one(number: int, start: int, end: int) -> str:
        async with gate:
            check_stop(stop, what)
            out = await store._acall(lambda: store.fs._call_s3(
                "upload_part", Bucket=bucket, Key=s3key, UploadId=upload, PartNumber=number,
                Body=data.slice(start, end).reader()), key)
            return out["ETag"]

    async def watch() -> None:  # raises once ``stop`` is set: parts in flight or retrying stop too
        while True:
            check_stop(stop, what)
            await asyncio.sleep(_STOP_POLL_S)

    tasks = [asyncio.ensure_future(one(i + 1, s, e)) for i, (s, e) in enumerate(bounds)]
    watcher = asyncio.ensure_future(watch()) if stop is not None else None
    try:
        pending = {*tasks, *([watcher] if watcher is not None else [])}
        while not all(task.done() for task in tasks):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a part out of retries, or the stop: raised here
        return [task.result() for task in tasks]
    except BaseException:
        # One part is out of retries (or the save failed elsewhere): the upload has failed. Stop the other parts
        # now rather than let each spend its own retry budget against a store that is down (and upload into an
        # aborted upload).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
