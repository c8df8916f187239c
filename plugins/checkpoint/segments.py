"""Bytes held in several buffers, uploaded as one object without joining them.

A sync save stores a rank's items back to back in one shard object. Joining the items' bytes into one buffer
first would copy the rank's whole share (and hold it twice); :class:`Segments` instead lists the buffers (views of
the tensors themselves, and the zero padding between items) and hands an upload each part of the object as a
file-like :meth:`Segments.reader` that copies only the chunk the HTTP client asks for.
"""

from __future__ import annotations

import bisect
import io
import itertools
import zlib


class Segments:
    """Read-only bytes made of ``views`` back to back (bytes-like objects; empty ones are dropped). No copy."""

    def __init__(self, views=()) -> None:
        self.views = [view for view in (memoryview(v).cast("B") for v in views) if len(view)]
        self._ends = list(itertools.accumulate(len(view) for view in self.views))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _locate(self, position: int) -> tuple[int, int]:
        """``(index of the view holding byte position, position inside it)``; ``position < len(self)``."""
        index = bisect.bisect_right(self._ends, position)
        return index, position - (self._ends[index] - len(self.views[index]))

    def slice(self, start: int, end: int) -> Segments:
        """Bytes ``[start, end)`` (clamped to the length), sharing the buffers."""
        start, end = max(0, start), min(end, len(self))
        out = []
        while start < end:
            index, at = self._locate(start)
            view = self.views[index][at:at + end - start]
            out.append(view)
            start += len(view)
        return Segments(out)

    def crc32(self) -> int:
        """CRC-32 (zlib's) of all the bytes."""
        crc = 0
        for view in self.views:
            crc = zlib.crc32(view, crc)
        return crc

    def tobytes(self) -> bytes:
        """One joined copy (for small objects: a client that wants ``bytes``)."""
        return b"".join(self.views)

    def reader(self) -> _Reader:
        """A new seekable file positioned at the first byte."""
        return _Reader(self)


class _Reader(io.RawIOBase):
    """A seekable, read-only file over :class:`Segments`: botocore takes bytes or files, not views, and a joined
    copy of every part in flight would hold as much host memory again as the shard being uploaded. botocore and
    aiohttp read it in chunks (checksum, then send) and seek back to 0 for a retry."""

    def __init__(self, segments: Segments) -> None:
        super().__init__()
        self._segments, self._pos = segments, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        out, done, total = memoryview(buffer).cast("B"), 0, len(self._segments)
        while done < len(out) and self._pos < total:
            index, at = self._segments._locate(self._pos)
            chunk = self._segments.views[index][at:at + len(out) - done]
            out[done:done + len(chunk)] = chunk
            done += len(chunk)
            self._pos += len(chunk)
        return done

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._segments)}
        if whence not in bases or bases[whence] + offset < 0:
            raise ValueError(f"cannot seek to {offset} from whence={whence}")
        self._pos = bases[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos
