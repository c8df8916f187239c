"""Elastic sites over the lab WAN (network namespaces, root only): one site's link is cut mid-training; the other
sites keep committing without it, and once the link is back the cut site (still running, not restarted) rejoins
with the live state. Each site is
its own ``torchrun`` inside its namespace; the torchft lighthouse runs on the WAN's bridge (``multidc lighthouse``),
so the cut site loses the lighthouse as well as its peers."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from multidc.hierarchical.tools.lab import Lab, lab_available
from multidc.hierarchical.tools.processes import ProcessTree
from tests._resources import require_torchft

require_torchft()

from tests._elastic import KILL_AT, STEPS, free_port, progress, site_logs, start_site, wait_for_steps  # noqa: E402
from tests.hierarchical.elastic_reference import reference  # noqa: E402

needs_lab = pytest.mark.skipif(lab_available() is not None, reason=f"no lab WAN here: {lab_available()}")
TIMEOUT_S, CUT_S = 300, 8.0
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _lighthouse(lab: Lab, out) -> tuple[ProcessTree, str]:
    address = f"{lab.hub_ip}:{free_port()}"
    argv = lab.wrap_hub([sys.executable, "-m", "multidc.hierarchical.tools.cli", "lighthouse", "--bind", address,
                         "--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "1000"])
    log_path = out / "lighthouse.log"
    tree = ProcessTree(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "listening on" not in log_path.read_text():
        assert tree.process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return tree, address


@needs_lab
def test_a_site_whose_link_is_cut_leaves_the_others_training_and_rejoins(tmp_path):
    names = ["site0", "site1", "site2"]
    extra = ("--timeout-s", "5")
    with Lab(3, "100mbit") as lab:
        lighthouse, address = _lighthouse(lab, tmp_path)
        trees = {name: start_site(name, 1, 3, address, tmp_path, *extra, lab=lab) for name in names}
        try:
            deadline = time.monotonic() + TIMEOUT_S
            wait_for_steps(tmp_path, trees, KILL_AT, deadline, ["site2"])
            lab.set_link(2, up=False)
            cut_at = progress(tmp_path, "site2")
            before = {n: progress(tmp_path, n) for n in names[:2]}
            time.sleep(CUT_S)  # then until the others made a few steps without site2 (a slow 2-core machine)
            while min(progress(tmp_path, n) - before[n] for n in before) < 5 and time.monotonic() < deadline:
                time.sleep(0.1)
            went_on = {n: progress(tmp_path, n) - before[n] for n in before}
            lab.set_link(2, up=True)
            for name, tree in trees.items():  # the cut site was not restarted: it rejoins on its own
                code, _ = tree.wait(max(1.0, deadline - time.monotonic()))
                assert code == 0, f"{name}:\n{site_logs(tmp_path, name)}"
        finally:
            for tree in trees.values():
                tree.kill()
            lighthouse.kill()
    print(f"cut at step {cut_at}; the others went on by {went_on} steps while it was cut off")
    ranks = {name: torch.load(tmp_path / f"{name}_rank0.pt") for name in names}
    assert all(steps >= 5 for steps in went_on.values()), went_on  # the survivors never stopped for the cut
    first = ranks["site0"]
    for name, rank in ranks.items():  # the job ended with every site, bitwise identical
        assert rank["final_step"] == first["final_step"] >= STEPS and rank["num_sites"] == 3, name
        for key, value in rank["params"].items():
            assert torch.equal(value, first["params"][key]), (name, key)
    for name in names[:2]:  # every step committed exactly once, none lost
        assert [e["step"] for e in ranks[name]["log"]] == list(range(0, first["final_step"])), name
    assert any(2 not in e["sites"] and e["step"] > cut_at for e in first["log"]), "no step ran without site2"
    cut_off = [e["step"] for e in ranks["site2"]["log"]]  # it skipped the steps made without it: live state received
    assert cut_off[0] == 0 and any(b - a > 1 for a, b in zip(cut_off, cut_off[1:])), cut_off
    expected = reference(first["log"], 1, first["initial"])
    for key, value in first["params"].items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6)
