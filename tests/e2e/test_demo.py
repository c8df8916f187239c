"""``examples/demo.py`` (``make demo``): its summary table reads what the three runs write, in their formats.

The demo itself runs for minutes as root (a lab WAN), so the suite does not run it; ``make demo`` does. Here: the
summary from a log, a ``run.json`` and a bench JSON shaped as those runs write them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_names_each_run_with_its_sites_wan_figures_loss_and_utilization(tmp_path):
    (tmp_path / "lightning.log").write_text(
        "[multidc lab] 2 sites x 2 ranks on lab WAN, 100mbit per direction between 2 network namespaces\n"
        "step   50  loss 0.0742  WAN   0.13 MiB/step      5.5 MB/s  waited   27.3 ms\n"
        "step   60  loss 0.1359  WAN   0.13 MiB/step      5.7 MB/s  waited   25.2 ms\n"
        "done: 4 ranks in 2 sites [2, 2], WAN settings WanConfig(compression='none')\n")
    (tmp_path / "gpt_3d").mkdir()
    (tmp_path / "gpt_3d" / "run.json").write_text(json.dumps({
        "losses": [4.417, 3.963], "val_loss": 3.871, "wan": {"bytes_sent": 1_850_000, "calls": 90},
        "layout": "8 ranks = site 2 x pp 2 x dp_replicate 1 x dp_shard 1 x tp 2"}))
    speed = {"hierarchical_ddp": {"steps_per_s": 0.08, "wan_bytes_per_step": 13_206_390.0},
             "streaming_diloco": {"steps_per_s": 2.94, "wan_bytes_per_step": 107_000.0},
             "sites_alone": {"steps_per_s": 3.09, "wan_bytes_per_step": 100.0}}
    (tmp_path / "diloco.json").write_text(json.dumps({"speed": {"10mbit": speed}}))
    table = _demo().summary(tmp_path)
    assert table[0].split() == ["run", "sites", "x", "ranks", "WAN", "loss", "note"] and set(table[1]) == {"-"}
    ddp, gpt, bench_ddp, bench_streaming = table[2:]
    assert "hierarchical_ddp (Lightning)" in ddp and "2 x 2" in ddp and "0.13 MiB/step at 5.7 MB/s" in ddp
    assert "0.136 at step 60" in ddp
    assert "2 x 4" in gpt and "1.85 MB in 90 reductions" in gpt and "4.417 -> 3.963 (val 3.871)" in gpt
    assert "13206 KB/inner step" in bench_ddp and "10mbit: 3% of the sites-alone step rate" in bench_ddp
    assert "107 KB/inner step" in bench_streaming and "10mbit: 95% of the sites-alone" in bench_streaming


def test_the_parts_run_the_examples_the_docs_name(tmp_path):
    argv = [" ".join(part["argv"]) for part in _demo().parts(tmp_path)]
    assert "examples/lightning_hierarchical_ddp.py" in argv[0] and "lab run" in argv[0]
    assert "examples/gpt_3d.py" in argv[1] and "bench diloco --quick" in argv[2]
    assert all((ROOT / a.split()[1]).exists() for a in argv[1:2])
