"""``WanStats``: what this rank sent over the WAN, for logs and benchmarks."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class WanStats:
    """Counters of this rank's inter-site traffic since creation or the last ``reset()``.

    Bytes are payload bytes this rank hands to the inter-site collectives, counted as a bandwidth-optimal ring
    moves them (an all-reduce over ``k`` sites sends ``2(k-1)/k`` of its input, an all-gather ``k-1`` times
    it), after compression. Interface counters also see TCP/IP headers, a few percent more.
    """

    bytes_sent: int = 0
    """Payload bytes this rank sent to other sites."""
    bytes_received: int = 0
    """Payload bytes this rank received from other sites."""
    calls: int = 0
    """Hierarchical all-reduces completed."""
    seconds: float = 0.0
    """Wall seconds from start to finish of those all-reduces, summed."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, sent: int = 0, received: int = 0, calls: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_received += int(received)
            self.calls += calls
            self.seconds += seconds

    def snapshot(self) -> dict:
        """A plain dict copy, safe to read while collectives run."""
        with self._lock:
            return self._values()

    def reset(self) -> dict:
        """Return the counters and zero them."""
        with self._lock:
            values = self._values()
            self.bytes_sent = self.bytes_received = self.calls = 0
            self.seconds = 0.0
        return values

    def _values(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
