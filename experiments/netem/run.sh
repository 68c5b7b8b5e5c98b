#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the 4-rank comm benchmark (bench_comm) with every rank in its own network namespace
# (experiments/netns.sh: veth links to a bridge, every link limited to RATE, default 1gbit, in
# both directions with tc tbf). OpenMPI runs over TCP on those links only (btl tcp,self;
# btl/oob_tcp_if_include 10.77.0.0/24); mpirun starts the remote daemons through an rsh agent
# that enters the namespace of the "host" (ip netns exec). Only addresses 10.77.0.1-4, inside
# namespaces this script creates, are used; everything is removed on exit.
#
# Usage (root):  experiments/netem/run.sh [build_dir]      env: RATE, NP (<= 8), GC_BENCH_NUMEL,
#                                                    GC_BENCH_ITERS
# No added latency: this machine's kernel has no netem, and the latency emulation of the
# experiments lives in a torch process group (experiments/latency.py), which MPI does
# not use.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
BENCH=$(readlink -f "$BUILD/bench/bench_comm")
RATE=${RATE:-1gbit}
NP=${NP:-4}
[ -x "$BENCH" ] || { echo "no $BENCH: build the benchmarks first" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, tc)" >&2; exit 1; }

PFX="gcn$$"            # namespace prefix, unique per run
TMP=$(mktemp -d)
cleanup() {
  set +e
  experiments/netns.sh down "$PFX" "$NP"
  rm -rf "$TMP"
}
trap cleanup EXIT INT TERM

experiments/netns.sh up "$PFX" "$NP" "$RATE"
: > "$TMP/hosts"
for ((i = 0; i < NP; i++)); do echo "10.77.0.$((i + 1)) slots=1" >> "$TMP/hosts"; done

# rsh agent: "agent HOST cmd..." runs cmd in the namespace that owns HOST (with its own hostname)
cat > "$TMP/agent" <<AGENT
#!/usr/bin/env bash
host=\$1; shift
while [[ \$1 == -* ]]; do shift; done
i=\$(( \${host##*.} - 1 ))
exec ip netns exec ${PFX}\$i unshare --uts /bin/sh -c "hostname gcnode\$i; \$*"
AGENT
chmod +x "$TMP/agent"

echo "== $NP ranks in namespaces ${PFX}0..$((NP - 1)), links $RATE${DELAY:+, delay $DELAY}"
ip netns exec "${PFX}0" unshare --uts /bin/sh -c "hostname gcnode0; \
  OMP_NUM_THREADS=\${OMP_NUM_THREADS:-1} mpirun --allow-run-as-root --oversubscribe -np $NP \
  --hostfile $TMP/hosts --mca plm_rsh_agent $TMP/agent --mca plm_rsh_no_tree_spawn 1 \
  --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
  -x OMP_NUM_THREADS -x GC_BENCH_NUMEL -x GC_BENCH_ITERS \
  $BENCH --benchmark_counters_tabular=true"
