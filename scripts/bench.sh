#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: builds gradcomp (Release; CUDA when a GPU is found) and runs the microbenchmarks.
# The full Google Benchmark tables go to files under a dated folder, bench/results/<date>-<commit>/
# (bench_*.txt as printed, bench_*.json); the terminal shows one summary table per compressor and
# gradient size (compression ratio, encode/decode time and GB/s, speedup over the baseline in the
# same binary, fraction of memcpy, compressed-allreduce step time), which is also written there
# as summary.md / summary.csv, with summary.png (compression ratio vs encode throughput).
#
# bench_comm runs with GRADCOMP_BENCH_RANKS MPI ranks (default 4) on this machine, over TCP on
# the loopback interface (mpirun --oversubscribe), so its speedups over plain allreduce include
# real transfers; with GRADCOMP_BENCH_RANKS=1, or without mpirun, it runs one rank and the summary
# says that one rank measures no communication.
#
# Usage: scripts/bench.sh [-v] [benchmark regex]   e.g. scripts/bench.sh 'topk.*n:25000000/'
#   -v: also print the full tables on the terminal.
# Environment: BUILD_DIR (default build-bench), GRADCOMP_CUDA, CUDA_ARCHS, JOBS (default 2),
# GRADCOMP_BENCH_OUT (the results folder), GRADCOMP_BENCH_RANKS (default 4),
# GC_BENCH_NUMEL / GC_BENCH_ITERS (bench_comm's gradient size and timed steps).
set -euo pipefail
cd "$(dirname "$0")/.."
argv=("$@")
verbose=0
if [ "${1:-}" = "-v" ]; then
  verbose=1
  shift
fi
filter=${1:-.}
bash scripts/setup.sh >/dev/null
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
echo "bench: building $build"
if ! cmake --build "$build" -j "${JOBS:-2}" >"$build/bench-build.log" 2>&1; then
  tail -40 "$build/bench-build.log" >&2
  echo "bench: build failed (log: $build/bench-build.log)" >&2
  exit 1
fi

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=""
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  dirty="-dirty"
fi
day=$(date +%F)
out=${GRADCOMP_BENCH_OUT:-bench/results/$day-$commit$dirty}
mkdir -p "$out"
ranks=${GRADCOMP_BENCH_RANKS:-4}
command -v mpirun >/dev/null 2>&1 || ranks=1
cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //' || true)
machine="$(nproc)-core ${cpu:-$(uname -m)}, $(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}')"
load_before=$(uptime | sed 's/^ *//')
py=/usr/bin/python3  # Debian's: sees python3-matplotlib (setup.sh)
json_str() { "$py" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }
t0=$SECONDS
failed=()  # binaries that failed: the summary is still made from the others

# run NAME [launcher...]: one binary, its tables to $out/NAME.txt and $out/NAME.json
run() {
  local name=$1
  shift
  local b="$build/bench/$name"
  local s=$SECONDS
  echo "bench: $name -> $out/$name.txt"
  if ((verbose)); then
    "$@" "$b" --benchmark_filter="$filter" --benchmark_counters_tabular=true \
      --benchmark_out="$out/$name.json" --benchmark_out_format=json --benchmark_color=false 2>&1 | tee "$out/$name.txt"
  else
    "$@" "$b" --benchmark_filter="$filter" --benchmark_counters_tabular=true \
      --benchmark_out="$out/$name.json" --benchmark_out_format=json --benchmark_color=false \
      >"$out/$name.txt" 2>&1
  fi || { echo "bench: $name failed, see $out/$name.txt" >&2; tail -5 "$out/$name.txt" >&2; return 1; }
  echo "bench: $name done in $((SECONDS - s)) s"
}

for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  [ "$name" = bench_comm ] && continue
  if [[ "$name" == *cuda* ]] && ! have_gpu; then
    echo "bench: $name skipped, no GPU"
    continue
  fi
  if [ "$name" = bench_powersgd ]; then
    # One thread for ours and for the baseline: with its own pthread pool, OpenBLAS's spinning
    # threads slow the baseline's element-wise passes on a small machine, which flatters ours
    # (see bench/bench_powersgd.cpp); single-threaded, the speedup is the step structure's alone.
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 run "$name" || failed+=("$name")
  else
    run "$name" || failed+=("$name")
  fi
done

# The communication benchmark: P ranks on this machine, TCP over the loopback interface (not
# shared memory), one OpenMP thread per rank.
transport="one rank: no communication"
if [ -x "$build/bench/bench_comm" ]; then
  if ((ranks > 1)); then
    transport="$ranks MPI ranks, TCP over loopback (lo)"
    mpi=(mpirun -np "$ranks" --oversubscribe --mca pml ob1 --mca btl self,tcp
         --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)
    [ "$(id -u)" -ne 0 ] || mpi+=(--allow-run-as-root)
    OMP_NUM_THREADS=1 run bench_comm "${mpi[@]}" || failed+=(bench_comm)
  else
    echo "bench: bench_comm with ONE rank: nothing is communicated; its times are local work only"
    OMP_NUM_THREADS=1 run bench_comm || failed+=(bench_comm)
  fi
fi

cat >"$out/run.json" <<EOF
{
  "date": "$(date '+%F %T %Z')",
  "commit": "$commit$dirty",
  "command": $("$py" -c 'import json, shlex, sys; print(json.dumps(shlex.join(sys.argv[1:])))' \
    scripts/bench.sh "${argv[@]}"),
  "machine": $(json_str "$machine"),
  "load_before": $(json_str "$load_before"),
  "load_after": $(json_str "$(uptime | sed 's/^ *//')"),
  "omp_threads": "${OMP_NUM_THREADS:-all cores}; bench_powersgd: 1 (OpenMP and OpenBLAS, ours and the baseline alike); bench_comm: 1 per rank",
  "comm_transport": $(json_str "$transport"),
  "seconds": $((SECONDS - t0))
}
EOF
echo "bench: all tables in $out ($((SECONDS - t0)) s)"
echo
"$py" bench/summarize.py "$out"
if ((${#failed[@]})); then
  echo "bench: FAILED: ${failed[*]} (their output is in $out)" >&2
  exit 1
fi
