"""Accelerate integration and object-store checkpoint I/O (see the project issues)."""

__all__: list[str] = []
