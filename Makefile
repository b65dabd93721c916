# Two commands for a fresh machine:  `make run`  and  `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: setup run test test-fast lint clean

setup: $(STAMP)

# (setup.py and the C sources: the native parts are built by the editable install)
$(STAMP): pyproject.toml setup.py src/stalwart/comm/_native/engine.c src/stalwart/detect/_native/bocpd.c \
		src/stalwart/detect/_native/channels.c src/stalwart/detect/_native/bocpd_step.h \
		src/stalwart/_native/beat.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# the main job on the built-in default: 4 ranks, tiny GPT, this Python's stdlib as the corpus
run: setup
	$(BIN)/stalwart run --nproc 4

# the whole suite (multi-process and root-only tests included; root-only ones skip without root)
test: setup lint
	$(BIN)/python -m pytest -q --durations=20

# quick unit tests only
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not root"

# ruff, and the import layering (pyproject.toml [tool.importlinter]: no upward import, the
# decision code torch-free)
lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) runs .pytest_cache
