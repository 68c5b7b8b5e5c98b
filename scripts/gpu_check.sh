#!/usr/bin/env bash
# The GPU check (every CUDA kernel, NCCL and the CUDA hooks) in one command, for the lent GPU machine (no package registry there).
#
#   scripts/gpu_check.sh --prepare    here (Debian, packages installed by scripts/setup.sh): copies
#                                     GoogleTest, Google Benchmark and OpenBLAS/LAPACKE (headers,
#                                     libraries, CMake package files; about 53 MB) into
#                                     .gpu-deps/prefix, which git ignores, so that a device run can
#                                     carry it (carry: [".gpu-deps"]); and builds the CUB top-k
#                                     anchor (bench/cub_topk_anchor.cu) against the headers of the
#                                     nvidia-cuda-cccl wheel (pip download) into .gpu-deps
#   scripts/gpu_check.sh OUT [COMMIT] there: configures with CUDA for the local GPU
#                                     (CUDA_ARCHS, default native; -lineinfo, so that the
#                                     sanitizers name source lines) and NCCL from PyTorch's
#                                     nvidia-nccl wheel when the toolkit has none, and the Python
#                                     extension when python3 has its headers and nanobind; builds;
#                                     then, each step bounded in time, in order of what matters
#                                     most: every CUDA suite (ctest -L cuda), the Python GPU tests
#                                     (tests/python/test_gpu.py: hooks on CUDA with NCCL, GradScaler,
#                                     checkpoints, FSDP2), the comparisons with PyTorch
#                                     (bench/gpu_bench.py), every CUDA test binary under
#                                     compute-sanitizer memcheck, racecheck on the binaries in
#                                     RACECHECK (default: the PowerSGD suite; "all" for every
#                                     one: the top-k suite alone takes minutes),
#                                     and the C++ CUDA benchmarks when BENCH_CPP=1. Files in OUT:
#                                     env.txt, build.log, ctest.log, pytest.log, gpu_bench.json/md,
#                                     sanitizer.log, bench_*.txt. COMMIT is recorded in env.txt (the
#                                     copy there may have no .git).
#
# STEPS (default all): a comma list of the steps to run after the build, for a short second call:
# ctest, multirank (tests/python/test_gpu_multirank.py: 2 and 4 ranks on the one GPU over gloo,
# every family, fp32 and bf16, overlap on and off, FSDP2; multirank.json has every case),
# overlap (bench/gpu_overlap.py: the hook's side stream against the submitting stream and
# PyTorch's fp16 hook, a profiler trace, CUDA graph capture), pytest (test_gpu.py), bench
# (bench/gpu_bench.py; BENCH_SECTIONS picks its sections), csan (the multi-rank hook test at 2
# ranks for CSAN_FAMILIES, default topk,quant, under TORCH_CUDA_SANITIZER=1), profile
# (bench/gpu_profile.py: device time per kernel of one encode), sanitizers (SANITIZE_BINS, a
# space list of test binary names, limits them), cub (CUB's DeviceTopK beside a copy, from
# .gpu-deps/cub_topk_anchor, which --prepare builds), cpp (the C++ CUDA benchmarks, also added by
# BENCH_CPP=1; CPP_FILTER is their --benchmark_filter); "all" is ctest, multirank, overlap,
# pytest, bench, csan, sanitizers and cub.
#
# Exit status: 0 when the build, ctest, the Python GPU tests, bench/gpu_bench.py and every
# sanitizer run passed; the logs say what failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  set -e
  p=.gpu-deps/prefix
  rm -rf .gpu-deps && mkdir -p "$p/include" "$p/lib/x86_64-linux-gnu/cmake"
  cp -r /usr/include/gtest /usr/include/gmock /usr/include/benchmark "$p/include/"
  cp -a /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a \
        /usr/lib/x86_64-linux-gnu/libbenchmark* "$p/lib/x86_64-linux-gnu/"
  cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/x86_64-linux-gnu/cmake/benchmark \
        "$p/lib/x86_64-linux-gnu/cmake/"
  # PowerSGD's CPU twin needs CBLAS + LAPACKE (OpenBLAS) and their runtime (gfortran)
  mkdir -p "$p/include/openblas" "$p/lib"
  cp /usr/include/x86_64-linux-gnu/openblas-pthread/*.h "$p/include/openblas/"
  cp /usr/include/lapack*.h "$p/include/"
  for l in libopenblas.so.0 liblapacke.so.3 libtmglib.so.3 libgfortran.so.5 libquadmath.so.0; do
    cp -L "/usr/lib/x86_64-linux-gnu/$l" "$p/lib/"
  done
  # LAPACKE's BLAS and LAPACK are OpenBLAS's own (it exports both): links instead of 7.7 MB of
  # copies keep the carry (the tree and .gpu-deps together) under the device tool's 64 MiB
  ln -sf libopenblas.so.0 "$p/lib/liblapack.so.3"
  ln -sf libopenblas.so.0 "$p/lib/libblas.so.3"
  ln -sf libopenblas.so.0 "$p/lib/libopenblas.so"
  ln -sf liblapacke.so.3 "$p/lib/liblapacke.so"
  # CUB's DeviceTopK, the speed anchor of bench/cub_topk_anchor.cu, is in CCCL 3.2 and newer;
  # CUDA 13.0's CCCL is older, so the anchor is compiled here against the headers of the
  # nvidia-cuda-cccl wheel (25 MB of headers would not fit the carry; the binary, 1.6 MB, does),
  # for sm_90 (the H100 and H200). CCCL_WHEEL_VERSION pins the wheel. Optional: without PyPI
  # (or nvcc) the anchor is left out and the device run's `cub` step is skipped.
  w=$(mktemp -d)
  if python3 -m pip download -q --no-deps -d "$w" \
       "nvidia-cuda-cccl${CCCL_WHEEL_VERSION:+==$CCCL_WHEEL_VERSION}" &&
     (cd "$w" && unzip -q ./*.whl 'nvidia/*/include/cccl/*') &&
     inc=$(dirname "$(ls -d "$w"/nvidia/*/include/cccl/cub)") &&
     /usr/local/cuda/bin/nvcc -std=c++17 -O3 -arch=sm_90 -I "$inc" bench/cub_topk_anchor.cu \
       -o .gpu-deps/cub_topk_anchor; then
    ls "$w"/*.whl | sed 's|.*/||' > .gpu-deps/cub_topk_anchor.txt
  else
    echo "gpu_check --prepare: the CUB anchor was not built (no nvidia-cuda-cccl wheel or nvcc)"
  fi
  rm -rf "$w"
  du -sh .gpu-deps
  exit 0
