"""Who writes an elastic job's checkpoints (``multidc.hierarchical.elastic.writer``), event by event, without torchft:
one site per committed step, also when the first site of a step's quorum discarded it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from multidc.hierarchical.elastic.writer import CheckpointWriter, leads_after_quorum


def quorum(members: tuple[str, ...], *, step: int, first_at_step: bool, heal: bool = False) -> SimpleNamespace:
    """A torchft quorum answer as this site sees it: ``first_at_step``: it is the first of the sites at ``step``."""
    return SimpleNamespace(replica_ids=list(members), max_step=step, max_replica_rank=0 if first_at_step else 1,
                           heal=heal)


@pytest.mark.parametrize("max_replica_rank,max_step,heal,leads", [
    (0, 5, False, True),  # the first of the sites at the job's step
    (1, 5, False, False),  # another site at the step is first
    (None, 5, False, False),  # behind: it heals
    (0, 5, True, False),  # receives the live state in this quorum
    (0, 0, False, False),  # step 0: nothing to save yet
])
def test_after_a_quorum_the_first_site_at_the_jobs_step_leads(max_replica_rank, max_step, heal, leads):
    answer = SimpleNamespace(max_replica_rank=max_replica_rank, max_step=max_step, heal=heal)
    assert leads_after_quorum(answer) is leads


A, B = "a:1", "b:2"  # torchft replica ids, a sorts first: a is every quorum's first site


# Each case: site b's events, then when b writes the save of the step: "now", "next quorum" (kept, then written),
# or "never" (another site writes it, or nobody knows whether it did).
@pytest.mark.parametrize("events,written", [
    # the step's first site committed it: it saves at once
    ([("quorum", (A, B), 5, True), ("commit", True, True, 6), ("save",)], "now"),
    # a site that committed as the quorum's second: kept; the next quorum shows a (same id) behind, at step 6: a
    # discarded it, so b writes
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("quorum", (A, B), 6, True),
      ("vote", True)], "next quorum"),
    # ... a committed it too (it is first at step 6 again, so b does not lead): a saved it
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("quorum", (A, B), 6, False),
      ("vote", True)], "never"),
    # ... a left the job (or came back as another process): whether it saved is unknown
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("quorum", (B,), 6, True),
      ("vote", True)], "never"),
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("quorum", ("a:9", B), 6, True),
      ("vote", True)], "never"),
    # ... b itself healed in between (the job is past step 6): not its step any more
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("quorum", (A, B), 7, True),
      ("vote", True)], "never"),
    # ... a rank of the site did not propose it (it saw another quorum): nobody writes alone
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("quorum", (A, B), 6, True),
      ("vote", False)], "never"),
    # this site discarded the step: it saves nothing
    ([("quorum", (A, B), 5, True), ("commit", False, True, 5), ("save",)], "never"),
    ([("quorum", (A, B), 5, False), ("commit", False, False, 5), ("save",)], "never"),
    # healed in the quorum: the live sites' first site saves the state it received
    ([("quorum", (A, B), 5, True), ("heal",), ("save",)], "never"),
    # the job's last step, kept: no quorum decides it; the site drops it when it closes
    ([("quorum", (A, B), 5, False), ("commit", True, False, 6), ("save",), ("close",)], "never"),
])
def test_each_committed_step_is_saved_by_one_site(events, written):
    writer, ran, when = CheckpointWriter(), [], None
    for event, *args in events:
        if event == "quorum":  # this site is at the quorum's step
            members, step, first = args
            writer.quorum(quorum(members, step=step, first_at_step=first))
            when = "next quorum" if when == "kept" else when
        elif event == "heal":
            writer.healing()
        elif event == "commit":
            writer.commit(*args)
        elif event == "save":
            writer.save_once(lambda: ran.append(True))
            when = "now" if ran else "kept"
        elif event == "vote":  # the site's vote after the quorum: the other ranks' proposals are ``others``
            (others,) = args
            write = writer.leads and writer.proposes_to_write(step) and others
            for save in writer.settle(write=write):
                save()
        elif event == "close":
            writer.drop("b", 6)
    assert (when if ran else "never") == written
    assert len(ran) <= 1
