"""``make demo``: three short runs that show what multidc does, each in one line, then one summary table.

1. ``examples/lightning_hierarchical_ddp.py``: an ordinary Lightning script (``strategy="hierarchical_ddp"``) as 2
   sites x 2 ranks over a 100 mbit lab WAN (``multidc lab run``: network namespaces as root, else loopback);
2. ``examples/gpt_3d.py``: a small GPT under ``parallel_3d``, 2 sites x 2 pipeline stages x 2 tensor shards;
3. ``multidc bench diloco --quick`` at 10 mbit: hierarchical DDP next to streaming DiLoCo (compute utilization).

Each run's whole output (the frameworks' warnings included) goes to ``OUT/<part>.log``; the screen shows the lines
that say what it did. Usage: ``python examples/demo.py [--out demo-logs]``; exits non-zero (printing the end of
the log) when a part fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
MULTIDC = str(Path(sys.executable).with_name("multidc"))
ROOT = Path(__file__).resolve().parents[1]


def parts(out: Path) -> list[dict]:
    """What runs: a title, the command, and which of its lines the screen shows."""
    return [
        {"name": "lightning", "title": "hierarchical_ddp: a Lightning script as is, 2 sites x 2 ranks, 100 mbit WAN",
         "argv": [MULTIDC, "lab", "run", "--sites", "2", "--ranks-per-site", "2", "--wan-rate", "100mbit", "--",
                  PY, "examples/lightning_hierarchical_ddp.py", "--max-steps", "60", "--out", str(out / "lightning")],
         "show": r"^\[multidc lab\]|^step |^done:"},
        {"name": "gpt_3d", "title": "parallel_3d: a GPT as 2 sites x 2 pipeline stages x 2 tensor shards (8 ranks)",
         "argv": [PY, "examples/gpt_3d.py", "--max-steps", "30", "--out", str(out / "gpt_3d")],
         "show": r"^layout:|^loss:|^WAN "},
        {"name": "diloco", "title": "10 mbit WAN: hierarchical DDP vs streaming DiLoCo, 2 sites x 2 ranks (speed)",
         "argv": [MULTIDC, "bench", "diloco", "--quick", "--rates", "10mbit", "--json", str(out / "diloco.json")],
         "show": r"^\s+rate method|^\s+\d+mbit |^target "},
    ]


def run_part(part: dict, out: Path, index: int, total: int) -> float:
    print(f"\n== {index}/{total} {part['title']}", flush=True)
    log = out / f"{part['name']}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(part["argv"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if re.search(part["show"], line):
                print("   " + line.rstrip(), flush=True)
        code = proc.wait()
    seconds = time.monotonic() - start
    if code != 0:
        tail = log.read_text().splitlines()[-40:]
        print("\n".join(["   " + line for line in tail]), file=sys.stderr)
        raise SystemExit(f"demo part {index} ({part['name']}) failed with exit status {code}; its log: {log}")
    print(f"   ok in {seconds:.0f} s; full output: {log}", flush=True)
    return seconds


def summary(out: Path) -> list[str]:
    """The table that ends the demo, from what the three runs wrote."""
    rows = [("run", "sites x ranks", "WAN", "loss", "note")]
    steps = re.findall(r"^step +(\d+) +loss ([\d.]+) +WAN +([\d.]+) MiB/step +([\d.]+) MB/s",
                       (out / "lightning.log").read_text(), re.M)
    done = re.search(r"^done: (\d+) ranks in (\d+) sites", (out / "lightning.log").read_text(), re.M)
    if steps and done:
        step, loss, mib, rate = steps[-1]
        rows.append(("hierarchical_ddp (Lightning)", f"{done[2]} x {int(done[1]) // int(done[2])}",
                     f"{float(mib):.2f} MiB/step at {float(rate):.1f} MB/s", f"{float(loss):.3f} at step {step}",
                     "100 mbit lab WAN"))
    gpt = json.loads((out / "gpt_3d" / "run.json").read_text())
    layout = gpt["layout"]  # "8 ranks = site 2 x pp 2 x dp_replicate 1 x dp_shard 1 x tp 2"
    ranks, sites = int(layout.split()[0]), int(re.search(r"site (\d+)", layout)[1])
    rows.append(("parallel_3d (GPT)", f"{sites} x {ranks // sites}",
                 f"{gpt['wan']['bytes_sent'] / 1e6:.2f} MB in {gpt['wan']['calls']} reductions",
                 f"{gpt['losses'][0]:.3f} -> {gpt['losses'][-1]:.3f} (val {gpt['val_loss']:.3f})",
                 layout.split("= ")[-1]))
    bench = json.loads((out / "diloco.json").read_text())
    for rate, methods in bench["speed"].items():
        alone = methods["sites_alone"]["steps_per_s"]
        for method in ("hierarchical_ddp", "streaming_diloco"):
            m = methods[method]
            rows.append((f"{method} (bench)", "2 x 2", f"{m['wan_bytes_per_step'] / 1e3:.0f} KB/inner step",
                         "(speed run)", f"{rate}: {m['steps_per_s'] / alone:.0%} of the sites-alone step rate"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return [lines[0], "-" * max(len(line) for line in lines), *lines[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo-logs", help="where the logs, the GPT's run.json and the plot go")
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = parts(out)
    total = sum(run_part(part, out, i, len(todo)) for i, part in enumerate(todo, 1))
    print(f"\n== summary ({total:.0f} s)")
    print("\n".join(summary(out)))
    print(f"\nlogs: {out}/<part>.log; DiLoCo plot: {out}/diloco.png; Lightning metrics: {out}/lightning/")


if __name__ == "__main__":
    main()
