#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The test command: installs what is missing, configures, builds (CUDA when nvcc is found, for one
# architecture to keep the build short), and runs every test: ctest, then the Python suite in
# three stages, each running the test files tests/python/ci_stages.py assigns to it (which and
# why: docs/DEVELOPMENT.md, "Which stage runs what"): on Debian's torch 1.13 (.venv, the oldest
# supported) the files whose code path depends on the torch version; on the newest torch 2.x
# from PyPI (scripts/test-torch2.sh: .venv-torch2, the same wheel) every file; and in the
# sanitizer stage (scripts/sanitize.sh: ASan+UBSan suites, bounded fuzzing) the files that cross
# the binding boundary, against the ASan build of the extension; the sanitizer stage runs in a
# second lane beside the others (see "Two lanes" below).
# Environment: BUILD_DIR (default build-test), GRADCOMP_CUDA (AUTO/ON/OFF), CUDA_ARCHS (default:
# native where a GPU is visible, else 90-virtual, see below), JOBS (default 2),
# GRADCOMP_CI_FULL=1 (every Python test file in every stage, and the host C++ suites in the
# Release tree as well as under ASan: for releases),
# GRADCOMP_SKIP_TORCH2=1 (skip the torch 2.x stage, which downloads about 3 GB once, cached in
# GRADCOMP_WHEELHOUSE, default ~/.cache/gradcomp/wheelhouse; torch 1.13 then runs every file), GRADCOMP_SKIP_SANITIZE=1 (skip the sanitizer stage), GRADCOMP_CCACHE (ON when ccache is
# found: scripts/build_env.sh), OMP_WAIT_POLICY (default passive).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

source scripts/build_env.sh  # (ccache: the wheel reuses the C++ build's compiles)
# OpenMP threads that wait for work sleep instead of spinning: the suites run two at a time (ctest
# -j 2, the ranks of a Python test, the two lanes below) on as many cores, where a spinning
# thread takes the CPU another process needs (four ASan suites at ctest -j 2: 115 s, 221 CPU-s
# spinning; 101 s, 187 CPU-s passive, 2026-11-28).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

# Two lanes. The first (this shell): the C++ build, its tests, the wheel, then the Python suite on
# the newest torch. The second (in the background from the start): the sanitizer stage
# (scripts/sanitize.sh: its own build tree, ctest, fuzzers, then half of the Python files of the
# stage "asan" once the wheel is installed), at nice 19: while the C++ build runs it takes only
# the CPU the build leaves idle, and the torch 2.x stage runs at nice 19 too, so that from then on
# the two lanes share the CPU evenly. When the torch 2.x stage is done, this lane runs the other
# half of the "asan" files (--shard 1/2), so that the end of CI is not one lane alone: that step
# ran 391 s by itself at the end, with one core mostly idle. (Measured on the 2-core machine, side
# by side saves little over one after the other while both lanes are busy, 1041 s against about
# 1075 s: CI time is cut by doing less work or by keeping both cores busy to the end:
# bench/results/ci_full_2026-11-28.md.) The torch 2.x packages (about 3 GB to download and
# unpack) are made ready in the background as well. Each background step's log is printed when
# its lane joins; a failure fails CI; every background process is killed on exit.
bg_logs=$(mktemp -d)
bg_pids=()
kill_tree() {  # a background step and everything it started
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
  kill "$1" 2>/dev/null || true
}
trap 'for p in "${bg_pids[@]}"; do kill_tree "$p"; done; rm -rf "$bg_logs"' EXIT
bash scripts/test-torch2.sh --packages-only >"$bg_logs/torch2" 2>&1 &
torch2_pid=$!
bg_pids+=("$torch2_pid")
asan_pid=""
if [ "${GRADCOMP_SKIP_SANITIZE:-0}" != "1" ]; then
  (
    renice -n 19 -p "$BASHPID" >/dev/null
    bash scripts/sanitize.sh --build-only
    echo ok >"$bg_logs/asan_built"  # (the first lane's shard of the Python step waits for it)
    bash scripts/sanitize.sh --cpp-only
    # the Python step tests the installed package too (test_bench_cli runs `python -m
    # gradcomp.bench` without PYTHONPATH): it waits for the wheel below
    while [ ! -e "$bg_logs/installed" ]; do sleep 2; done
    bash scripts/sanitize.sh --python-only --shard 2/2
  ) >"$bg_logs/asan" 2>&1 &
  asan_pid=$!
  bg_pids+=("$asan_pid")
fi
forget_bg() {  # $1 = pid of a background step that ended: never signalled again
  local p keep=()
  for p in "${bg_pids[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  bg_pids=("${keep[@]}")
}
# waits for a background step, prints its log, and fails with it
join_bg() {  # $1 = pid, $2 = log, $3 = what
  local rc=0
  wait "$1" || rc=$?
  forget_bg "$1"
  cat "$2"
  [ "$rc" = 0 ] || { echo "test: $3 failed (exit $rc)"; exit 1; }
}

