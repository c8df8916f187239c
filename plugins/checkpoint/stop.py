"""Stopping the work of a checkpoint collective that has failed, before it writes anything more.

Work that runs under ``Comm.alive`` (uploads, downloads, copies into the caller's tensors) may outlive the
collective it belongs to: its rank's group failed, or another rank's work failed and the result is lost anyway.
Such work checks a stop flag (anything with ``is_set()``) before each write and raises the flag's error.
"""

from __future__ import annotations


class Abandoned(RuntimeError):
    """Work of a checkpoint collective that already failed on this rank: stopped before writing anything more."""

    retryable = False  # ObjectStore's retries must end at once, not try again


class PeerLeftError(Abandoned):
    """Work stopped because another rank of the checkpoint group failed: that rank's error is the one to report
    (``secondary``)."""

    secondary = True


def abandoned(what: str) -> Abandoned:
    """The error of ``what``, stopped because a checkpoint collective of this rank failed."""
    return Abandoned(f"{what} stopped: a checkpoint collective of this rank failed meanwhile")


def peer_left(what: str) -> PeerLeftError:
    """The error of ``what``, stopped because another rank of the checkpoint group failed."""
    return PeerLeftError(f"{what} stopped: another rank of the checkpoint group failed (its error is the one "
                         "reported)")


def check_stop(stop, what: str) -> None:
    """Raise if ``stop`` (anything with ``is_set()``, e.g. a ``threading.Event``) is set: the error its ``error(what)``
    gives if it has one, else :func:`abandoned`'s."""
    if stop is not None and stop.is_set():
        describe = getattr(stop, "error", None)
        raise describe(what) if describe is not None else abandoned(what)
