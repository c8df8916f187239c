"""Resident memory of this process: ``rss()`` now, ``PeakRSS`` the peak above the level at entry. Used by
``bench_checkpoint.py`` and the checkpoint memory test."""

from __future__ import annotations

import os
import threading


class PeakRSS:
    """Peak resident memory of this process above its level at entry, in bytes (``extra``).

    Linux keeps the peak itself (``VmHWM``): it is reset at entry (``/proc/self/clear_refs``) and read at exit, so
    no peak is missed and nothing runs meanwhile to slow the measured work down. Where the reset is refused, a
    thread samples ``rss()`` every 2 ms instead (``sampled``)."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.sampled = not _reset_peak()
        if self.sampled:
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        if self.sampled:
            self._done.set()
            self._thread.join()
            self.peak = max(self.peak, rss())
        else:
            self.peak = _status_bytes("VmHWM")
        self.extra = self.peak - self.base


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Set this process's peak resident memory (``VmHWM``) to its current one; whether the kernel allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") is not None
    except OSError:
        return False


def _status_bytes(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # kB
    return None