build=${BUILD_DIR:-build-test}
# Without a GPU (CI) the CUDA sources need only compile: PTX alone (90-virtual: nvcc's front end
# and device compiler, no ptxas) took 38% less time than PTX and sm_90 code (quant_cuda.cu, 62.7
# against 38.6 s, 2026-11-28), and nothing here runs it. With a GPU, code for that GPU.
if [ -z "${CUDA_ARCHS:-}" ]; then
  CUDA_ARCHS=90-virtual
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    CUDA_ARCHS=native
  fi
fi
# The host C++ suites run once, in the sanitizer stage (ASan+UBSan, clang -O1): this Release tree
# builds the library, the CUDA sources and their suites, the bindings' wheel, benchmarks and
# examples, and runs the install, example and CLI tests; the Release library itself is what the
# Python suites test. Compiling and running the host suites here too cost about 300 and 100
# CPU-seconds of CI's 2 cores (bench/results/ci_full_2026-11-28.md). They build here when the
# sanitizer stage is skipped, and in a full run (GRADCOMP_CI_FULL=1).
host_suites=OFF
if [ "${GRADCOMP_SKIP_SANITIZE:-0}" = "1" ] || [ "${GRADCOMP_CI_FULL:-0}" = "1" ]; then
  host_suites=ON
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGRADCOMP_CCACHE="${GRADCOMP_CCACHE:-OFF}" -DGRADCOMP_CUDA="${GRADCOMP_CUDA:-AUTO}" \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" -DGRADCOMP_HOST_SUITES="$host_suites"
cmake --build "$build" -j "${JOBS:-2}"
# ctest and the wheel side by side: ctest's MPI and multi-rank suites wait on each other much of
# the time, and the wheel's compiles (mostly ccache hits) take that time.
ctest --test-dir "$build" --output-on-failure --timeout 900 -j "${JOBS:-2}" &
ctest_pid=$!
bg_pids+=("$ctest_pid")

# Python: pip install . into the venv (CPU-only extension here: the CUDA sources were compiled by
# the build above already), then pytest.
venv=${GRADCOMP_VENV:-.venv}
GRADCOMP_CUDA=OFF "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation .
echo ok >"$bg_logs/installed"  # (the sanitizer lane's Python step waits for it)
rc=0
wait "$ctest_pid" || rc=$?
forget_bg "$ctest_pid"
[ "$rc" = 0 ] || { echo "test: ctest failed (exit $rc)"; exit 1; }
echo "test: pytest on $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')"
# --durations: the slowest tests in the CI log, for keeping CI inside its time budget.
# --ci-stage=oldest: the torch-version-dependent files (the newest torch runs every file next);
# without the torch 2.x stage this is the only torch, and every file runs here. The sanitizer
# stage runs every file of "oldest" on this same torch (against the ASan build; ci_stages.py and
# test_ci_stages.py keep it a superset), so when it runs this stage is left out.
stage=(--ci-stage=oldest)
[ "${GRADCOMP_SKIP_TORCH2:-0}" = "1" ] && stage=()
if [ "${GRADCOMP_SKIP_SANITIZE:-0}" = "1" ] || [ "${GRADCOMP_SKIP_TORCH2:-0}" = "1" ] ||
   [ "${GRADCOMP_SANITIZE_PYTHON:-1}" = "0" ] || [ "${GRADCOMP_SKIP_PYTHON:-0}" = "1" ]; then
  (cd tests/python && "../../$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
    "${stage[@]}" .)
else
  echo "test: the torch 1.13 files (stage oldest) run in the sanitizer stage, on the same torch"
fi

# Every test file on the newest torch 2.x (the same extension build: gradcomp._C does not link
# libtorch), at nice 19 beside the sanitizer lane (see above).
join_bg "$torch2_pid" "$bg_logs/torch2" "the torch 2.x packages"
nice -n 19 bash scripts/test-torch2.sh --skip-packages

# The sanitizer lane: this lane takes the first half of its Python step once its ASan build is
# there (or the lane has ended without one: its log then says why), then its log and verdict.
if [ -n "$asan_pid" ]; then
  while [ ! -e "$bg_logs/asan_built" ] && kill -0 "$asan_pid" 2>/dev/null; do sleep 2; done
  if [ -e "$bg_logs/asan_built" ]; then  # (sanitize.sh itself honours GRADCOMP_SKIP_PYTHON)
    nice -n 19 bash scripts/sanitize.sh --python-only --shard 1/2 ||
      { echo "test: the sanitizer stage's Python shard 1/2 failed"; exit 1; }
  fi
  echo "test: waiting for the sanitizer lane"
  join_bg "$asan_pid" "$bg_logs/asan" "the sanitizer stage"
fi
