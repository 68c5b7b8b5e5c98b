#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The sanitizer and fuzz stage of CI, run by scripts/test.sh unless
# GRADCOMP_SKIP_SANITIZE=1. Exits non-zero on any finding. Steps:
#  1. configure and build an ASan+UBSan tree with clang (-fno-sanitize-recover=all, libFuzzer
#     instrumentation, CPU only) in its own build directory;
#  2. ctest there: every C++ suite (the benchmarks are not built: the simulator CLI the tests
#     run is built with the tests),
#     with leak detection on and OpenMPI's own leaks suppressed by scripts/sanitizers/lsan.supp
#     (tests/sanitizers checks that file both ways);
#  3. every libFuzzer target of tests/fuzz for a bounded time on its committed seed corpus
#     (tests/fuzz/corpus/<target>; new inputs go to the build directory, never to the corpus);
#  4. the Python test files of the stage "asan" (tests/python/ci_stages.py: those that cross the
#     binding boundary or exercise C++ state) against the ASan build of the extension (see
#     below).
#
# Environment: ASAN_BUILD_DIR (default build-asan), JOBS (default 2: the build, ctest and the
# fuzzers run this many at a time), GRADCOMP_FUZZ_SECONDS (per target, default 10; 60 with
# GRADCOMP_CI_FULL=1),
# GRADCOMP_SANITIZE_PYTHON=0 to leave out step 4 (also left out with GRADCOMP_SKIP_PYTHON=1),
# GRADCOMP_CI_FULL=1 (or GRADCOMP_SANITIZE_PY_FULL=1) to run every Python test file in step 4,
# GRADCOMP_VENV (default .venv).
#
# Step 4, the Python suite under ASan: the interpreter is not instrumented, so the ASan runtime is
# LD_PRELOADed (clang's shared libclang_rt.asan, which also carries UBSan's handlers) and the
# extension built in step 1 (_C, instrumented, the runtime left undefined) is imported from a
# staging directory put first on PYTHONPATH; subprocesses (DDP ranks, the crash-case runners)
# inherit both. Leak detection is off for this step only (detect_leaks=0): the interpreter and
# the libraries it loads keep allocations until exit by design. Measured with the runtime
# preloaded: `python3 -c pass` alone ends with 6 leaked allocations, `import gradcomp` with 219
# (CPython and NumPy frames only), importing torch too with 25,606. They cannot be suppressed by
# library name either: every call into our extension has interpreter frames below it, so
# leak:python3 would hide our leaks as well. Our own code's leaks are
# covered by step 2 with detection on. Reports go to files (log_path) so that one from a
# subprocess whose exit status a test ignores is still seen. The training-accuracy and experiment
# runs are not in the stage: test_training_accuracy.py's Fashion-MNIST trainings alone took
# 5 min 40 s under ASan here (2 shared cores, load ~6), half of the whole suite's 10 min 50 s,
# through the same hooks and extension entry points as test_ddp_hooks.py, which is in it;
# tests/python/test_ci_stages.py checks that the stage still reaches every entry point.
#
# Usage: sanitize.sh [--build-only | --cpp-only | --python-only [--shard I/N]]: step 1 alone;
# steps 1-3; or step 1 (nothing to do on a built tree) and step 4. With --shard, step 4 runs
# shard I of N of its files (tests/python/ci_stages.py: about equal time each) and step 1 is left
# out: the tree must be built already (shards run side by side, and two builds of one tree at
# once would race). scripts/test.sh runs --build-only, --cpp-only and, once it has installed the
# wheel, --python-only --shard 2/2 in a lane of its own beside its other stages; its own lane runs
# shard 1/2 when its other stages are done.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=${1:-all}
case "$mode" in
  all|--build-only|--cpp-only|--python-only) ;;
  *) echo "sanitize: unknown argument $mode" >&2; exit 2 ;;
