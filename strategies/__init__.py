"""Parallel layouts and Lightning strategies (see the project issues)."""

__all__: list[str] = []
