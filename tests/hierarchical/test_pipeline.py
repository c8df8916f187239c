"""Pipeline split arithmetic and config errors (no process group); every schedule against a one-process run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multidc.hierarchical.parallel.pipeline import PipelineConfig, local_stage_indices, split_blocks
from multidc.hierarchical.tools.ranks import run_ranks
from tests._tiny_models import assert_parity, parallel_run, reference_run


@pytest.mark.parametrize(
    "blocks,stages,points,expected",
    [
        (4, 2, None, [range(0, 2), range(2, 4)]),
        (5, 2, None, [range(0, 2), range(2, 5)]),  # the extra block goes to the later stage
        (7, 3, None, [range(0, 2), range(2, 4), range(4, 7)]),
        (4, 4, None, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
        (6, 3, (1, 5), [range(0, 1), range(1, 5), range(5, 6)]),
        (3, 1, None, [range(0, 3)]),
    ],
)
def test_split_blocks_balances_by_count_or_follows_split_points(blocks, stages, points, expected):
    assert split_blocks(blocks, stages, points) == expected


@pytest.mark.parametrize(
    "blocks,stages,points,words",
    [
        (3, 4, None, "declares 3 pipeline blocks but the layout needs 4 stages"),
        (6, 3, (3,), "must be 2 strictly increasing"),
        (6, 3, (3, 3), "strictly increasing"),
        (6, 3, (0, 3), "in 1..5"),
        (6, 3, (2, 6), "in 1..5"),
        (6, 2, (2.5,), "strictly increasing"),
    ],
)
def test_split_blocks_rejects_impossible_splits(blocks, stages, points, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        split_blocks(blocks, stages, points)


@settings(max_examples=200, deadline=None)
@given(stages=st.integers(1, 12), extra=st.integers(0, 30))
def test_balanced_split_covers_every_block_once_with_sizes_within_one(stages, extra):
    blocks = stages + extra
    ranges = split_blocks(blocks, stages)
    assert [i for r in ranges for i in r] == list(range(blocks))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)


@settings(max_examples=100, deadline=None)
@given(pp=st.integers(1, 8), v=st.integers(1, 4))
def test_looped_placement_gives_each_stage_one_rank_and_the_last_stage_to_the_last_rank(pp, v):
    owners = {s: r for r in range(pp) for s in local_stage_indices(r, pp, v)}
    assert sorted(owners) == list(range(pp * v))
    assert owners[pp * v - 1] == pp - 1


@pytest.mark.parametrize(
    "kwargs,pp,words",
    [
        (dict(schedule="zero_bubble"), 2, "not supported"),
        (dict(schedule="1f1b", microbatches=0), 2, "positive int"),
        (dict(schedule="1f1b", microbatches=1), 2, "microbatches >= pipeline_parallel_size=2"),
        (dict(schedule="interleaved_1f1b", microbatches=3), 2, "multiple of pipeline_parallel_size=2"),
        (dict(schedule="gpipe", stages_per_rank=2), 2, "'interleaved_1f1b' needs stages_per_rank >= 2"),
        (dict(schedule="interleaved_1f1b", stages_per_rank=1), 2, "needs stages_per_rank >= 2"),
    ],
)
def test_pipeline_config_rejects_schedules_that_cannot_run(kwargs, pp, words):
    with pytest.raises(ValueError, match=words):
        PipelineConfig(**kwargs).resolved_microbatches(pp)


def test_pipeline_config_reads_env_and_defaults(monkeypatch):
    monkeypatch.setenv("MULTIDC_PP_SCHEDULE", "GPipe")
    monkeypatch.setenv("MULTIDC_PP_MICROBATCHES", "6")
    config = PipelineConfig()
    assert (config.schedule, config.microbatches, config.stages_per_rank) == ("gpipe", 6, 1)
    monkeypatch.delenv("MULTIDC_PP_MICROBATCHES")
    assert PipelineConfig().resolved_microbatches(4) == 8
    monkeypatch.setenv("MULTIDC_PP_SCHEDULE", "nope")
    with pytest.raises(ValueError, match="MULTIDC_PP_SCHEDULE"):
        PipelineConfig()


SCHEDULE_CASES = {
    "gpipe": dict(schedule="gpipe"),
    "1f1b": dict(schedule="1f1b", microbatches=4, split_points=(1,)),  # stage 0 = embedding only
    "interleaved_1f1b": dict(schedule="interleaved_1f1b", microbatches=2),  # 4 stages on 2 ranks
}


def _every_schedule(rank, world, cases):
    return [parallel_run(rank, world, case) for case in cases]


def test_every_schedule_matches_single_process_training():
    """pp=2 on 2 gloo ranks, 3 SGD steps with global-norm clipping and an LR schedule, fp32.

    Tolerance: rtol 1e-4, atol 2e-5 on losses, global gradient norms and every weight.
    """
    cases = [dict(layout=dict(pipeline_parallel_size=2), pipeline=p, global_batch=8) for p in SCHEDULE_CASES.values()]
    per_rank = run_ranks(_every_schedule, 2, cases, timeout=240)
    for i, (name, case) in enumerate(zip(SCHEDULE_CASES, cases)):
        reference = reference_run(case)
        assert reference["norms"][0] > case.get("clip", 0.5), "the case must actually clip"
        try:
            assert_parity([ranks[i] for ranks in per_rank], reference)
        except AssertionError as exc:
            raise AssertionError(f"schedule {name}: {exc}") from exc
