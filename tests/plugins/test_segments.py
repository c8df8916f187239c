"""Segments: several buffers read as one object (slices, CRC-32, a file-like reader), checked against the joined
bytes over random splits."""

from __future__ import annotations

import io
import random
import zlib

import pytest

from multidc.plugins.checkpoint.segments import Segments


def _split(data: bytes, rng: random.Random) -> list:
    cuts = sorted(rng.sample(range(len(data) + 1), rng.randint(0, 6)))
    bounds = [0, *cuts, len(data)]
    return [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]  # some empty


@pytest.mark.parametrize("seed", range(20))
def test_slices_crc_and_reader_equal_the_joined_bytes(seed):
    rng = random.Random(seed)
    data = rng.randbytes(rng.randint(0, 300))
    segments = Segments(_split(data, rng))
    assert len(segments) == len(data) and segments.tobytes() == data
    assert all(len(view) for view in segments.views)  # empty buffers are dropped
    for _ in range(10):
        start, end = sorted(rng.randint(-5, len(data) + 5) for _ in range(2))
        part, expected = segments.slice(start, end), data[max(start, 0):max(end, 0)]  # clamped, never wrapped
        assert part.tobytes() == expected and part.crc32() == zlib.crc32(expected)
    reader, out = segments.reader(), bytearray()
    while chunk := reader.read(rng.randint(1, 50)):
        out += chunk
    assert bytes(out) == data
    assert reader.seek(0) == 0 and reader.read() == data  # a retry rereads from the start
    assert reader.seek(0, io.SEEK_END) == len(data) and reader.tell() == len(data)
    for offset, whence in ((-1, io.SEEK_SET), (-len(data) - 1, io.SEEK_END), (0, 7)):
        with pytest.raises(ValueError):
            reader.seek(offset, whence)


def test_slices_share_the_buffers():
    buffer = bytearray(b"abcdef")
    part = Segments([buffer, b"gh"]).slice(2, 7)
    buffer[3] = ord("X")
    assert part.tobytes() == b"cXefg"
