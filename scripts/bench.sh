#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: builds gradcomp (Release; CUDA when nvcc is found) and runs the microbenchmarks,
# printing a table of time, bandwidth (bytes_per_second, frac_of_copy) and compression_ratio.
# Usage: scripts/bench.sh [benchmark regex]    e.g. scripts/bench.sh 'topk.*n:25000000/'
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build=${BUILD_DIR:-build-bench}
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# With a GPU: CUDA for this GPU's architecture only. Without one the CUDA benchmarks cannot run,
# so the CPU-only build is made (much faster); GRADCOMP_CUDA=ON forces CUDA.
if [ -z "${GRADCOMP_CUDA:-}" ]; then
  if have_gpu; then
    GRADCOMP_CUDA=AUTO
    archs=${CUDA_ARCHS:-native}
  else
    GRADCOMP_CUDA=OFF
  fi
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_BUILD_TESTS=OFF \
  -DGRADCOMP_CUDA="$GRADCOMP_CUDA" ${archs:+-DCMAKE_CUDA_ARCHITECTURES="$archs"} >/dev/null
cmake --build "$build" -j "${JOBS:-2}"
filter=${1:-.}
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  if [[ "$b" == *cuda* ]] && ! have_gpu; then
    echo "== $(basename "$b"): skipped, no GPU"
    continue
  fi
  echo "== $(basename "$b")"
  "$b" --benchmark_filter="$filter" --benchmark_counters_tabular=true 2>&1 \
    | grep -v -e '^\*\*\*WARNING\*\*\* Library was built as DEBUG' || true
done
