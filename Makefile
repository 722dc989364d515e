# Two commands do all the set-up on a fresh machine:
#   make serve   serve the default model (SmolLM2-135M-Instruct) on http://127.0.0.1:8000
#   make test    run the test suite (hypothesis draws from a fixed, printed seed: tests/conftest.py;
#                ARGS=--hypothesis-profile=explore draws fresh cases); TEST_WORKERS processes share
#                the test files (pytest-xdist, whole files per process: module-scoped servers stay
#                in one), TEST_WORKERS=0 runs them in this process
# Both create .venv on first use. TORCH_SPEC is installed first so that pip never swaps in a
# multi-GB CUDA build on a CPU machine; on a GPU machine set TORCH_SPEC= to keep your own torch.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Two: the 2-core CI machine measured 1,050 s with 2 workers against 1,471 s for one process (fewer
# tests then); much of the suite waits on sockets, child ranks and servers starting.
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nanoserve-installed

.PHONY: serve test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/nanoserve serve --port 8000 $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

bench: $(STAMP)
	$(PY) -m nanoserve.bench.throughput --output benchmarks/throughput/smollm2-cpu.json $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
