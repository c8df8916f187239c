"""Fault-injection helpers: a small resumable training job, a per-rank launcher for the lab WAN, and the
checkpoint-kill worker. Used by ``tests/test_wan_faults.py``, ``tests/faults/test_*.py`` and
``benchmarks/fault_*.py``."""