esac
shard=""
if [ $# -gt 1 ]; then
  [ "$mode" = "--python-only" ] && [ "${2:-}" = "--shard" ] && [[ "${3:-}" =~ ^[1-9][0-9]*/[1-9][0-9]*$ ]] && [ $# -eq 3 ] ||
    { echo "sanitize: usage: sanitize.sh [--build-only | --cpp-only | --python-only [--shard I/N]]" >&2; exit 2; }
  shard=$3
fi
[ -n "$shard" ] || bash scripts/setup.sh

build=${ASAN_BUILD_DIR:-build-asan}
jobs=${JOBS:-2}
fuzz_default=10  # CI time: the committed corpus replays whole either way; releases search longer
[ "${GRADCOMP_CI_FULL:-0}" = "1" ] && fuzz_default=60
fuzz_s=${GRADCOMP_FUZZ_SECONDS:-$fuzz_default}
venv=${GRADCOMP_VENV:-.venv}
python_step=1  # (the extension is built whenever step 4 is to run, in this call or a later one)
if [ "${GRADCOMP_SANITIZE_PYTHON:-1}" = "0" ] || [ "${GRADCOMP_SKIP_PYTHON:-0}" = "1" ]; then
  python_step=0
fi
t0=$(date +%s)
phase() { echo "sanitize: $1 ($(( $(date +%s) - t0 )) s)"; }

command -v clang++ >/dev/null || { echo "sanitize: clang++ not found (apt-get install clang)"; exit 1; }
asan_rt=$(clang++ -print-file-name=libclang_rt.asan-x86_64.so)
[ -f "$asan_rt" ] || { echo "sanitize: $asan_rt missing (apt-get install libclang-rt-14-dev)"; exit 1; }

# ---- 1. build ----
py_args=(-DGRADCOMP_BUILD_PYTHON=OFF)
if [ "$python_step" = 1 ]; then
  py_args=(-DGRADCOMP_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$root/$venv/bin/python")
fi
if [ -z "$shard" ]; then
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DGRADCOMP_SANITIZE=address,undefined -DGRADCOMP_FUZZ=ON -DGRADCOMP_CUDA=OFF \
  -DGRADCOMP_BUILD_BENCH=OFF "${py_args[@]}" >/dev/null
cmake --build "$build" -j "$jobs"
phase "built $build"
fi
[ "$mode" = "--build-only" ] && exit 0

if [ "$mode" != "--python-only" ]; then
# ---- 2. the C++ suites ----
# The tests that run OpenMPI set fast_unwind_on_malloc=0 themselves (GRADCOMP_MPI_TEST_ENV in
# CMakeLists.txt): OpenMPI has no frame pointers, its leak stacks are only complete (and matched
# by the suppression file) with the slow unwinder, which makes every other test 50% slower.
export ASAN_OPTIONS=detect_leaks=1
export LSAN_OPTIONS="suppressions=$root/scripts/sanitizers/lsan.supp"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$build" --output-on-failure --timeout 900 -j "$jobs"
phase "ctest passed"

# ---- 3. fuzzers: each target for fuzz_s seconds on its committed corpus, JOBS at a time ----
targets=()
for d in tests/fuzz/corpus/*/; do targets+=("$(basename "$d")"); done
for f in "$build"/tests/fuzz/fuzz_*; do  # a target without a corpus is an error
  [ -x "$f" ] && [ -d "tests/fuzz/corpus/$(basename "$f")" ] ||
    { echo "sanitize: $f has no tests/fuzz/corpus/$(basename "$f")"; exit 1; }
done
fuzzdir=$build/fuzz-run
rm -rf "$fuzzdir"
mkdir -p "$fuzzdir"
run_fuzzer() {  # $1 = target; status in $fuzzdir/$1.rc, output in $fuzzdir/$1.log
  local t=$1
  mkdir -p "$fuzzdir/$t.new"
  ASAN_OPTIONS=detect_leaks=1 "$build/tests/fuzz/$t" -max_total_time="$fuzz_s" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$fuzzdir/$t-" \
    "$fuzzdir/$t.new" "tests/fuzz/corpus/$t" >"$fuzzdir/$t.log" 2>&1
  echo $? >"$fuzzdir/$t.rc"
}
export -f run_fuzzer
export build fuzzdir fuzz_s
printf '%s\n' "${targets[@]}" | xargs -P "$jobs" -I{} bash -c 'run_fuzzer "$@" || true' _ {}
fuzz_bad=0
for t in "${targets[@]}"; do
  rc=$(cat "$fuzzdir/$t.rc" 2>/dev/null || echo missing)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$fuzzdir/$t.log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$fuzzdir/$t.log")
  echo "sanitize: fuzz $t: rc=$rc, ${execs:-?} runs, ${rate:-?} exec/s"
  if [ "$rc" != 0 ]; then
    fuzz_bad=1
    tail -n 60 "$fuzzdir/$t.log"
    ls "$fuzzdir/$t"-* 2>/dev/null || true
  fi
done
[ "$fuzz_bad" = 0 ] || { echo "sanitize: fuzzer finding (inputs above, logs in $fuzzdir)"; exit 1; }
phase "fuzzers clean (${#targets[@]} targets x ${fuzz_s} s)"
fi
[ "$mode" = "--cpp-only" ] && python_step=0

# ---- 4. the Python suite against the ASan extension ----
if [ "$python_step" = 1 ]; then
  sfx=""  # (each shard its own staging and report directories: shards run side by side)
  [ -n "$shard" ] && sfx="-shard${shard%/*}of${shard#*/}"
  pkg=$build/pypkg$sfx
  rm -rf "$pkg"
  mkdir -p "$pkg"
  cp -r python_bindings/gradcomp "$pkg/"
  find "$pkg" -name __pycache__ -prune -exec rm -rf {} +
  so=$(ls "$build"/python_bindings/_C.*.so 2>/dev/null) ||
    { echo "sanitize: no ASan extension in $build (a --shard run needs the tree built first)"; exit 1; }
  cp "$so" "$pkg/gradcomp/"
  # (grep reads all of nm's output: with -q it could exit first and fail the pipe with SIGPIPE)
  nm -D --undefined-only "$so" | grep __asan_report >/dev/null ||
    { echo "sanitize: $so is not ASan-instrumented"; exit 1; }
  logs=$root/$build/py-sanitizer-logs$sfx
  rm -rf "$logs"
  mkdir -p "$logs"
  py_status=0
  (
    cd tests/python
    [ "${GRADCOMP_SANITIZE_PY_FULL:-0}" = "1" ] && export GRADCOMP_CI_FULL=1
    export LD_PRELOAD=$asan_rt PYTHONPATH=$root/$pkg
    export ASAN_OPTIONS=detect_leaks=0:log_path=$logs/report
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$logs/report
    "$root/$venv/bin/python" -c "import gradcomp, sys; f = gradcomp.__file__; \
sys.exit(0 if f.startswith('$root/$pkg/') else 'gradcomp imported from ' + f)"
    "$root/$venv/bin/python" -m pytest -q -p no:cacheprovider -rs --durations=10 \
      --ci-stage=asan ${shard:+--ci-shard=$shard} .
  ) || py_status=$?
  if compgen -G "$logs/report*" >/dev/null; then
    cat "$logs"/report*
    echo "sanitize: sanitizer report(s) from the Python suite (above, files in $logs)"
    exit 1
  fi
  [ "$py_status" = 0 ] || { echo "sanitize: Python suite failed under ASan"; exit 1; }
  phase "Python suite clean under ASan${shard:+ (shard $shard)}"
fi

phase "done, no findings"
