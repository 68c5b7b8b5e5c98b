// SPDX-License-Identifier: Apache-2.0
// The cost of one collective step on a link, for plans that choose between routes (top-k's sparse
// allgather or dense allreduce, its size exchange). measure_cost_model() (gradcomp/comm.hpp)
// fits it on a live communicator; plans only read it, so they need not know the engines.
#pragma once

namespace gradcomp {

/// Measured speed of a communicator, used by plans that choose between routes (top-k).
/// t(bytes) = latency_s + bytes / bandwidth_Bps for one collective step.
struct CostModel {
  double latency_s = 20e-6;
  double bandwidth_Bps = 5e9;  ///< bytes per second one rank sends
  /// Seconds to move `bytes` per rank in `rounds` latency-bound rounds.
  double seconds(double bytes, double rounds = 1.0) const {
    return rounds * latency_s + bytes / bandwidth_Bps;
  }
};

}  // namespace gradcomp
