# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv/ when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.multidc-installed

.PHONY: demo test test-all bench faults clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: any other spec pulls a multi-GB CUDA build on this machine class.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/multidc demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info bench-results