fi

out=${1:?usage: scripts/gpu_check.sh OUT [COMMIT] | --prepare}
commit=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# the carried libraries' own dependencies (libgfortran for OpenBLAS) resolve through this
export LD_LIBRARY_PATH="$PWD/.gpu-deps/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${BUILD_DIR:-build-gpu}
status=0
steps=",${STEPS:-all},"
want() { [[ $steps == *",$1,"* || ( $steps == *",all,"* && $1 != profile && $1 != cpp ) ]]; }
[ "${BENCH_CPP:-0}" = 1 ] && steps="$steps,cpp,"
stamp() { echo "$(date -u +%T) $*" | tee -a "$out/env.txt"; }
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $commit"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -2 || true
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' || true
  uptime
} > "$out/env.txt" 2>&1

# NCCL: the toolkit's if it has one, else the one PyTorch's wheels ship
nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' \
            2>/dev/null || true)
# the Python extension: only where python3 has its headers (and nanobind) to build against
python_ext=OFF
if python3 -c 'import os, sysconfig, nanobind; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null; then
  python_ext=ON
fi
stamp "python extension: $python_ext"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-native}" -DCMAKE_CUDA_FLAGS=-lineinfo \
      -DCMAKE_PREFIX_PATH="$PWD/.gpu-deps/prefix" -DGRADCOMP_BUILD_PYTHON=$python_ext \
      -DGRADCOMP_BUILD_TESTS=ON -DGRADCOMP_BUILD_BENCH=ON \
      -DPython_EXECUTABLE="$(command -v python3)" \
      ${nccl_root:+-DGRADCOMP_NCCL_ROOT="$nccl_root"} > "$out/build.log" 2>&1 || status=1
