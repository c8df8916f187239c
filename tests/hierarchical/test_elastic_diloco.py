"""Elastic DiLoCo on torchft, through ``multidc.hierarchical.elastic.ElasticDiLoCo`` (tests/hierarchical/
_elastic_diloco_script.py, one ``torchrun`` per site, gloo on CPU, a real torchft lighthouse in this process).

One site is SIGKILLed (all its processes) mid-training: the others keep committing rounds without it (the round
in flight is discarded, never half-applied), no round is lost or applied twice, the killed site restarts with the
same command, receives the live global parameters, outer and inner optimizer states from a peer site, and rejoins;
the job ends with every site, every rank bitwise identical, equal to a single-process replay of the committed
rounds (each averaged over the sites that took part). Also in streaming DiLoCo (one fragment per round) and with
overlapped syncs (the round ends where the result merges), where the replay follows every site's own parameters,
discarded rounds and the state a restarted site received."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._resources import require_torchft

require_torchft()

from multidc.hierarchical import DiLoCoConfig  # noqa: E402
from multidc.hierarchical.elastic import ElasticDiLoCo  # noqa: E402
from tests._elastic import (  # noqa: E402
    TIMEOUT_S,
    check_odd_site_fails_alone,
    check_rejoined,
    finish_all,
    free_port,
    run_alone,
    run_with_a_kill,
    start_site,
)
from tests.diloco_reference import second_step_error  # noqa: E402
from tests.hierarchical._elastic_diloco_script import OUTER_LR, OUTER_MOMENTUM, SYNC_EVERY  # noqa: E402
from tests.hierarchical.elastic_reference import diloco_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "hierarchical" / "_elastic_diloco_script.py")
ROUNDS, KILL_AT = 8, 3
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


# counted: each rank reports site index + 1 samples per inner step, so the sites weigh 1, 2, 3 in the merges (a
# restarted site takes its source's counts with its parameters); else every site counts the same
@pytest.mark.parametrize("sites,per_site,fragments,overlap,counted", [
    (3, 1, 1, 0, True), (2, 2, 1, 0, True), (3, 1, 2, 0, False), (3, 1, 2, 1, True), (2, 2, 1, 2, False),
], ids=["3x1-weighted", "2x2-ddp-weighted", "3x1-streaming", "3x1-streaming-overlap-weighted", "2x2-ddp-overlap"])
def test_a_killed_site_leaves_the_others_in_rounds_and_rejoins_live(tmp_path, lighthouse, sites, per_site,
                                                                     fragments, overlap, counted):
    victim = sites - 1
    run = run_with_a_kill(tmp_path, lighthouse.address, sites, per_site, victim, "--rounds", str(ROUNDS),
                           "--sleep", "0.3", "--fragments", str(fragments), "--overlap", str(overlap),
                           *(["--count-by-site"] if counted else []), script=SCRIPT, kill_at=KILL_AT)
    first, survivor = check_rejoined(run, sites, ROUNDS)  # every rank's global parameters bitwise identical
    assert survivor["joined_at"] == 0 and survivor["bytes_sent"] > 0
    # a round runs from a sync's merge to the next one's: every fragment in turn (the first round is longer by
    # the first sync's offset and overlap)
    assert {e["t1"] - e["t0"] for e in survivor["syncs"][1:]} == {SYNC_EVERY // fragments}
    assert survivor["syncs"][0]["t1"] == SYNC_EVERY // fragments + overlap
    heals = [{"site": rank["site"], **heal} for (_, r), rank in run["ranks"].items() if r == 0
             for heal in rank["heals"]]
    assert any(h["site"] == victim and h["t0"] > 0 for h in heals), "the restarted site did not receive the live state"
    expected, local = diloco_reference(survivor["syncs"], per_site, survivor["initial"], sync_every=SYNC_EVERY,
                                       outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, fragments=fragments,
                                       overlap=overlap, heals=heals, with_local=True,
                                       rates={site: site + 1.0 for site in range(sites)} if counted else None)
    for name, value in first["params"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5)
    for (_, _), rank in run["ranks"].items():  # streaming: each site's own parameters besides the fragment synced
        for name, value in rank["local"].items():
            torch.testing.assert_close(value, local[rank["site"]][name], rtol=0, atol=1e-5)


def test_topk_rounds_voted_down_after_their_transfer_restore_the_residuals_and_a_heal_zeroes_them(tmp_path,
                                                                                                    lighthouse):
    # 2x1 sites, top-k: both vote sync 2 down after its transfer updated the residuals (the round is discarded
    # everywhere: the residuals must be put back); site0 alone votes sync 4 down, so site1 commits it and site0 heals
    trees = {name: start_site(name, 1, 2, lighthouse.address, tmp_path, "--rounds", "6", "--compression", "topk",
                              *votes, script=SCRIPT)
             for name, votes in [("site0", ["--vote-down", "2", "--vote-down", "4"]), ("site1", ["--vote-down", "2"])]}
    finish_all(trees, tmp_path)
    site0, site1 = (torch.load(tmp_path / f"site{i}_rank0.pt") for i in range(2))
    for name, value in site0["params"].items():  # decoded and summed alike everywhere
        assert torch.equal(value, site1["params"][name]), name
    assert [s["committed"] for s in site1["syncs"][:5]] == [True, True, False, True, True]
    assert [s["committed"] for s in site0["syncs"][:5]] == [True, True, False, True, False]
    for rank in (site0, site1):
        both = rank["voted_down"][0]  # its transfer had changed the residuals before the vote
        assert both["sync"] == 2 and any(not torch.equal(a, b) for a, b in zip(both["kept"], both["after_transfer"]))
        # after sync 2: as the round started; after site0's sync 4 its heal came at once (checked below)
        assert rank["discards_kept"] == [True] * rank["discarded"], rank["discards_kept"]
        assert rank["residual_sum"] > 0  # error feedback ran
    heals = [heal for heal in site0["heals"] if heal["t0"] > 0]
    assert [(h["source"], h["had_residuals"], h["residuals_zero"]) for h in heals] == [(1, True, True)], heals
    assert not [heal for heal in site1["heals"] if heal["t0"] > 0]


@pytest.mark.parametrize("odd,message", [(["--sync-every", "6"], ("sync_every=4", "sync_every=6")),
                                         (["--outer-lr", "0.5"], ("outer_lr=0.7", "outer_lr=0.5"))],
                         ids=["sync-every", "outer-lr"])
def test_a_site_with_other_diloco_settings_fails_alone(tmp_path, lighthouse, odd, message):
    check_odd_site_fails_alone(tmp_path, lighthouse.address, ["--rounds", "10", "--sleep", "0.2"], 1,
                               ["--rounds", "60", *odd], ["the DiLoCo settings differ", *message], script=SCRIPT)


def test_an_overlapped_sync_that_failed_is_left_out_of_checkpoints(tmp_path, lighthouse):
    # the round will be discarded: a resumed job must not merge its half-reduced result
    site = run_alone(tmp_path / "run", lighthouse.address, "--rounds", "3", "--overlap", "1", "--fail-first-flight",
                     script=SCRIPT)
    assert site["flight_check"] == (0, -1)  # in the state while in flight, left out once the transfer failed
    assert site["discarded"] == 1 and site["final_step"] == 3


@pytest.mark.parametrize("sync_every,fragments,overlap", [(4, 3, 1), (5, 2, 2), (6, 4, 1)])
def test_overlap_that_reaches_the_next_sync_is_refused_before_connecting(sync_every, fragments, overlap):
    # the round ends where its sync merges: a merge on another fragment's first sync step would skip that sync
    net = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(4)))
    config = DiLoCoConfig(sync_every=sync_every, fragments=fragments, overlap_steps=overlap)
    with pytest.raises(ValueError, match=f"overlap_steps={overlap} must be below the smallest gap"):
        ElasticDiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), config, site="a")


def _step_twice_elastic(rank: int, world: int, lighthouse: str) -> dict:
    """torchft's DiLoCo loop (``optimizer.step()`` then ``diloco.step()``) on a one-site elastic job: the optimizer's
    hook steps ElasticDiLoCo already."""
    import datetime
    import os

    # the replica group's store, which torchrun's agent serves for a site's job
    store = torch.distributed.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True,  # noqa: F841
                                       timeout=datetime.timedelta(seconds=30))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = ElasticDiLoCo(model, opt, DiLoCoConfig(sync_every=2), site="site0", lighthouse=lighthouse, sites=1)
    try:
        model(torch.ones(2, 4)).sum().backward()
        error = second_step_error(opt, diloco)
        return {"error": error, "inner_steps": diloco.stats.inner_steps, "synced": diloco.synced}
    finally:
        diloco.close()


def test_a_second_step_of_elastic_diloco_for_the_same_inner_step_raises(lighthouse):
    from multidc.hierarchical.tools.ranks import run_ranks

    # torchft's manager finds its store at MASTER_ADDR:MASTER_PORT
    env = {0: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}}
    (result,) = run_ranks(_step_twice_elastic, 1, lighthouse.address, env=env, timeout=120)
    assert result["error"].startswith("ElasticDiLoCo.step() was called, but it was built with an inner optimizer"), \
        result
    assert result["inner_steps"] == 1 and result["synced"] is None  # sync_every=2: counted twice, it would sync
