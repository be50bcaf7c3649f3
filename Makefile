# The two commands of the README are `make demo` and `make test`; both install what
# they need on a fresh machine (virtual environment, Python packages, Kafka's jars)
# and reuse the caches under ~/.cache on later runs.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast lint demo observe bench image kafka-jars engine harnesses browser learner helm kube \
        prometheus jaeger parts python-parts clean

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing OpenForge with its test and lint tools"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade "pip>=25.1"
	@$(PY) -m pip install --quiet -e . --group test --group lint
	@touch $(STAMP)

install: $(STAMP)

kafka-jars: $(STAMP)
	@$(VENV)/bin/openforge kafka fetch

# vLLM's CPU build in its own environment (about 3 GiB, once) and the tiny model.
engine:
	@bash scripts/vllm/install.sh >/dev/null

# Claude Code, Codex and OpenClaw from npm, for the end-to-end tests (once).
harnesses:
	@bash scripts/harnesses/install.sh >/dev/null

# A headless Chromium (inside the @sparticuz/chromium package) and playwright-core from npm, for the
# flight recorder's browser test (once).
browser:
	@bash scripts/browser/install.sh >/dev/null

# The learner's torch, transformers<5.11 and veRL (imports only what runs on CPU) in $(VENV) (once).
learner: $(STAMP)
	@bash scripts/learner/install.sh

# helm built from the Go module proxy, and Strimzi's CRDs generated from its Maven Central artifacts,
# for the chart tests (once each, cached).
helm:
	@bash scripts/helm/install.sh >/dev/null
	@bash scripts/helm/strimzi_crds.sh >/dev/null

# kube-apiserver, kube-scheduler, kube-controller-manager, etcd and kwok built from the Go module proxy
# for the integration tests and the simulated cluster (once; see docs/kube.md for the build times).
kube:
	@bash scripts/kube/install.sh >/dev/null

# Prometheus (with promtool) and Jaeger built from the Go module proxy, for the dashboard and trace
# tests and `make observe` (once each, cached).
prometheus:
	@bash scripts/prometheus/install.sh >/dev/null

jaeger:
	@bash scripts/jaeger/install.sh >/dev/null

# Everything the suite needs, installed side by side: unpacking wheels keeps about one core busy while the
# Go builds can use both, so on a fresh machine the overlap saves minutes. The learner waits for
# the engine because it reuses the torch wheels the engine's install downloads, and Kafka's jars are
# fetched by .venv's own Python only once nothing installs into .venv any more. Output is not held back
# per job (a cold kube-apiserver build takes minutes), so the jobs' lines interleave; the install
# scripts' own progress lines say which script they come from ([kube-install +95s] ...).
PARTS_JOBS ?= 3
parts:
	@$(MAKE) --no-print-directory -j$(PARTS_JOBS) kube python-parts helm prometheus jaeger harnesses browser

python-parts: engine $(STAMP)
	@$(MAKE) --no-print-directory learner
	@$(MAKE) --no-print-directory kafka-jars

test: parts
	@$(PY) -m pytest

# Inner loop: everything that needs no broker.
test-fast: install learner
	@$(PY) -m pytest tests/unit

lint: install
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/mypy

demo: install kafka-jars learner
	@$(VENV)/bin/openforge demo

# The demo with Prometheus (:9090) and Jaeger (:16686) receiving its metrics and traces.
observe: install kafka-jars learner prometheus jaeger
	@$(VENV)/bin/openforge observe --prometheus "$$(bash scripts/prometheus/install.sh 2>/dev/null | tail -n 1)/prometheus" \
		--jaeger "$$(bash scripts/jaeger/install.sh 2>/dev/null | tail -n 1)/jaeger"

bench: install kafka-jars engine learner kube
	@$(PY) -m bench.producer
	@$(PY) -m bench.proxy --json out/bench/proxy.json --plot out/bench/proxy.png
	@$(PY) -m bench.continuation --json out/bench/continuation.json
	@$(PY) -m bench.shipper
	@$(PY) -m bench.linear_calls
	@$(PY) -m bench.learner
	@$(PY) -m bench.publisher
	@$(PY) -m bench.cluster --json out/bench/cluster.json

# The image the Helm chart runs (see Dockerfile); tag it as the chart's appVersion.
IMAGE ?= ghcr.io/openforge/openforge:$(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' helm/openforge/Chart.yaml)
DOCKER ?= docker
image:
	@command -v $(DOCKER) >/dev/null || { echo "building the image needs $(DOCKER) (or DOCKER=podman)" >&2; exit 1; }
	$(DOCKER) build -t $(IMAGE) .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
