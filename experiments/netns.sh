#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# An emulated cluster on one machine: NP network namespaces PFX0..PFX{NP-1}, rank i at
# 10.77.0.(i+1)/24 on interface gce<i>, all joined by veth links to a bridge in namespace PFXsw,
# every link limited to RATE in both directions (tc tbf). Latency is not added here: this
# machine's kernel has no netem, so the ranks add it in their process group
# (experiments/latency.py), where every method pays it alike.
# Only addresses inside the namespaces made here are used.
#
#   netns.sh up PFX NP RATE             (root)
#   netns.sh down PFX NP                removes them (missing ones are ignored)
set -euo pipefail
cmd=${1:?up or down}; PFX=${2:?prefix}; NP=${3:?ranks}
SW="${PFX}sw"
if [ "$cmd" = down ]; then
  for ((i = 0; i < NP; i++)); do ip netns del "${PFX}$i" 2>/dev/null || true; done
  ip netns del "$SW" 2>/dev/null || true
  exit 0
fi
[ "$cmd" = up ] || { echo "usage: $0 up PFX NP RATE | down PFX NP" >&2; exit 2; }
RATE=${4:?rate, e.g. 1gbit}
[ "$(id -u)" = 0 ] || { echo "netns.sh: needs root (network namespaces, tc)" >&2; exit 1; }
(( NP >= 1 && NP <= 8 )) || { echo "netns.sh: 1 to 8 ranks, got $NP" >&2; exit 2; }
ip netns add "$SW"
ip -n "$SW" link set lo up
ip -n "$SW" link add gcbr type bridge
ip -n "$SW" link set gcbr up
shape() {  # shape NS DEV: egress limited to RATE
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$RATE" burst 256kb latency 50ms
}
for ((i = 0; i < NP; i++)); do
  ns="${PFX}$i"
  ip netns add "$ns"
  ip -n "$SW" link add "gcp$i" type veth peer name "gce$i" netns "$ns"
  ip -n "$SW" link set "gcp$i" master gcbr up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "gce$i"
  ip -n "$ns" link set "gce$i" up
  shape "$ns" "gce$i"   # rank -> bridge
  shape "$SW" "gcp$i"   # bridge -> rank
done
