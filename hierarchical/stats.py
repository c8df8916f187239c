"""``WanStats``: what this rank sent over the WAN, for logs and benchmarks."""

from __future__ import annotations

import threading
import time
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


class WanStepMeter:
    """Per-step WAN figures for training logs, read off a ``WanStats`` and the end of each backward.

    ``take()`` returns what happened since the previous ``take()``; call it once per optimizer step:

    - ``"wan/bytes_sent"``: payload bytes this rank sent to other sites (``WanStats.bytes_sent``).
    - ``"wan/comm_s"``: wall seconds spent in hierarchical all-reduces (``WanStats.seconds``).
    - ``"wan/MBps"``: ``bytes_sent / comm_s`` in 1e6 bytes per second (0 when nothing was sent).
    - ``"wan/wait_s"``: seconds backward waited on gradient communication: from the moment the last gradient of
      ``parameters`` was accumulated to ``backward_done()``. With the DDP hook this is the communication that
      did not overlap backward compute (plus DDP's copy of averaged buckets back into ``.grad``).

    Gradient accumulation steps under ``no_sync`` send nothing, so they add 0 bytes and ~0 wait.
    """

    def __init__(self, stats: WanStats, parameters) -> None:
        self._stats = stats
        self._last = stats.snapshot()
        self._grad_ready: float | None = None
        self._wait_s = 0.0
        self._handles: list = []
        self.watch(parameters)

    def watch(self, parameters) -> None:
        """Also time the gradients of ``parameters`` (e.g. a second model sharing the same topology)."""
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in parameters if p.requires_grad]

    def _on_grad(self, _param) -> None:
        self._grad_ready = time.perf_counter()

    def backward_done(self) -> None:
        """Call right after ``loss.backward()`` returns (DDP has then waited for every bucket)."""
        if self._grad_ready is not None:
            self._wait_s += max(0.0, time.perf_counter() - self._grad_ready)
            self._grad_ready = None

    def take(self) -> dict[str, float]:
        """The figures since the previous call (see the class docstring), then start counting afresh."""
        now = self._stats.snapshot()
        sent = now["bytes_sent"] - self._last["bytes_sent"]
        seconds = now["seconds"] - self._last["seconds"]
        wait, self._wait_s, self._last = self._wait_s, 0.0, now
        return {
            "wan/bytes_sent": float(sent),
            "wan/comm_s": seconds,
            "wan/MBps": sent / seconds / 1e6 if sent and seconds > 0 else 0.0,
            "wan/wait_s": wait,
        }

    def close(self) -> None:
        """Remove the gradient hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
