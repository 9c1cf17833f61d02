# Two commands do everything: `make run` (pipeline) and `make test` (test suite).
# Both create the pinned environment in .venv/ first if it is missing or older than pyproject.toml.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
# Offline, quiet defaults for the whole stack: no DVC analytics, no albumentations update check,
# no W&B, MindSpore logs errors only.
export DVC_NO_ANALYTICS := 1
export NO_ALBUMENTATIONS_UPDATE := 1
export WANDB_MODE := disabled
export GLOG_v := 3
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: env run test lint bench clean-env

# The offline page of `dvc plots show` (ops/plots_page.py): vega, vega-lite and vega-embed from
# the npm registry, pinned by ops/vega/package-lock.json, into build/vega/ (git-ignored), inlined
# into the page template that .dvc/config names. Without npm the page loads vega from DVC's CDN.
PLOTS_PAGE := build/vega/dvc-plots.html

env: $(STAMP) $(PLOTS_PAGE)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# distributed: pyspark + a JDK + ray, so the distributor tests run in `make test` (CI);
	# serve: the search service's dependencies (serving/, its tests)
	# postgres: a PostgreSQL server + driver, so the MLflow-on-PostgreSQL tests run in CI
	$(VENV)/bin/python -m pip install -q -e '.[dev,distributed,serve,postgres]'
	# img2dataset drags in the `dataclasses` backport, which shadows the standard module and breaks
	# Prefect's server on Python 3.11; remove it (pip check then names it, harmlessly).
	$(VENV)/bin/python -m pip uninstall -y -q dataclasses
	touch $(STAMP)

$(PLOTS_PAGE): ops/vega/package.json ops/vega/package-lock.json ops/plots_page.py $(STAMP)
	mkdir -p build/vega
	cp ops/vega/package.json ops/vega/package-lock.json build/vega/
	if command -v npm >/dev/null; then npm ci --prefix build/vega --no-audit --no-fund --silent \
		|| echo "npm ci failed: dvc plots show will load vega from its CDN (online only)"; \
	else echo "npm not found: dvc plots show will load vega from its CDN (online only)"; fi
	$(VENV)/bin/python -m ops.plots_page

run: env
	dvc repro

# Two xdist workers, one test module each at a time (module fixtures stay in one process).
test: env
	pytest -q -n 2 --dist loadfile

# The fast tier: every test not marked slow (tests/conftest.py says which must be), the same two
# workers (its budget: docs/testing.md). `make test` stays the whole suite, as CI runs it.
.PHONY: test-fast
test-fast: env
	pytest -q -n 2 --dist loadfile -m "not slow"

lint: env
	ruff check .

clean-env:
	rm -rf $(VENV)

# Prefect (docs/orchestration.md): a server, the deployments of prefect.yaml, a worker.
PREFECT_PORT ?= 4200
.PHONY: prefect-server deploy worker
prefect-server: env
	prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

deploy: env
	flows/deploy.sh

worker: env
	prefect worker start --pool clipms --type process

# The search service (docs/serving.md): the default run's champion from the local registry, on
# loopback, following the `champion` alias (a newly promoted version is swapped in live).
SERVE_PORT ?= 8000
.PHONY: serve
serve: env
	clipms-serve --follow champion --host 127.0.0.1 --port $(SERVE_PORT)

# Mutation testing of the critical modules (benchmarks/RESULTS.md has the scores):
# mutmut under `nice`, one module at a time, one child (the machine is shared); prints
# killed/survived/timeout per module. `make mutation MODULES="urlguard gate"` for some of them.
MODULES ?=
MUTATION_CHILDREN ?= 1
.PHONY: mutation
mutation: env
	MUTATION_CHILDREN=$(MUTATION_CHILDREN) nice -n 15 python benchmarks/mutation.py $(MODULES)
