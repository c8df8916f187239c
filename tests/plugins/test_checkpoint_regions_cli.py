"""``multidc ckpt ls|verify|rm`` on a region-local checkpoint: one SeaweedFS server per region (site 0 the anonymous
one, site 1 the one with credentials), saved by 2 gloo ranks (one per site). Region storage options come from
``MULTIDC_CKPT_STORAGE_OPTIONS`` only, as a user sets them; the commands run through ``cli.main`` (and once through
the installed ``multidc`` console script), each asserting its exit status and what it printed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from multidc.plugins import ObjectStore
from multidc.plugins.checkpoint import cli
from tests._batched import run_cases
from tests._cli import run_cli

pytestmark = pytest.mark.timeout(300)
STEPS = (1, 2)


def _save(rank, world, template, options):
    from multidc.hierarchical import Topology
    from multidc.plugins import Checkpointer

    topology = Topology.build(site=rank)  # one rank per site
    with Checkpointer(template, storage_options=options, topology=topology, stripe_min_mb=0) as ckpt:
        for step in STEPS:
            ckpt.save({"w": torch.arange(50_000, dtype=torch.float32) + step, "local": torch.full((64,), rank + 1.0),
                       "meta": {"step": step}}, step=step)
    return True


CASES = ("ls", "forms", "verify", "credentials", "rm")


@pytest.fixture(scope="module")
def saved(s3_server, s3_auth_server):
    """For each test of ``CASES`` its own checkpoint (steps 1 and 2) in its own pair of buckets, all saved by one
    set of 2 spawned ranks: ``{case: (template, {region: URL}, {region: storage options})}``."""
    options = {"0": s3_server.storage_options(), "1": s3_auth_server.storage_options()}
    out = {}
    for case in CASES:
        tag = uuid.uuid4().hex[:10]
        s3_server.make_bucket(f"rc0-{tag}")
        s3_auth_server.make_bucket(f"rc1-{tag}")
        template = f"s3://rc{{site}}-{tag}/run"
        out[case] = template, {r: template.replace("{site}", r) for r in options}, options
    run_cases({case: (_save, (template, options)) for case, (template, _, _) in out.items()}, 2, timeout=240)
    return out


def _use(saved, case: str, monkeypatch) -> tuple:
    """Case ``case``'s checkpoint of ``saved``, its storage options in ``MULTIDC_CKPT_STORAGE_OPTIONS``."""
    template, urls, options = saved[case]
    monkeypatch.setenv("MULTIDC_CKPT_STORAGE_OPTIONS", json.dumps(options))
    return template, urls, options


def _main(*args: str) -> subprocess.CompletedProcess:
    return run_cli(cli.main, args, prog="multidc ckpt", level=logging.NOTSET)


def _keys(url: str, options: dict) -> list[str]:
    store = ObjectStore(url, storage_options=options)
    return sorted(f"{d}/{f}" for d in store.list_dirs() for f in store.list_files(d))


