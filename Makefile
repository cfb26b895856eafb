# Every target creates or updates the virtual environment it needs (pyproject.toml is its recipe).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= cpu,openvino,serve,generation,ray,dev
ARGS ?=
PYTEST_ARGS ?=
# The suite's processes (pytest-xdist; each runs one test module at a time, its fixtures built once); 0: one process.
PYTEST_WORKERS ?= 2

.PHONY: env demo test test-gpu gpu-check lab lab-check bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing the workbench and its dependencies into $(VENV) (a few minutes the first time; quiet until done)"
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/workbench install-perf-analyzer || echo "perf_analyzer not installed: served benchmarks use the asyncio load generator"
	touch $(STAMP)

env: $(STAMP)

demo: env  ## the whole pipeline on the embedded all-MiniLM-L6-v2 (ARGS="--steps export,optimize" etc.)
	$(BIN)/workbench run $(ARGS)

test: env  ## lint, then the CPU test suite on PYTEST_WORKERS processes (GPU tests live in tests/gpu)
	$(BIN)/ruff check workbench tests benchmarks docs
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

test-gpu: env  ## on an NVIDIA host installed with EXTRAS=gpu,serve,generation,dev
	$(BIN)/python -m pytest tests/gpu $(PYTEST_ARGS)

gpu-check: env  ## on an NVIDIA host, EXTRAS=gpu,serve,generation,dev: tests/gpu (refused without a GPU), the bench on CUDA
	WORKBENCH_REQUIRE_GPU=1 $(BIN)/python -m pytest tests/gpu $(PYTEST_ARGS)
	$(BIN)/python benchmarks/bench.py --device cuda --in-process $(ARGS)

lab: env  ## JupyterLab on outputs/: working copies of the notebooks in outputs/lab/, the runs beside them (ARGS="--no-browser" etc.)
	WORKBENCH_OUTPUTS="$${WORKBENCH_OUTPUTS:-$(CURDIR)/outputs}" $(BIN)/workbench lab $(ARGS)

lab-check: env  ## a real browser runs the notebooks in JupyterLab (Run All) and reports what it saw (ARGS="--notebooks 01,02")
	$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/python -m pip install --quiet -e ".[$(EXTRAS),docs]"
	test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q chromium)
	$(BIN)/python tests/browser/lab_check.py $(ARGS)

bench: env
	$(BIN)/python benchmarks/bench.py $(ARGS)

clean:  ## remove the runs in outputs/ (your notebooks in outputs/lab/ stay)
	find outputs -mindepth 1 -maxdepth 1 -type d ! -name lab -exec rm -rf {} +
