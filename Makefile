# A newcomer's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test test-all bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jaxdist demo

# Two workers: tracing, planning and XLA's compiles are single-threaded (three workers on 2 cores
# were slower: 1363 s against 1278 s).
# `make test` leaves out the few cases marked slow (20 s to over a minute each); `make test-all` runs them too.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2

bench: $(STAMP)
	-$(VENV)/bin/jaxdist bench --suite all --size tiny --out bench/results/suites --readme bench/README.md
	-$(PY) bench/zero_memory.py
	-$(PY) bench/overhead.py
	-$(PY) bench/accumulation.py
	-$(PY) bench/plan_time.py
	-$(PY) bench/compare_hand.py
	-$(PY) bench/micro_budget.py
	-$(PY) bench/pipeline.py
	-$(PY) bench/estimate.py
	-$(PY) bench/tune.py
	-$(PY) bench/advise.py

clean:
	rm -rf $(VENV) build *.egg-info
