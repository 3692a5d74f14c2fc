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

.PHONY: install model serve test reliability lint bench clean system-deps

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

# The browser and alert-rule tests drive the system's Chromium and Prometheus' promtool
# (issue K): installed with apt where missing and possible; elsewhere those tests say why they skip.
SYSTEM_BINS := chromium promtool
system-deps:
	@missing=""; for b in $(SYSTEM_BINS); do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	pkgs=$$(echo "$$missing" | sed 's/promtool/prometheus/'); \
	if ! command -v apt-get >/dev/null; then echo "not installed:$$missing (no apt-get here): those tests will skip"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=sudo; \
	else echo "not installed:$$missing (needs root for apt-get): those tests will skip"; exit 0; fi; \
	echo "installing$$pkgs with apt-get"; \
	$$SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$pkgs >/dev/null

test: model system-deps
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
