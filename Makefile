# Two commands for a new machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# What the build itself needs (pyproject.toml [build-system]); installed into
# the venv so the editable build can skip pip's isolated build environment.
BUILD_DEPS := "setuptools>=77" wheel "tensorflow-cpu>=2.21,<2.22" "grpcio-tools>=1.85.1,<1.86"
# The op library's sources; ops/tests/ holds standalone test programs.
OPS_SOURCES := $(shell find ops -path ops/tests -prune -o \( -name '*.cc' -o -name '*.h' \) -print)
# The simulator's native filling and event core (C, no TensorFlow); native/tests/ holds a check.
NATIVE_SOURCES := native/max_min.c native/fluid_core.c
PROTOS := $(shell find protos -name '*.proto')
STAMP := $(VENV)/.prophet_tf-installed
# The ssh server `make test-long` needs (see the rule below).
SSHD := /usr/sbin/sshd

.PHONY: demo test test-long install build bench clean sanitize

demo: build
	$(PY) -m prophet_tf launch --workers 2 --ps 1 -- $(PY) examples/train_digits.py

# One pytest process per core and one more (at most 4): a test module's tests stay
# in one process, so the clusters they share are started once, and the extra
# process runs while the others' tests wait on their clusters' timeouts and sleeps.
TEST_PROCESSES ?= $(shell echo $$(( $$(nproc) + 1 )))
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCESSES) --maxprocesses 4 \
	--dist loadfile --no-loadscope-reorder --durations=30

# The native stress test's plain binary is built with the project, not inside the
# test run (about 30 CPU-seconds of g++); the sanitized ones are test-long's.
STRESS := build/stress/runtime_stress-plain

test: build $(STRESS)
	$(PYTEST)

# The long variants (marked slow) alone: the full demo's accuracy, the
# 10,000-request fuzz, the 200-step load test, the sanitizer runs, `launch
# --hosts` over real ssh. CI runs them after `make test`.
test-long: build $(SSHD)
	$(PYTEST) --runslow -m slow

# `launch --hosts`'s tests run a real sshd in network namespaces (as root):
# Debian's openssh-server, installed here when it is missing. The tests start
# their own sshd with their own configuration and keys.
$(SSHD):
	@if [ "$$(id -u)" != 0 ]; then echo "make test-long needs $(SSHD) (openssh-server) for the launch --hosts tests, and root for their network namespaces: run it as root, or install openssh-server first" >&2; exit 1; fi
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server

install: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python pyproject.toml setup.py
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(BUILD_DEPS)
	$(PIP) install -q --no-build-isolation -e ".[test,examples]"
	# Keras 2 for the tf_keras tests and the tf-mwms baseline; --no-deps keeps
	# tensorflow-cpu (tf_keras asks for the `tensorflow` distribution).
	$(PIP) install -q --no-deps "tf_keras>=2.21,<2.22"
	touch $@

# Rebuild the native libraries and the generated gRPC code when their sources change
# (one build_ext makes both libraries: a grouped target).
build: $(STAMP) prophet_tf/_prophet_ops.so prophet_tf/_max_min.so prophet_tf/_fluid_core.abi3.so

prophet_tf/_prophet_ops.so prophet_tf/_max_min.so prophet_tf/_fluid_core.abi3.so &: $(OPS_SOURCES) $(NATIVE_SOURCES) $(PROTOS) $(STAMP)
	$(PY) setup.py -q build_ext --inplace

$(STRESS): ops/runtime.cc ops/runtime.h ops/tests/runtime_stress.cc ops/tests/build_stress.py $(STAMP)
	$(PY) ops/tests/build_stress.py --mode plain

bench: build
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_transport.py
	$(PY) benchmarks/bench_scheduler.py

# Stress ops/runtime.cc from 8 threads under AddressSanitizer + UBSan, then
# ThreadSanitizer, 30 s each (links runtime.cc directly, not the op library).
sanitize: $(STAMP)
	$(PY) ops/tests/build_stress.py --mode asan --run 30
	$(PY) ops/tests/build_stress.py --mode tsan --run 30

clean:
	rm -rf build *.egg-info prophet_tf/_prophet_ops.so prophet_tf/_max_min.so prophet_tf/_fluid_core.abi3.so prophet_tf/_build_info.json \
	  prophet_tf/ps/v1/*_pb2*.py prophet_tf/ps/v1/*_pb2*.pyi
