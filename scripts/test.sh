#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The test command: installs what is missing, configures, builds (CUDA when nvcc is found, for one
# architecture to keep the build short), and runs every test: ctest, then the Python suite in
# three stages, each running the test files tests/python/ci_stages.py assigns to it (which and
# why: docs/DEVELOPMENT.md, "Which stage runs what"): on Debian's torch 1.13 (.venv, the oldest
# supported) the files whose code path depends on the torch version; on the newest torch 2.x
# from PyPI (scripts/test-torch2.sh: .venv-torch2, the same wheel) every file; and in the
# sanitizer stage (scripts/sanitize.sh: ASan+UBSan suites, bounded fuzzing) the files that cross
# the binding boundary, against the ASan build of the extension.
# Environment: BUILD_DIR (default build-test), GRADCOMP_CUDA (AUTO/ON/OFF), CUDA_ARCHS (default
# 90), JOBS (default 2), GRADCOMP_CI_FULL=1 (every Python test file in every stage: for
# releases), GRADCOMP_SKIP_TORCH2=1 (skip the torch 2.x stage, which downloads about 3 GB once,
# cached in GRADCOMP_WHEELHOUSE, default ~/.cache/gradcomp/wheelhouse; torch 1.13 then runs every
# file), GRADCOMP_SKIP_SANITIZE=1 (skip the sanitizer stage).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# The torch 2.x packages (about 3 GB to download and unpack) are made ready in the background
# while the C++ build runs; its log is printed when the torch 2.x stage needs them.
# The sanitizer build (scripts/sanitize.sh --build-only) starts now too, at the lowest priority:
# it takes the CPU the other stages leave idle (the Python stages wait on their ranks' start-up
# and collectives about a quarter of the time) and costs them little, and the sanitizer stage
# then finds most of its tree built.
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
  nice -n 19 bash scripts/sanitize.sh --build-only >"$bg_logs/asan" 2>&1 &
  asan_pid=$!
  bg_pids+=("$asan_pid")
fi
# waits for a background step, prints its log, and fails with it
join_bg() {  # $1 = pid, $2 = log, $3 = what
  local rc=0 p keep=()
  wait "$1" || rc=$?
  for p in "${bg_pids[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
  bg_pids=("${keep[@]}")  # (ended: never signalled again)
  cat "$2"
  [ "$rc" = 0 ] || { echo "test: $3 failed (exit $rc)"; exit 1; }
}

build=${BUILD_DIR:-build-test}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGRADCOMP_CUDA="${GRADCOMP_CUDA:-AUTO}" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}"
cmake --build "$build" -j "${JOBS:-2}"
ctest --test-dir "$build" --output-on-failure --timeout 900 -j "${JOBS:-2}"

# Python: pip install . into the venv (CPU-only extension here: the CUDA sources were compiled by
# the build above already), then pytest.
venv=${GRADCOMP_VENV:-.venv}
GRADCOMP_CUDA=OFF "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation .
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
# libtorch).
join_bg "$torch2_pid" "$bg_logs/torch2" "the torch 2.x packages"
bash scripts/test-torch2.sh --skip-packages

# Sanitizers and fuzzing, in their own build tree (build-asan); see scripts/sanitize.sh.
if [ -n "$asan_pid" ]; then
  join_bg "$asan_pid" "$bg_logs/asan" "the sanitizer build"
  bash scripts/sanitize.sh
fi