# outputs of an earlier build on a warm machine must not pass for this one's
rm -f "$build"/python_bindings/_C*.so "$build"/tests/*/test_*
if [ $status -eq 0 ]; then  # -k 0: one target that fails leaves the others built
  timeout 330 cmake --build "$build" -j "${JOBS:-$(nproc)}" -- -k 0 >> "$out/build.log" 2>&1 || status=1
fi
if [ ! -x "$build/tests/quant/test_quant_cuda" ]; then
  echo "gpu_check: build failed, see $out/build.log"; tail -30 "$out/build.log"; exit 1
fi
[ $status -eq 0 ] && stamp "build ok" || { stamp "build: some targets failed"; grep -m5 -B2 -A8 'FAILED:' "$out/build.log"; }

if want ctest; then
  timeout 120 ctest --test-dir "$build" -L cuda --output-on-failure --timeout 100 \
    > "$out/ctest.log" 2>&1 || status=1
  stamp "ctest: $(grep -E 'tests passed|tests failed' "$out/ctest.log")"
fi

# Python: the package from the source tree with the extension just built
so=$(ls "$build"/python_bindings/_C*.so 2>/dev/null | head -1)
if [ -n "$so" ]; then
  rm -rf "$build/pyroot" && mkdir -p "$build/pyroot"
  cp -r python_bindings/gradcomp "$build/pyroot/" && cp "$so" "$build/pyroot/gradcomp/"
  export PYTHONPATH="$PWD/$build/pyroot"
  opts=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 4")
  opts="$opts $(python3 -c 'import pytest_timeout' 2>/dev/null && echo "--timeout 150")"
  if want multirank; then
    rc=0
    (cd tests/python && GRADCOMP_TEST_REPORT="$out/multirank.json" timeout 240 python3 -m pytest \
       -q -rs -p no:cacheprovider test_gpu_multirank.py) > "$out/multirank.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || status=1
    stamp "multirank: $(tail -1 "$out/multirank.log")"
  fi
  if want overlap; then
    rc=0
    timeout 150 python3 bench/gpu_overlap.py --out "$out" > "$out/gpu_overlap.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || status=1
    stamp "gpu_overlap: exit $rc"; grep -E '^(ok|FAIL)|step ' "$out/gpu_overlap.log"
  fi
  if want pytest; then
    (cd tests/python && timeout 200 python3 -m pytest -q -rs -p no:cacheprovider $opts \
       test_gpu.py) > "$out/pytest.log" 2>&1 || status=1
    stamp "pytest test_gpu.py: $(tail -1 "$out/pytest.log")"
  fi
  if want bench; then
    rc=0
    timeout 150 python3 bench/gpu_bench.py --device cuda --out "$out" --commit "$commit" \
      --max-seconds 140 ${BENCH_SECTIONS:+--sections "$BENCH_SECTIONS"} \
      > "$out/gpu_bench.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || status=1
    stamp "gpu_bench: exit $rc"
  fi
  if want csan; then
    rc=0
    (cd tests/python && TORCH_CUDA_SANITIZER=1 GRADCOMP_TEST_FAMILIES="${CSAN_FAMILIES:-topk,quant}" \
       timeout 150 python3 -m pytest -q -rs -p no:cacheprovider test_gpu_multirank.py \
       -k "family and 2") > "$out/csan.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || status=1
    stamp "csan (TORCH_CUDA_SANITIZER=1, multi-rank hooks): $(tail -1 "$out/csan.log")"
  fi
  if want profile; then
    rc=0
    timeout 120 python3 bench/gpu_profile.py --out "$out" > "$out/gpu_profile.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || status=1
    stamp "gpu_profile: exit $rc"
  fi
else
  stamp "no Python extension: Python tests and bench/gpu_bench.py not run"; status=1
fi

# every CUDA test binary under memcheck; racecheck (slow) on RACECHECK's. Not the in-process
# suite by default: its ranks are host threads that launch concurrently, which racecheck cannot
# follow ("Internal Sanitizer Error: Detected a failure to track a kernel launch"), and its
# slowdown then runs into the engine's 60 s collective timeout; memcheck follows it.
if want sanitizers; then
: > "$out/sanitizer.log"
race=${RACECHECK:-test_powersgd_cuda}
for t in "$build"/tests/*/test_*cuda "$build"/tests/comm/test_comm_nccl \
         "$build"/tests/comm/test_comm_inprocess; do
  [ -x "$t" ] || continue
  n=$(basename "$t")
  [ -z "${SANITIZE_BINS:-}" ] || [[ " $SANITIZE_BINS " == *" $n "* ]] || continue
  tools=memcheck
  case " $race " in *" $n "*|*" all "*) tools="memcheck racecheck" ;; esac
  # NCCL (PyTorch's wheel) asks cudaFuncGetAttributes about kernels it has no image for on this
  # device and handles the error itself; memcheck counts each such call as an error, so the
  # NCCL suite runs without API error reports (memory access errors are still reported)
  api=()
  [ "$n" = test_comm_nccl ] && api=(--report-api-errors no)
  for tool in $tools; do
    echo "== $tool $n" >> "$out/sanitizer.log"
    timeout 120 compute-sanitizer --tool "$tool" "${api[@]}" --error-exitcode 3 --print-limit 40 "$t" \
      --gtest_brief=1 >> "$out/sanitizer.log" 2>&1 \
      || { status=1; echo "FAILED: $tool $n" >> "$out/sanitizer.log"; }
  done
done
if [ -x "$build/tests/powersgd/test_powersgd_cuda" ]; then  # each hazard: threads, address
  echo "== racecheck (hazards) test_powersgd_cuda Orthogonalize" >> "$out/sanitizer.log"
  timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 \
    "$build/tests/powersgd/test_powersgd_cuda" --gtest_filter='*Orthogonalize*' \
    --gtest_brief=1 >> "$out/sanitizer.log" 2>&1 || true
fi
stamp "sanitizers: $(grep -c '^FAILED' "$out/sanitizer.log") failed runs"
grep -E '^== |FAILED|ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitizer.log" | tail -30
fi

if want cub && [ -x .gpu-deps/cub_topk_anchor ]; then
  rc=0
  timeout 90 .gpu-deps/cub_topk_anchor 25000000 110000000 > "$out/cub_topk.json" 2>&1 || rc=$?
  [ $rc -eq 0 ] || status=1
  stamp "cub DeviceTopK anchor ($(cat .gpu-deps/cub_topk_anchor.txt)): exit $rc"
  cat "$out/cub_topk.json"
fi

if want cpp; then
  for b in "$build"/bench/bench_*cuda; do
    [ -x "$b" ] || continue
    n=$(basename "$b")
    timeout 200 "$b" ${CPP_FILTER:+--benchmark_filter="$CPP_FILTER"} > "$out/$n.txt" 2>&1 \
      || status=1
  done
  stamp "C++ CUDA benchmarks done"
fi
stamp "gpu_check: exit $status"
exit $status
