"""Resident memory of this process: ``rss()`` now, ``PeakRSS`` the peak above the level at entry (sampled every
2 ms). Used by ``bench_checkpoint.py`` and the checkpoint memory test."""

from __future__ import annotations

import os
import threading


class PeakRSS:
    """Peak resident memory of this process above its level at entry, sampled every 2 ms, in bytes."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.base


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
