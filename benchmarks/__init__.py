"""Benchmarks and fault scripts, each run from the repository root as ``python benchmarks/<name>.py``."""
