# Two entry points on a fresh machine: `make serve` and `make test`. Everything else is set-up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  ?= smollm2-135m

.PHONY: serve test lint install install-test postgres-bin bwrap-bin chromium clean \
	fleet-economics

# The CPU build of torch 2.13.0 is installed first and pinned: a bare `torch` requirement
# would otherwise pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: install
	$(BIN)/minimill pull $(MODEL)
	$(BIN)/minimill serve --model $(MODEL)

# PostgreSQL's server binaries for the store tests (Debian's package; the tests start a
# private server in a temporary directory and stop it afterwards).
postgres-bin:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql >/dev/null; }

# bubblewrap isolates boxes (sandboxes); prlimit (util-linux) sets their limits.
bwrap-bin:
	@command -v bwrap >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap >/dev/null; }

# Debian's chromium, for the dashboard's headless-browser test (driven through Playwright).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

lint: install-test
	$(BIN)/ruff check src tests
	$(BIN)/mypy

test: install-test postgres-bin bwrap-bin chromium
	$(BIN)/minimill pull $(MODEL)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The numbers and plots of docs/fleet-economics.md (a few minutes on two cores).
fleet-economics: install
	$(BIN)/python -m minimill.sim.economics --out docs/fleet-economics

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
