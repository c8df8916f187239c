"""``ObjectStore``: one fsspec location (``s3://bucket/prefix``, ``file:///dir`` or a local path) with retries,
parallel multipart uploads and errors that say what is wrong without leaking a secret.

Credentials and endpoint come from the standard places only: for ``s3://`` the AWS environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL[_S3]``,
``AWS_PROFILE``), ``~/.aws/config`` / ``credentials``, instance roles, or ``storage_options`` handed to s3fs
(``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs``...). They are never logged, never part of an
error message and never part of this object's ``repr``.

Errors: :class:`ObjectStoreAuthError` (wrong or missing credentials, also a ``PermissionError``),
:class:`ObjectStoreNotFoundError` (bucket missing, also a ``FileNotFoundError``), and :class:`ObjectStoreError`
for everything else after the retry budget; each names the endpoint, the bucket and the key involved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from multidc.plugins.checkpoint.s3_multipart import S3_MIN_PART, multipart_put
from multidc.plugins.checkpoint.segments import Segments

_T = TypeVar("_T")
_log = logging.getLogger("multidc.plugins.object_store")  # the name users configure (module moved)
_MIB = 1 << 20
# ``s3:/bucket`` or ``s3:bucket`` (a scheme without ``//``) would otherwise become a local folder named "s3:".
_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")
# Characters S3 allows in bucket names (legacy us-east-1 buckets included); anything else cannot be a bucket.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
_SECRET_OPTIONS = ("secret", "token", "key", "aws_secret_access_key", "aws_session_token", "password")


class ObjectStoreError(RuntimeError):
    """An object-store operation failed; the message names endpoint, bucket and key, never a secret."""


class ObjectStoreAuthError(ObjectStoreError, PermissionError):
    """The store refused the credentials (wrong key/secret, expired token, no permission on the bucket)."""


class ObjectStoreNotFoundError(ObjectStoreError, FileNotFoundError):
    """The bucket (or root folder) does not exist."""


@dataclass(kw_only=True)
class RetryPolicy:
    """How transient failures (connection reset, 5xx, throttling) are retried. Auth / not-found never are."""

    attempts: int = 5
    """Tries per operation, the first included."""
    initial_backoff_s: float = 0.5
    """Sleep before the second try, in seconds; doubled after each failure (with +-25% jitter)."""
    max_backoff_s: float = 20.0
    """Upper bound of one sleep, in seconds."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts={self.attempts} must be >= 1.")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy backoff times must be >= 0 seconds.")


def _import_fsspec():
    try:
        import fsspec
    except ImportError:
        raise ImportError("object-store checkpoints need fsspec: pip install 'multidc[s3]'") from None
    return fsspec