def test_ls_shows_each_checkpoint_once_per_region_with_that_regions_part(saved, monkeypatch):
    template, urls, _ = _use(saved, "ls", monkeypatch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONPATH")}
    script = Path(sys.executable).with_name("multidc")  # the installed console script, a process of its own
    listed = subprocess.run([str(script), "ckpt", "ls", template, "--sites", "2", "--json"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["step"] for r in rows] == list(STEPS)
    for row in rows:
        assert sorted(row["regions"]) == ["0", "1"] and row["world_size"] == 2
        for region, part in row["regions"].items():
            assert part["shards"] == 1 and part["bytes"] >= 200_000, part
            assert urls[region].removeprefix("s3://") in part["url"], part
    table = _main("ls", "--region", f"0={urls['0']}", "--region", f"1={urls['1']}")
    assert table.returncode == 0, table.stderr
    lines = [line.split() for line in table.stdout.splitlines()[1:]]
    assert [(int(line[0]), line[1]) for line in lines] == [(s, r) for s in STEPS for r in ("0", "1")]


def test_the_url_forms_are_checked_with_the_fix_named(saved, monkeypatch):
    template, urls, options = _use(saved, "forms", monkeypatch)
    no_sites = _main("ls", template)
    assert no_sites.returncode == 2 and "--sites" in no_sites.stderr
    per_site = _main("ls", urls["1"])  # one URL, options per site
    assert per_site.returncode == 2 and "MULTIDC_CKPT_STORAGE_OPTIONS gives options per site" in per_site.stderr
    monkeypatch.setenv("MULTIDC_CKPT_STORAGE_OPTIONS", json.dumps(options["1"]))
    one_region = _main("ls", urls["1"])  # a plain URL that is one region's part
    assert one_region.returncode == 2 and "region-local" in one_region.stderr and "--region" in one_region.stderr
    both = _main("ls", template, "--region", f"0={urls['0']}")
    assert both.returncode == 2 and "not both" in both.stderr


def test_verify_checks_each_region_against_its_part_and_names_the_corrupt_one(saved, monkeypatch):
    template, urls, options = _use(saved, "verify", monkeypatch)
    sound = _main("verify", template, "--sites", "2", "--all", "--slice-mb", "0.05")
    assert sound.returncode == 0, sound.stdout + sound.stderr
    assert [line.split()[:3] for line in sound.stdout.splitlines()] == [["OK", "region", f"'{r}'"]
                                                                         for _ in STEPS for r in ("0", "1")]
    store = ObjectStore(urls["1"], storage_options=options["1"])
    key = "step_0000000002/data/rank00001.distcp"
    data = bytearray(store.get(key))
    data[1000] ^= 0x01  # inside "w"
    store.put(key, bytes(data))
    corrupt = _main("verify", template, "--sites", "2")  # latest: step 2
    assert corrupt.returncode == 1, corrupt.stdout + corrupt.stderr
    lines = corrupt.stdout.splitlines()
    assert lines[0].startswith("OK      region '0'"), lines
    assert lines[1].startswith("CORRUPT region '1'") and "rank00001.distcp" in lines[2] and "holding w" in lines[2]
    assert _main("verify", template, "--sites", "2", "--step", "1").returncode == 0


def test_wrong_credentials_for_one_region_exit_3_naming_the_region_and_the_variable(saved, monkeypatch,
                                                                                     s3_auth_server):
    template, _, options = _use(saved, "credentials", monkeypatch)
    secret = "mdc-cli-regions-wrong-7c1e"
    monkeypatch.setenv("MULTIDC_CKPT_STORAGE_OPTIONS", json.dumps(
        {**options, "1": s3_auth_server.storage_options(key=options["1"]["key"], secret=secret)}))
    refused = _main("verify", template, "--sites", "2")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "region '1'" in refused.stderr and "MULTIDC_CKPT_STORAGE_OPTIONS" in refused.stderr
    assert secret not in refused.stderr + refused.stdout


def test_rm_deletes_every_regions_part_and_deletes_nothing_while_a_region_is_unavailable(saved, monkeypatch):
    template, urls, options = _use(saved, "rm", monkeypatch)
    gone = _main("rm", "--region", f"0={urls['0']}", "--region", "1=s3://rc-no-such-bucket-9d1/run", "--step", "2")
    assert gone.returncode == 3 and "region '1'" in gone.stderr, gone.stdout + gone.stderr
    assert [key.split("/")[0] for key in _keys(urls["0"], options["0"])].count("step_0000000002") == 2  # untouched

    assert _main("rm", template, "--sites", "2", "--step", "2").returncode == 0
    for region in ("0", "1"):
        assert _keys(urls[region], options[region]) == [
            "step_0000000001/COMMIT.json", f"step_0000000001/data/rank0000{region}.distcp"]
    assert _main("rm", template, "--sites", "2", "--step", "2").returncode == 2
    assert _main("rm", template, "--sites", "2", "--all").returncode == 0
    assert _keys(urls["0"], options["0"]) == _keys(urls["1"], options["1"]) == []
    assert "no checkpoint committed" in _main("ls", template, "--sites", "2").stdout
