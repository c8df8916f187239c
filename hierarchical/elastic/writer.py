"""Which site of an elastic job writes the job's checkpoints: the rule, stated once (the docs link here).

One site writes each checkpoint of a committed step (the sites that commit a step hold identical states), also in a
degraded quorum, and also when the first site of a step's quorum discarded a step that others committed:

* after a commit, the site that committed the step as the first site of the step's quorum leads;
* after a quorum, the first site (in the quorum's order) of those at the job's latest step leads, past step 0 and
  unless it receives the live state in that quorum; this also names a writer for sites resumed from a checkpoint;
* a site that committed a step but was not its quorum's first keeps the saves of that step (``save_once``) until
  the next quorum. There, if it leads as one site and that quorum shows the step's first site (the same process:
  torchft's replica id ``name:uuid``) no longer at the job's step, that site discarded the step and wrote nothing:
  this one writes them. Otherwise it drops them: the first site committed and saved the step, or it left the job,
  and then whether it saved is unknown.

``ElasticSite`` feeds a ``CheckpointWriter`` its events (quorum, heal, the site's vote, commit, close); every rank of a
site feeds the same events and the site's ranks vote on ``leads`` and ``write`` together, so they decide alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

_log = logging.getLogger("multidc.hierarchical.elastic")


class CheckpointWriter:
    """This site's part in the rule above. ``leads``: whether this site saves the job's checkpoints now."""

    def __init__(self) -> None:  # noqa: D107
        self.leads = False
        self.members: tuple[str, ...] = ()
        """The replica ids (``name:uuid``) of the last quorum."""
        self._undecided: tuple[str, int] | None = None  # (the first site of a step this site committed, the step)
        self._deferred: list[Callable[[], object]] = []

    def quorum(self, quorum) -> None:
        """A torchft quorum answer (every rank): whether this site leads in it, and its members."""
        self.leads = leads_after_quorum(quorum)
        self.members = tuple(quorum.replica_ids)

    def healing(self) -> None:
        """This site receives the live state in this quorum: what it would save is the live sites', whose first
        site saves it."""
        self.leads = False

    def proposes_to_write(self, step: int) -> bool:
        """This rank's vote after a quorum at the job's ``step``: whether the saves it keeps are its to write (the
        step's first site is in the quorum and the job is still at that step)."""
        undecided = self._undecided
        return undecided is not None and undecided[0] in self.members and undecided[1] == step

    def settle(self, write: bool) -> list[Callable[[], object]]:
        """After the site's vote: the kept saves to run now (``write``: the site leads and every rank proposed to
        write), else none; either way none is kept any more."""
        deferred, self._deferred, self._undecided = self._deferred, [], None
        return deferred if write else []

    def commit(self, committed: bool, first_site: bool, step: int) -> None:
        """The site's vote on a step, the job at ``step`` after it: committed or not, as its quorum's first site or
        not. Saves kept from before the step's quorum were decided there."""
        self.leads = committed and first_site
        self._deferred = []
        first = min(self.members) if committed and not first_site and self.members else None
        self._undecided = (first, step) if first is not None else None

    def save_once(self, save: Callable[[], object]) -> None:
        """Run ``save`` now if this site leads; keep it if this site committed the step without being its quorum's
        first (decided at the next quorum: ``proposes_to_write`` / ``settle``); else nothing (another site writes)."""
        if self.leads:
            save()
        elif self._undecided is not None:
            self._deferred.append(save)

    def drop(self, site: str, step: int) -> None:
        """At the site's close: the kept saves of the job's last step, which no quorum decides, are dropped (logged)."""
        if self._deferred:
            _log.info("site %r leaves %d checkpoint save(s) of step %d to the first site of that step's quorum: no "
                      "later quorum showed whether that site discarded the step", site, len(self._deferred), step)
            self._deferred = []


def leads_after_quorum(quorum) -> bool:
    """Whether a site leads after a torchft quorum answer: the first (``max_replica_rank`` 0) of the sites at the
    job's latest step, past step 0, and not healing in this quorum (torchft also makes sites at step 0 other than its
    primary heal)."""
    return quorum.max_replica_rank == 0 and quorum.max_step > 0 and not quorum.heal


def run_all(calls: list[Callable[[], object]]) -> None:
    """Run every call, then raise the first error (a failed save does not skip the ones after it)."""
    first = None
    for call in calls:
        try:
            call()
        except Exception as exc:  # raised below, after the others ran
            first = first or exc
    if first is not None:
        raise first