class ObjectStore:
    """Read and write objects under one root URL. Thread-safe; keys are ``/``-separated and relative to the root.

    Args:
        url: ``s3://bucket/prefix``, ``file:///abs/dir``, a local path, or any fsspec URL.
        storage_options: passed to the fsspec filesystem (for s3fs: ``endpoint_url``, ``key``, ``secret``...).
        retry: retry policy for transient errors.
        part_size_mb: multipart part size for S3 uploads, in MiB (>= 5); objects of at least two parts go up
            as a multipart upload whose parts are sent ``max_concurrency`` at a time.
        max_concurrency: parallel requests per upload or batched read.
    """

    def __init__(self, url: str | os.PathLike, *, storage_options: dict | None = None,
                 retry: RetryPolicy | None = None, part_size_mb: float = 16, max_concurrency: int = 8) -> None:
        url = os.fspath(url)
        if not url or not url.strip():
            raise ValueError("checkpoint URL is empty; pass s3://bucket/prefix, file:///dir or a local path.")
        if part_size_mb * _MIB < S3_MIN_PART:
            raise ValueError(f"part_size_mb={part_size_mb} is below the S3 minimum part size of 5 MiB.")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1.")
        fsspec = _import_fsspec()
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.part_size = int(part_size_mb * _MIB)
        self.max_concurrency = max_concurrency
        self._secrets = _secret_values(storage_options or {})
        options = dict(storage_options or {})
        malformed = _SCHEME_WITHOUT_SLASHES.match(url)
        if malformed:
            raise ValueError(f"checkpoint URL {url!r} is malformed: write {malformed.group(1)}://bucket/prefix (two "
                             "slashes after the colon), or a local path without a colon.")
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        if protocol in ("s3", "s3a"):
            bucket = url.split("://", 1)[1].strip("/").split("/", 1)[0]
            if not bucket:
                raise ValueError(f"checkpoint URL {url!r} names no bucket; use s3://bucket/prefix.")
            if not _BUCKET.fullmatch(bucket):
                raise ValueError(f"checkpoint URL {url!r}: {bucket!r} is not a valid S3 bucket name (3-255 letters, "
                                 "digits, '.', '-', '_'; no spaces); use s3://bucket/prefix.")
            _import_s3fs()
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except (ValueError, ImportError) as exc:
            raise ValueError(f"cannot open checkpoint URL {self.url!r}: {self._scrub(str(exc))}") from None
        self.protocol = protocol
        self.is_s3 = protocol in ("s3", "s3a")
        self.is_local = protocol in ("file", "local")
        self.root = self.root.rstrip("/")
        if self.is_s3 and not self.root.split("/", 1)[0]:
            raise ValueError(f"checkpoint URL {self.url!r} names no bucket; use s3://bucket/prefix.")

    # ----------------------------------------------------------------- description (no secrets)
    @property
    def bucket(self) -> str | None:
        return self.root.split("/", 1)[0] if self.is_s3 else None

    @property
    def endpoint(self) -> str:
        if not self.is_s3:
            return f"{self.protocol} filesystem"
        endpoint = getattr(self.fs, "endpoint_url", None) or (self.fs.client_kwargs or {}).get("endpoint_url")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return endpoint or "the default AWS S3 endpoint"

    def where(self, key: str = "") -> str:
        """``'<url>/<key>' (endpoint ..., bucket ...)``: how errors name a location."""
        path = f"{self.url}/{key}" if key else self.url
        return f"{path} (endpoint {self.endpoint}, bucket {self.bucket})" if self.is_s3 else path

    def __repr__(self) -> str:
        return f"ObjectStore({self.where()})"

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    # ----------------------------------------------------------------- operations
    def check_access(self) -> None:
        """Fail fast with a clear error if the bucket is missing or the credentials are refused.

        For S3 this is one ``HeadBucket`` request; for a local path it creates the root folder. Writes nothing
        to object storage.
        """
        if self.is_s3:
            bucket = self.bucket
            try:
                self._call(lambda: self._sync(self.fs._call_s3("head_bucket", Bucket=bucket)), "")
            except ObjectStoreNotFoundError:
                raise ObjectStoreNotFoundError(
                    f"bucket {bucket!r} does not exist at endpoint {self.endpoint} (checkpoint URL {self.url}); "
                    "create it or fix the URL.") from None
        else:
            self._call(lambda: self.fs.makedirs(self.root, exist_ok=True), "")

    def put(self, key: str, data: bytes | memoryview | Segments, *, atomic: bool = False, stop=None) -> None:
        """Write one object (replacing it). Large S3 objects go up as parallel multipart uploads.

        ``data`` may be :class:`Segments` (several buffers stored back to back): they are sent as they are, never
        joined into one copy, except an S3 object below two parts (one PUT of at most ``2 * part_size`` bytes).
        ``atomic=True`` guarantees readers never see a partial object: S3 PUTs are atomic already; on other
        filesystems the data is written under a temporary name and renamed. ``stop`` (anything with ``is_set()``):
        once it is set, a multipart upload cancels its parts, even those in flight, aborts, and raises the error
        ``check_stop`` (checkpoint/stop.py) gives; a single PUT (under two parts) is not stopped.
        """
        data = data if isinstance(data, Segments) else Segments([data])
        if self.is_s3 and len(data) >= 2 * self.part_size:
            return multipart_put(self, key, data, stop=stop)
        if atomic and not self.is_s3:
            tmp = f"{key}.tmp-{uuid.uuid4().hex[:8]}"
            self._call(lambda: self._pipe(tmp, data), tmp)
            self._call(lambda: self.fs.mv(self.path(tmp), self.path(key)), key)
            return None
        self._call(lambda: self._pipe(key, data), key)

    def _pipe(self, key: str, data: Segments) -> None:
        if self.is_s3:
            self.fs.pipe_file(self.path(key), data.tobytes())  # botocore takes bytes, not memoryview
            return
        self.fs.makedirs(self.fs._parent(self.path(key)), exist_ok=True)
        with self.fs.open(self.path(key), "wb") as f:  # buffer by buffer: no joined copy of a large shard
            for view in data.views:
                f.write(view)

    def get(self, key: str) -> bytes:
        return self._call(lambda: self.fs.cat_file(self.path(key)), key)

    def get_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Read byte ranges ``[(key, start, end), ...]`` (end exclusive), in parallel where the store allows."""
        if not ranges:
            return []
        wanted = [i for i, (_, start, end) in enumerate(ranges) if end > start]  # S3 rejects empty ranges
        paths = [self.path(ranges[i][0]) for i in wanted]
        starts, ends = [ranges[i][1] for i in wanted], [ranges[i][2] for i in wanted]
        extra = {"batch_size": self.max_concurrency} if getattr(self.fs, "async_impl", False) else {}

        def read():
            out = self.fs.cat_ranges(paths, starts, ends, on_error="return", **extra) if wanted else []
            for value in out:
                if isinstance(value, BaseException):
                    raise value
            result = [b""] * len(ranges)
            for i, value in zip(wanted, out):
                result[i] = value
            return result

        return self._call(read, ranges[0][0] if len({k for k, _, _ in ranges}) == 1 else "<several objects>")

    def read_into(self, key: str, start: int, out, *, stop=None) -> None:
        """Fill ``out`` (a memoryview, or ``(offset, view)`` parts) with bytes of ``key`` from ``start``: one
        ranged GET, streamed, stoppable between chunks by ``stop`` (see ``ranged_read.read_into``)."""
        from multidc.plugins.checkpoint.ranged_read import read_into

        read_into(self, key, start, out, stop=stop)

    def exists(self, key: str) -> bool:
        return self._call(lambda: self.fs.exists(self.path(key)), key)

    def list_dirs(self, key: str = "") -> list[str]:
        """Names of the immediate sub-folders of ``key`` (fresh listing, no cache); empty if it does not exist."""
        path = self.path(key)

        def listing():
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                if self.is_s3:
                    self._sync(self.fs._call_s3("head_bucket", Bucket=self.bucket))
                return []
            return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

        return self._call(listing, key)

    def list_files(self, key: str = "") -> list[str]:
        """Keys of every object under ``key``, relative to ``key`` (fresh listing, no cache); empty if none."""
        path = self.path(key)

        def listing():
            self._forget(path)
            try:
                found = self.fs.find(path)
            except FileNotFoundError:
                return []
            finally:
                # find() caches every listing under path, and exists() answers from that cache: objects deleted
                # later by another process or filesystem instance would still look present.
                self._forget(path)
            return [p[len(path) + 1:] for p in found if p.startswith(f"{path}/")]

        return self._call(listing, key)

    def _forget(self, path: str) -> None:
        """Drop fsspec's cached listings of ``path``, its parents and everything below it."""
        self.fs.invalidate_cache(path)
        for cached in [k for k in list(getattr(self.fs, "dircache", {})) if k.startswith(f"{path}/")]:
            self.fs.invalidate_cache(cached)

    def size(self, key: str) -> int:
        return int(self._call(lambda: self.fs.info(self.path(key))["size"], key))

    def delete_tree(self, key: str) -> None:
        """Delete ``key`` and everything under it; a missing ``key`` is not an error."""
        def remove():
            try:
                self.fs.rm(self.path(key), recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(self.path(key))

        self._call(remove, key)

    def delete(self, key: str) -> None:
        def remove():
            try:
                self.fs.rm_file(self.path(key))
            except FileNotFoundError:
                pass

        self._call(remove, key)

    def _sync(self, coro):
        from fsspec.asyn import sync

        return sync(self.fs.loop, lambda: coro)

    # ----------------------------------------------------------------- retries and error translation
    def _call(self, fn: Callable[[], _T], key: str) -> _T:
        started = time.monotonic()
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn()
            except BaseException as exc:  # classified below, never swallowed
                error = self._classify(exc, key, attempt, started)
                if error is None:
                    time.sleep(self._retry_delay(exc, key, attempt))
                    continue
                raise error from None
        raise AssertionError("unreachable")

    async def _acall(self, fn, key: str):
        started = time.monotonic()
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return await fn()
            except BaseException as exc:
                error = self._classify(exc, key, attempt, started)
                if error is None:
                    await asyncio.sleep(self._retry_delay(exc, key, attempt))
                    continue
                raise error from None
        raise AssertionError("unreachable")

    def _retry_delay(self, exc: BaseException, key: str, attempt: int) -> float:
        """The backoff before the next attempt, announced on the ``multidc.plugins.object_store`` logger."""
        delay = self._backoff(attempt)
        _log.warning("%s: attempt %d of %d failed (%s); retrying in %.1f s", self.where(key), attempt,
                     self.retry.attempts, self._scrub(f"{type(exc).__name__}: {exc}"), delay)
        return delay

    def _backoff(self, attempt: int) -> float:
        base = min(self.retry.max_backoff_s, self.retry.initial_backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.75, 1.25)

    def _classify(self, exc: BaseException, key: str, attempt: int, started: float) -> BaseException | None:
        """The error to raise for ``exc``, or ``None`` when it is transient and another attempt is left."""
        if isinstance(exc, ObjectStoreError):
            return exc
        if not isinstance(exc, Exception) or getattr(exc, "retryable", True) is False:
            return exc  # KeyboardInterrupt, SystemExit, work stopped on purpose: never retried, never rewritten
        text = self._scrub(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, PermissionError) or _code(exc) in _AUTH_CODES:
            return ObjectStoreAuthError(
                f"access denied at {self.where(key)}: {text}. Check the credentials (AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options key/secret) and the bucket policy.")
        if isinstance(exc, FileNotFoundError) and self.is_s3 and "bucket" in str(exc).lower():
            return ObjectStoreNotFoundError(
                f"bucket {self.bucket!r} does not exist at endpoint {self.endpoint} (while accessing "
                f"{self.url}/{key}); create it or fix the URL.")
        if isinstance(exc, FileNotFoundError):
            return ObjectStoreNotFoundError(f"{self.where(key)} does not exist")
        if isinstance(exc, (IsADirectoryError, NotADirectoryError, ValueError, TypeError)) or type(
                exc).__name__ == "ParamValidationError":
            return ObjectStoreError(f"{text} at {self.where(key)}")
        if attempt >= self.retry.attempts:
            return ObjectStoreError(
                f"giving up on {self.where(key)} after {attempt} attempts over {time.monotonic() - started:.1f} s "
                f"(RetryPolicy(attempts={self.retry.attempts})); last error: {text}")
        return None

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
               "InvalidToken", "AuthorizationHeaderMalformed", "Forbidden", "403"}


def _code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None) or getattr(exc.__cause__, "response", None) or {}
    return (response.get("Error") or {}).get("Code") if isinstance(response, dict) else None


def _secret_values(options: dict) -> list[str]:
    """Every credential string that must never appear in a message: from the options and the AWS env vars."""
    values, pending = [], [options]
    while pending:
        current = pending.pop()
        for name, value in current.items():
            if isinstance(value, dict):
                pending.append(value)
            elif name.lower() in _SECRET_OPTIONS and value:
                values.append(str(value))
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        if os.environ.get(name):
            values.append(os.environ[name])
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


def _import_s3fs():
    try:
        import s3fs  # noqa: F401
    except ImportError:
        raise ImportError("s3:// checkpoints need s3fs: pip install 'multidc[s3]'") from None
