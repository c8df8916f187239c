"""CRC-32 of concatenated byte ranges from the CRCs of the ranges (zlib's ``crc32_combine``, which Python's
``zlib`` does not expose).

A large item is read in slices, by one rank or striped over several, each slice checksummed as its bytes arrive;
:func:`crc32_combine` turns the slices' CRCs into the item's, so no one ever holds the whole item to verify it.
``combine([(crc_a, len_a), (crc_b, len_b)]) == zlib.crc32(a + b)``.
"""

from __future__ import annotations

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial zlib uses


def _multmodp(a: int, b: int) -> int:
    """``a * b mod p`` in GF(2)[x] with zlib's reflected bit order (x^0 is the top bit)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()  # x^(2^n) mod p


def _x8nmodp(length: int) -> int:
    """``x^(8 * length) mod p``: shifting a CRC over ``length`` zero bytes, in O(log length)."""
    p, k = 1 << 31, 3  # x^0; k = 3: bytes are 2^3 bits
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``length2 = len(b)``."""
    if length2 < 0:
        raise ValueError(f"length2={length2} must be >= 0")
    return _multmodp(_x8nmodp(length2), crc1) ^ crc2


def combine(parts) -> int:
    """The CRC-32 of consecutive ranges given as ``[(crc, length), ...]`` in byte order."""
    crc = 0
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc
