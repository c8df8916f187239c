# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv/ when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.multidc-installed

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: any other spec pulls a multi-GB CUDA build on this machine class.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,test]"
	touch $(STAMP)

# Until the Lightning demo lands: the lab-WAN benchmark (root) or a 2 x 2 loopback all-reduce (non-root).
demo: $(STAMP)
	$(BIN)/multidc bench allreduce --sites 2 --ranks-per-site 2 --size-mb 64 --wan-rate 400mbit \
		--compression none,bf16,int8 --repeats 3

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/multidc bench allreduce --sites 2 --ranks-per-site 2 --size-mb 64 --wan-rate 400mbit \
		--compression none,bf16,int8 --repeats 5

clean:
	rm -rf $(VENV) build dist *.egg-info bench-results
