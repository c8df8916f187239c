# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv/ when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.multidc-installed

.PHONY: demo test test-fast lint docs bench bench-allreduce bench-diloco bench-diloco-hetero bench-diloco-auto bench-checkpoint bench-checkpoint-regions bench-pipeline faults clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: any other spec pulls a multi-GB CUDA build on this machine class.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,test,bench,docs]"
	touch $(STAMP)

# The main demo (examples/demo.py): an ordinary Lightning script (strategy="hierarchical_ddp") trained by 2 sites x 2
# ranks over a 100 mbit lab WAN (network namespaces as root, else loopback); a small GPT with site x pipeline x tensor
# parallelism (parallel_3d, 8 ranks, 2 sites); at 10 mbit, hierarchical DDP next to streaming DiLoCo (speed only).
# One line per part on screen, a summary table at the end; every run's whole output in demo-logs/<part>.log.
demo: $(STAMP)
	$(BIN)/python examples/demo.py --out demo-logs

# Two pytest workers (pytest-xdist), one test module at a time each (its module fixtures run once): most tests wait
# on processes they started (start-up, heartbeats, a WAN timeout), so two modules at once keep both cores busy.
# compileall first: the suite starts hundreds of interpreters (ranks, launchers, CLI calls), and where Python may not
# write bytecode itself (PYTHONDONTWRITEBYTECODE, as on this machine class) each one compiled multidc and the tests
# from source again: about a second of CPU per process on 2 loaded cores.
test: $(STAMP)
	$(BIN)/python -m compileall -q hierarchical plugins strategies tests benchmarks examples
	MULTIDC_REQUIRE_TEST_RESOURCES=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=20

# The inner loop: tests that start no process (tests/conftest.py marks the others `dist`).
test-fast: $(STAMP)
	MULTIDC_REQUIRE_TEST_RESOURCES=1 $(BIN)/python -m pytest -q -m "not dist"

lint: $(STAMP)
	$(BIN)/ruff check .

# The documentation site (mkdocs.yml, docs/): guides and the API reference from the docstrings, into build/site/.
# --strict: a broken link, a missing reference or a docstring griffe cannot parse fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Benchmarks (figures in docs/benchmarks.md): all of them, or one at a time.
bench: bench-allreduce bench-diloco bench-diloco-hetero bench-checkpoint bench-pipeline

bench-allreduce: $(STAMP)
	$(BIN)/multidc bench allreduce --sites 2 --ranks-per-site 2 --size-mb 64 --wan-rate 400mbit \
		--compression none,bf16,int8 --repeats 5 --plot docs/bench_allreduce.png

# Hierarchical DDP vs DiLoCo vs streaming DiLoCo (int8, sparse top-k) vs sites alone: utilization at 1/10/50/200
# mbit, loss at equal tokens.
# Rewrites the figure and data of docs/benchmarks.md (docs/bench_diloco.png, .json).
bench-diloco: $(STAMP)
	$(BIN)/multidc bench diloco --rates 1mbit,10mbit,50mbit,200mbit --json docs/bench_diloco.json

# Unequal sites on the lab WAN: one site slowed 2x (fixed H vs rounds by time with token weights), sites of 3+1 ranks
# (equal vs token weights). Rewrites docs/bench_diloco_hetero.png and .json (docs/benchmarks.md).
bench-diloco-hetero: $(STAMP)
	$(BIN)/multidc bench diloco --heterogeneous --json docs/bench_diloco_hetero.json

# "auto" settings against a grid of H at two lab WAN rates, then the link's rate halved mid-run (docs/benchmarks.md).
bench-diloco-auto: $(STAMP)
	$(BIN)/multidc bench diloco --auto --rates 50mbit,200mbit --ranks-per-site 1 --steps 192 --grid 8,16,32,64 \
		--change-after 64 --json docs/bench_diloco_auto.json

bench-checkpoint: $(STAMP)
	$(BIN)/python benchmarks/bench_checkpoint.py --size-mb 256 --repeats 4 --plot docs/bench_checkpoint.png

# Region-local checkpoints vs one URL (as root: a 100 mbit lab WAN, 2 sites x 2 ranks, one SeaweedFS per site in its
# namespace): seconds per site, WAN bytes from the interface counters, the raw PUT / GET + exchange bounds per region.
bench-checkpoint-regions: $(STAMP)
	$(BIN)/python benchmarks/bench_checkpoint_regions.py --size-mb 256 --repeats 4 --plot docs/bench_checkpoint_regions.png

bench-pipeline: $(STAMP)
	$(BIN)/python benchmarks/bench_pipeline.py --plot docs/bench_pipeline.png

# The long fault scripts (figures in docs/faults.md): >= 50 random-rank kills mid-save on a local dir and on SeaweedFS S3,
# then WAN cuts in the lab, then elastic sites under random kills, cuts and lighthouse restarts (needs root:
# network namespaces). Each exits non-zero on a lost or corrupt checkpoint, a late or silent failure, a resume
# that lost a committed step, or an elastic step lost, applied twice, stalled too long or diverged.
faults: $(STAMP)
	mkdir -p bench-results
	$(BIN)/python benchmarks/fault_checkpoint_kills.py --kills 50 --store both --json bench-results/fault_kills.json
	$(BIN)/python benchmarks/fault_wan_cut.py --repeats 3 --json bench-results/fault_wan_cut.json
	$(BIN)/python benchmarks/fault_elastic.py --faults 20 --steps 200 --json bench-results/fault_elastic.json

clean:
	rm -rf $(VENV) build dist *.egg-info bench-results demo-logs
