#!/usr/bin/env bash
# The GPU check (every CUDA kernel, NCCL and the CUDA hooks) in one command, for the lent GPU machine (no package registry there).
#
#   scripts/gpu_check.sh --prepare    here (Debian, packages installed by scripts/setup.sh): copies
#                                     GoogleTest, Google Benchmark and OpenBLAS/LAPACKE (headers,
#                                     libraries, CMake package files; about 53 MB) into
#                                     .gpu-deps/prefix, which git ignores, so that a device run can
#                                     carry it (carry: [".gpu-deps"])
#   scripts/gpu_check.sh OUT [COMMIT] there: configures with CUDA for the local GPU
#                                     (CUDA_ARCHS, default native) and NCCL from PyTorch's
#                                     nvidia-nccl wheel when the toolkit has none, builds, runs
#                                     every CUDA suite (ctest -L cuda), each CUDA test binary under
#                                     compute-sanitizer memcheck and racecheck, and the CUDA
#                                     benchmarks; writes a few files into OUT (env.txt, build.log,
#                                     ctest.log, sanitizer.log, bench_*.json/txt). COMMIT is
#                                     recorded in env.txt (the copy there may have no .git).
#
# Exit status: 0 when the build, ctest and every sanitizer run passed; the logs say what failed.
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
  for l in libopenblas.so.0 liblapacke.so.3 liblapack.so.3 libblas.so.3 libtmglib.so.3 \
           libgfortran.so.5 libquadmath.so.0; do
    cp -L "/usr/lib/x86_64-linux-gnu/$l" "$p/lib/"
  done
  ln -sf libopenblas.so.0 "$p/lib/libopenblas.so"
  ln -sf liblapacke.so.3 "$p/lib/liblapacke.so"
  du -sh .gpu-deps
  exit 0
fi

out=${1:?usage: scripts/gpu_check.sh OUT [COMMIT] | --prepare}
# the carried libraries' own dependencies (libgfortran for OpenBLAS) resolve through this
export LD_LIBRARY_PATH="$PWD/.gpu-deps/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${BUILD_DIR:-build-gpu}
status=0
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: ${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -2 || true
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' || true
  uptime
} > "$out/env.txt" 2>&1

# NCCL: the toolkit's if it has one, else the one PyTorch's wheels ship
nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' \
            2>/dev/null || true)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-native}" \
      -DCMAKE_PREFIX_PATH="$PWD/.gpu-deps/prefix" \
      ${nccl_root:+-DGRADCOMP_NCCL_ROOT="$nccl_root"} > "$out/build.log" 2>&1 || status=1
if [ $status -eq 0 ]; then
  cmake --build "$build" -j "${JOBS:-$(nproc)}" >> "$out/build.log" 2>&1 || status=1
fi
if [ $status -ne 0 ]; then
  echo "gpu_check: build failed, see $out/build.log"; tail -30 "$out/build.log"; exit 1
fi
echo "build ok" >> "$out/env.txt"

ctest --test-dir "$build" -L cuda --output-on-failure --timeout 600 > "$out/ctest.log" 2>&1 \
  || status=1
tail -15 "$out/ctest.log"

# every CUDA test binary under memcheck and racecheck (the CPU twins' comparisons included)
: > "$out/sanitizer.log"
for t in "$build"/tests/*/test_*cuda "$build"/tests/comm/test_comm_inprocess; do
  [ -x "$t" ] || continue
  for tool in memcheck racecheck; do
    echo "== $tool $(basename "$t")" >> "$out/sanitizer.log"
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$t" --gtest_brief=1 \
      >> "$out/sanitizer.log" 2>&1 || { status=1; echo "FAILED: $tool $(basename "$t")" >> "$out/sanitizer.log"; }
  done
done
grep -E '^== |FAILED|ERROR SUMMARY' "$out/sanitizer.log" | tail -30

for b in "$build"/bench/bench_*cuda; do
  [ -x "$b" ] || continue
  n=$(basename "$b")
  "$b" --benchmark_out="$out/$n.json" --benchmark_out_format=json > "$out/$n.txt" 2>&1 || status=1
done
echo "gpu_check: exit $status (logs in $out)"
exit $status
