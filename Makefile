# make demo: set everything up, run the main job on the embedded defaults (no external service needed).
# make test: set everything up, run the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
# The unit tests are pure and share nothing: they run in this many pytest-xdist workers. The integration tests run
# in two lanes (tests/integration/conftest.py): those that train, one at a time (each already fills the machine's
# cores with real processes), and beside them the light ones, one at a time (the control plane's, mostly waiting on
# deadlines, and paced trainings of one rank per group); the tests that judge times run last in the training lane,
# with the machine to themselves (tests/integration/conftest.py).
UNIT_JOBS ?= 2

.PHONY: setup demo test test-fast lint proto bench benchmarks-doc clean

$(STAMP): pyproject.toml Makefile scripts/system-deps.sh
	bash scripts/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and deliberately: the CPU wheel, not a multi-GB CUDA build pulled by a bare requirement.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev,plot]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	mkdir -p out
	$(PY) -m fthsdp --log-level WARNING demo --report out/demo-report.json --plot out/demo-timeline.png \
		--trace out/demo-trace.json

# The unit tests (no processes, seconds): the inner loop.
test-fast: setup
	$(PY) -m pytest -q -n $(UNIT_JOBS) tests/unit

# ruff (style, imports, bug patterns) and mypy (strict on fthsdp.runtime, fthsdp.catchup, fthsdp.launch, fthsdp.trace,
# ftar, lighthouse).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

test: setup lint
	$(PY) -m pytest -q -n $(UNIT_JOBS) tests/unit
	$(PY) -m pytest -q -n 2 --durations=80 tests/integration

proto: setup
	$(PY) scripts/gen_protos.py

bench: setup
	$(PY) -m fthsdp bench lighthouse
	$(PY) -m fthsdp bench ftar
	$(PY) -m fthsdp bench overhead

# docs/benchmarks.md and docs/img/bench-*.png from docs/bench-data/*.json (fresh JSONs in out/bench/ are copied
# there first); running the benchmarks themselves is up to you (the page says how).
benchmarks-doc:
	$(PY) -m fthsdp.bench.docs --import out/bench

clean:
	rm -rf $(VENV) .pytest_cache
