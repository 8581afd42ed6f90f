# Two entry points on a fresh machine: `make serve` and `make test`. Everything else is set-up.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  ?= smollm2-135m

.PHONY: serve test lint install install-test postgres-bin bwrap-bin chromium clean \
	fleet-economics docs

# The CPU build of torch 2.13.0 is installed first and pinned: a bare `torch` requirement
# would otherwise pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test,docs]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: install bwrap-bin
	$(BIN)/minimill pull $(MODEL)
	$(BIN)/minimill serve --model $(MODEL) --webhook-allow-private

# PostgreSQL's server binaries for the store tests (Debian's package; the tests start a
# private server in a temporary directory and stop it afterwards).
postgres-bin:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql >/dev/null; }

# Boxes' sandbox: bubblewrap isolates them, libseccomp builds their seccomp filter, prlimit and
# setpriv (util-linux) set their limits and uid, pasta (passt) and ip (iproute2) give a box
# with network its own user-mode network. pasta opens /dev/net/tun as the box's uid: it must
# be usable by everyone, as distributions ship it (some minimal machines have it 0600).
bwrap-bin:
	@{ command -v bwrap && command -v pasta && command -v ip && command -v setpriv && \
	   ls /usr/lib/*/libseccomp.so.2 /lib/*/libseccomp.so.2; } >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq bubblewrap passt \
	    iproute2 libseccomp2 util-linux >/dev/null; }
	@[ ! -c /dev/net/tun ] || [ "$$(stat -c %a /dev/net/tun)" = 666 ] || \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) chmod 0666 /dev/net/tun

# Debian's chromium, for the dashboard's headless-browser test (driven through Playwright).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

lint: install-test
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# The documentation site, into site/: the reference pages (CLI, HTTP API) and the benchmarks
# page are generated first; --strict makes a broken link or page fail the build.
docs: install-test
	$(BIN)/python scripts/gen_cli_reference.py docs/reference/cli.md
	$(BIN)/python scripts/gen_api_reference.py docs/reference/http-api.md
	$(BIN)/python scripts/gen_benchmarks.py docs/benchmarks.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: install-test postgres-bin bwrap-bin chromium
	$(BIN)/minimill pull $(MODEL)
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(MAKE) --no-print-directory docs
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The numbers and plots of docs/fleet-economics.md (a few minutes on two cores).
fleet-economics: install
	$(BIN)/python -m minimill.sim.economics --out docs/fleet-economics

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
