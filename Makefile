# Two commands set everything up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/sh
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export LITELLM_LOCAL_MODEL_COST_MAP := True
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Python's default, where an environment turns it off: the checkout's modules keep their
# bytecode in __pycache__, so each pytest process does not rewrite every test module's
# assertions again (collection 9 -> 4 CPU-s a process) and the hundreds of interpreters the
# suite starts do not compile wmo_trio again.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: test test-fast coverage coverage-check demo bench bench-quick soak lint typecheck clean

# The venv is rebuilt only when the project's dependencies change, so a second
# `make test` goes straight to the tests.
# The docker-free environment's sandbox needs bubblewrap, slirp4netns, keyutils and
# libseccomp (Debian packages); as root they are installed here when missing.
SANDBOX_PACKAGES := bubblewrap slirp4netns keyutils libseccomp2
$(STAMP): pyproject.toml constraints.txt scripts/find-python
	@command -v bwrap >/dev/null && command -v slirp4netns >/dev/null && command -v keyctl >/dev/null \
	        && /sbin/ldconfig -p | grep -q 'libseccomp\.so\.2 ' || { \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        echo "installing $(SANDBOX_PACKAGES) for the docker-free environment"; \
	        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	            $(SANDBOX_PACKAGES) >/dev/null; \
	    else \
	        echo "note: install $(SANDBOX_PACKAGES) to use the docker-free environment"; \
	    fi; }
	@test -x $(PY) || { py=$$(scripts/find-python) && echo "creating $(VENV) with $$py" && "$$py" -m venv $(VENV); }
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,bench]'
	@touch $(STAMP)

# The whole suite, with lint and types: what CI runs, in TEST_PROCESSES processes. Each
# test file runs whole in one of them (`--dist loadfile`), so a module's shared harbor job
# runs once. (xdist's `loadgroup` would be finer, but with pytest 9.2 it groups nothing:
# it renames the items' `_nodeid`, which pytest no longer reads.)
# Three processes on two cores: a good part of the suite waits (harbor's timeouts,
# sandboxes starting, servers answering), and a third file running fills those waits.
# Lint and types run beside the tests at the lowest CPU priority, so they take the cycles
# the tests still leave idle rather than a minute of their own before them; their report
# follows the tests', and either failing fails the target. (A fourth process left lint
# no idle cycles until the tests' end, and the whole took longer.)
TEST_PROCESSES := 3
test: $(STAMP)
	@lint_log=$$(mktemp) || exit 1; \
	nice -n 19 $(MAKE) --no-print-directory lint > "$$lint_log" 2>&1 & lint=$$!; \
	trap 'kill $$lint 2>/dev/null; rm -f "$$lint_log"; exit 130' INT TERM; \
	echo "$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile  (lint and types beside it)"; \
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile; tested=$$?; \
	wait $$lint; linted=$$?; cat "$$lint_log"; rm -f "$$lint_log"; \
	[ $$linted -eq 0 ] || echo "make test: lint or types failed (above)"; \
	[ $$tested -eq 0 ] && [ $$linted -eq 0 ]

# The edit-and-test loop: everything but harbor trials, soak-like hypothesis schedules,
# sandboxes and subprocess runs (the `slow` marker), on both cores.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n 2

# Branch coverage of wmo_trio over the whole suite, subprocesses included; the report is
# printed and written to coverage-html/. Fails when the engine or the episode package is
# below COVERAGE_FLOOR (issue 16), each counted on its own: `coverage-check` reads the
# data the last `make coverage` left.
COVERAGE_FLOOR := 90
COVERED_PACKAGES := engine episode

coverage: $(STAMP)
	rm -f .coverage .coverage.*
	$(PY) -m pytest -q --cov=wmo_trio --cov-branch --cov-report=term-missing:skip-covered \
		--cov-report=html:coverage-html
	@$(MAKE) --no-print-directory coverage-check

coverage-check: $(STAMP)
	@failed=; for package in $(COVERED_PACKAGES); do \
	    total=$$($(PY) -m coverage report --include="wmo_trio/$$package/*" --format=total \
	        --precision=1 --fail-under=$(COVERAGE_FLOOR) 2>/dev/null) || failed="$$failed $$package"; \
	    echo "wmo_trio/$$package: $$(echo "$$total" | head -n 1) % branch coverage (floor $(COVERAGE_FLOOR) %)"; \
	done; \
	if [ -n "$$failed" ]; then echo "below the floor:$$failed"; exit 1; fi

demo: $(STAMP)
	$(VENV)/bin/wmo-trio run

bench: $(STAMP)
	$(PY) -m benchmarks --docs
	$(PY) -m benchmarks.race

bench-quick: $(STAMP)
	$(PY) -m benchmarks --quick
	$(PY) -m benchmarks.race --quick

soak: $(STAMP)
	$(PY) -m benchmarks.soak

lint: $(STAMP)
	$(VENV)/bin/ruff check wmo_trio tests benchmarks examples
	$(VENV)/bin/mypy

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) jobs .pytest_cache
