PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Bytecode caches on, whatever the shell says: without them every process of the tests (each
# pytest worker, each program a test runs) compiles the checkout and rewrites the test modules
# again, about 10 s of CPU per pytest process. __pycache__/ is ignored by git.
unexport PYTHONDONTWRITEBYTECODE

# Paths that ruff looks at; ones that do not exist (yet) are left out.
LINT_PATHS := $(wildcard mersal mersal_amqp10 mersal_dashboard mersal_rabbitmq mersal_sqlalchemy tests bench examples docs/samples \
	scripts/docs-samples)

.PHONY: help run services test test-lowest lint format bench chaos cluster-test fuzz docs screenshots \
	docs-samples docs-serve dist clean

help:
	@echo "Targets:"
	@echo "  make run     [ARGS=...]         run the orders example (python -m examples.orders)"
	@echo "  make services                   install, start and set up RabbitMQ and PostgreSQL for the tests"
	@echo "  make test    [PYTEST_ARGS=...]  services, lint, the docs build, then pytest (no chaos, cluster)"
	@echo "                [WORKERS=3]       test processes (pytest-xdist; 0: one process)"
	@echo "  make test-lowest                the failover and recovery tests on the lowest allowed aio-pika"
	@echo "  make lint                       ruff check, ruff format --check, mypy"
	@echo "  make format                     ruff format + ruff check --fix"
	@echo "  make bench   [ONLY=name]        run the benchmarks (python -m bench)"
	@echo "  make chaos   [PYTEST_ARGS=...]  run only the chaos tests"
	@echo "  make cluster-test [PYTEST_ARGS=...]  boot a local 3-node RabbitMQ cluster, run tests/cluster"
	@echo "  make fuzz    [PYTEST_ARGS=...]  the property tests with new random examples, 10x as many"
	@echo "  make screenshots                the dashboard's browser tests, keeping their PNGs for the docs"
	@echo "  make docs                       build the docs site into site/ (mkdocs build --strict)"
	@echo "  make dist                       build the sdist and the wheel of mersal-bus into dist/"
	@echo "  make docs-serve                 serve the docs site on http://127.0.0.1:8000, rebuilt on change"
	@echo "  make docs-samples               copy docs/samples' code into the pages' code blocks"
	@echo "  make clean                      remove .venv and caches"
	@echo "Variables: PY=$(PY) (interpreter used to create $(VENV))"

# editable_mode=compat: the checkout's path in a .pth, which mypy follows (it cannot follow
# setuptools' default editable import hook), so a user's code type-checks against mersal.
# The distribution is mersal-bus; a .venv made before it was renamed has it as `mersal` (on PyPI
# that name is another project's, which ships an import package `mersal` too): uninstalled first.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip uninstall -qq -y mersal
	@# python-qpid-proton (amqp10://) is built from source: it needs a C compiler
	command -v cc >/dev/null 2>&1 || { apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y gcc libc6-dev </dev/null; }
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=compat
	touch $@

run: $(STAMP)
	$(BIN)/python -m examples.orders $(ARGS)

# Idempotent: installs and starts what is missing, enables the RabbitMQ plugins the tests use.
services:
	bash scripts/services

# Worker processes for make test (pytest-xdist); WORKERS=0 runs the tests in this one process.
WORKERS ?= 3

# docs/dashboard.md's pictures, taken by the dashboard's browser tests in headless Chromium.
screenshots: $(STAMP) services
	MERSAL_SCREENSHOTS=docs/images/dashboard $(BIN)/pytest tests/mersal_dashboard/test_browser.py

test: $(STAMP) services
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory docs
	$(BIN)/pytest -n $(WORKERS) $(PYTEST_ARGS)

# The lowest aio-pika, aiormq and pamqp that pyproject.toml's rabbitmq extra allows, in a venv of
# their own (keep LOWEST equal to the extra's floors).
LOWEST := aio-pika==10.0.0 aiormq==7.1.3 pamqp==4.0.0
LOWEST_VENV := .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed

$(LOWEST_STAMP): pyproject.toml Makefile
	test -x $(LOWEST_VENV)/bin/python || $(PY) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/pip uninstall -qq -y mersal
	$(LOWEST_VENV)/bin/pip install -q -e '.[rabbitmq,sqlalchemy,pydantic]' 'pytest>=8' \
		'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' 'hypothesis>=6' $(LOWEST)
	touch $@

test-lowest: $(LOWEST_STAMP) services
	$(LOWEST_VENV)/bin/pytest -p no:cacheprovider tests/mersal_rabbitmq/test_connection.py \
		tests/mersal_rabbitmq/test_recovery.py tests/mersal_rabbitmq/test_patches.py \
		tests/mersal_rabbitmq/test_aio_pika_restoration.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format $(LINT_PATHS)
	$(BIN)/ruff check --fix $(LINT_PATHS)

bench: $(STAMP) services
	$(BIN)/python -m bench $(if $(ONLY),--only $(ONLY),)

# addopts holds -m "not chaos"; this -m comes later on the command line and wins.
chaos: $(STAMP) services
	$(BIN)/pytest -m chaos -p no:cacheprovider $(PYTEST_ARGS)

# The nodes run beside the default one (ports 5681-5683) and are stopped when the run ends.
cluster-test: $(STAMP) services
	$(BIN)/pytest -m cluster -p no:cacheprovider tests/cluster $(PYTEST_ARGS)

# The checks docs/security.md points to.
SECURITY_TESTS = tests/mersal/test_header_trust.py tests/mersal_rabbitmq/test_header_trust.py \
	tests/mersal/test_urls.py tests/mersal/test_settings.py \
	tests/test_no_unsafe_code.py

# make test runs the property tests derandomized (the same examples everywhere); this explores.
fuzz: $(STAMP)
	MERSAL_FUZZ=explore $(BIN)/pytest -p no:cacheprovider tests/fuzz $(SECURITY_TESTS) tests/mersal/test_settle.py::test_every_message_ends_once_whatever_its_handler_does $(PYTEST_ARGS)
	$(BIN)/python -m tests.fuzz.fuzz_decode --iterations 200000

docs: $(STAMP)
	$(BIN)/python scripts/docs-samples --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The sdist, and the wheel built from it as an installer would build it: dist/mersal_bus-*.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# The pages show copies of docs/samples (and of the FastAPI example): after changing a sample,
# or writing `<!-- copied from docs/samples/module.py:section by make docs-samples -->` on a page.
docs-samples:
	$(PY) scripts/docs-samples

clean:
	rm -rf $(VENV) $(LOWEST_VENV) .mypy_cache .ruff_cache .pytest_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
