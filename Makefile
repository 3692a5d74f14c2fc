# One-command set-up: `make serve` runs the service on the embedded default model,
# `make test` runs the test suite. Both create .venv and fetch the model on first use.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PY ?= python3
EXTRAS ?= cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(EXTRAS)
CONFIG ?= config.toml
# pip's per-index warnings about this machine's local mirrors drown the real output.
QUIET_PIP := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install model serve test reliability lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[$(EXTRAS),dev]' 2>&1 | $(QUIET_PIP)
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside CPU torch.
	if [ "$(EXTRAS)" = cpu ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP); fi
	$(BIN)/python -c "import llmd, sanic, vllm" >/dev/null
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/llmd models pull smollm2 --if-missing

serve: model
	$(BIN)/llmd serve --config $(CONFIG)

test: model
	$(BIN)/python -m pytest -q -rs

# Fault, flood and soak tests that take minutes each (README, "Reliability"); not in `make test`.
reliability: model
	$(BIN)/python -m pytest -q -rs -m reliability tests/reliability

# Style and likely bugs (ruff), types (mypy; strict for llmd/policy and the newer packages),
# and the architecture's import rules (import-linter): see docs/development.md.
lint: $(STAMP)
	$(BIN)/ruff check llmd tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

bench: model
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV)
