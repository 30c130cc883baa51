# The README's two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenmill-installed

.PHONY: install run test bench clean

install: $(STAMP)

# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: generate on the built-in demo model (created on first use).
run: install
	$(VENV)/bin/tokenmill generate --prompt "The quick brown fox" --max-tokens 32

test: install
	$(PY) -m pytest -q tests

bench: install
	$(VENV)/bin/tokenmill bench throughput

clean:
	rm -rf $(VENV) *.egg-info
