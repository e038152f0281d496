# One set of commands for people, CI and docs. Every target installs what it
# needs on first use into .venv (the on-disk CPU torch wheel, never a CUDA one):
# the runtime (torch, breakpod[debugpy], breakpod-broker) for `make demo`, and the
# test and lint tools of requirements-dev.txt besides for the other targets.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
TOOLS  := $(VENV)/.installed-tools
TORCH  := torch==2.13.0

.PHONY: install test lint demo bench clean chaos scale
.PHONY: deploy-test helm-lint e2e-kind e2e-docker gpu-check screenshots images e2e-cluster

# The runtime: what the demo and a training job need.
$(STAMP): agent/pyproject.toml agent/src/breakpod_autostart.pth broker/pyproject.toml
	@echo "make: installing the runtime into $(VENV): $(TORCH) (CPU), breakpod[debugpy], breakpod-broker"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH)
	$(PIP) install -e "agent[debugpy]" -e broker $(TORCH)
	touch $@

# The test and lint tools (pytest, ruff, mypy, the deployment and browser tools, ...).
$(TOOLS): $(STAMP) requirements-dev.txt
	@echo "make: installing the test and lint tools of requirements-dev.txt into $(VENV)"
	$(PIP) install -r requirements-dev.txt $(TORCH)
	touch $@

install: $(STAMP) $(TOOLS)

# Three workers on two cores: most tests wait on real processes, brokers and timeouts
# (TEST_WORKERS=0 runs the suite in one process).
TEST_WORKERS ?= 3
test: $(TOOLS)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=10

# Fault injection, long: kill -9 of redis-server and of the broker 20 times each
# (`make test` runs the same tests with CHAOS_ROUNDS=2).
chaos: $(TOOLS)
	CHAOS_ROUNDS=20 $(PY) -m pytest tests/chaos

lint: $(TOOLS)
	$(VENV)/bin/ruff check agent tests bench examples
	$(VENV)/bin/ruff format --check agent tests bench examples
	$(VENV)/bin/mypy agent/src
	$(VENV)/bin/ruff check broker
	$(VENV)/bin/ruff format --check broker
	$(VENV)/bin/mypy broker/src

demo: $(STAMP)
	$(PY) examples/run_demo.py

bench: $(TOOLS)
	$(PY) bench/run.py

# The broker at scale, the whole grid (1k/5k/10k sessions, 0/20/100 followers,
# one and three replicas); long. `make bench` runs one small row of each kind.
scale: $(TOOLS)
	$(PY) bench/scale.py --full

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Deployment: chart (Helm Go SDK), webhook, compose, Dockerfiles; part of `make test`.
deploy-test: $(TOOLS)
	$(PY) -m pytest tests/deploy

helm-lint: $(TOOLS)
	$(PY) -m pytest tests/deploy/test_chart.py

# The compose stack on a real Docker engine (started here when possible;
# skipped with the reason otherwise). .ci/run runs it too.
e2e-docker: $(TOOLS)
	PY=$(PY) scripts/e2e-docker.sh

# Needs docker, kind, kubectl and image downloads: not run in CI. A kind
# cluster, the images loaded into it, then the e2e-cluster checks.
e2e-kind: $(TOOLS)
	PY=$(PY) scripts/e2e-kind.sh

# Against the cluster in KUBECONFIG (IMAGE_REPOSITORY, TRAIN_IMAGE, REDIS_DIGEST:
# scripts/e2e-cluster.sh); one line and exit 0 where no cluster is reachable.
e2e-cluster: $(TOOLS)
	PY=$(PY) scripts/e2e-cluster.sh

# The broker image and the debug layer, tagged locally as
# $(REGISTRY)/breakpod-{broker,debug}:VERSION, to push to your registry
# (LOCAL=1: on scripts/base-images.sh's local bases).
images:
	scripts/images.sh

# On a machine with a CUDA device and its own torch: the gpu-marked tests.
gpu-check:
	scripts/gpu-check.sh

# The dashboard with fixture data (a 4-rank job, one rank parked on a NaN) as PNGs
# under screenshots/ (gitignored), for the README; needs Debian's chromium.
screenshots: $(TOOLS)
	$(PY) -m tests.dashboard.screenshots screenshots
