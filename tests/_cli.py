"""A command-line entry point run in the test's own process, as a subprocess result."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
from collections.abc import Callable, Sequence


def run_cli(main: Callable[[list[str]], int], args: Sequence[str], *, prog: str,
            level: int = logging.WARNING) -> subprocess.CompletedProcess:
    """``main(args)`` here: its exit status (argparse's ``SystemExit`` too), stdout, and stderr with what was logged
    at ``level`` or above (a process of its own prints warnings on stderr through logging's last resort)."""
    out, err = io.StringIO(), io.StringIO()
    logged = logging.StreamHandler(err)
    logged.setLevel(level)
    logging.getLogger().addHandler(logged)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        logging.getLogger().removeHandler(logged)
    return subprocess.CompletedProcess([prog, *args], code, out.getvalue(), err.getvalue())
