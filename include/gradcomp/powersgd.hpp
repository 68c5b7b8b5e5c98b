// SPDX-License-Identifier: Apache-2.0
// PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1) for one gradient bucket, with every option of
// PyTorch's powerSGD_hook, as a comm plan.
//
// Per matrix M (a tensor viewed as shape[0] x rest, n x m), rank r:
//   M = grad + error                          (error feedback; M = grad without it)
//   P = M Q                 -> allreduce(P)   (Q: warm-started, or re-drawn each step)
//   P_hat = orth(P_sum / world)
//   Q = M^T P_hat           -> allreduce(Q)
//   Q = Q_sum / world;  result = P_hat Q^T;  error = M - result;  grad = result
// 1-D tensors and tensors that fail the rate test ((n + m) r * min_compression_rate < n m) are
// packed into ONE fp32 buffer and averaged exactly, so a bucket needs at most three collectives
// (uncompressed, P, Q), two by default (uncompressed and P share one allreduce).
//
// Where the division by world happens (every rank then computes bitwise the same result): each
// summed buffer is divided element-wise by float(world) (IEEE division, not a reciprocal multiply)
// right after its allreduce, before anything else reads it: P_sum / world before
// orthogonalization, Q_sum / world before the reconstruction, uncompressed_sum / world before it is
// written back. All later local work is a deterministic function of these identical buffers.
//
// Example (one rank of a data-parallel job; a driver executes the plan's collectives):
//   gradcomp::PowerSGDConfig cfg;
//   cfg.rank = 4;
//   gradcomp::PowerSGDState state(cfg, {{256, 128, 3, 3}, {256}, {1000, 2048}});
//   gradcomp::PowerSGDPlan plan(state, world_size);
//   plan.begin({w_grad, b_grad, fc_grad});         // TensorViews of the gradients
//   while (auto c = plan.next()) driver.run(*c);   // gradients now hold the averaged result
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/orthogonalization.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp {

/// At most this many elements in one bucket (2^32: 16 GiB of fp32 in each per-bucket buffer;
/// every dimension is bounded by it too). Larger shapes, and shapes whose element count overflows
/// int64, are an InvalidArgument from the PowerSGDState constructor before anything is allocated.
/// Within the bound, memory the machine cannot provide is std::bad_alloc (Python: MemoryError).
inline constexpr int64_t kPowerSGDMaxBucketNumel = int64_t{1} << 32;

struct PowerSGDConfig {
  /// Target rank r (PyTorch: matrix_approximation_rank), >= 1. A tensor whose matrix view has
  /// min(n, m) < r is compressed at rank min(n, m) (clamped, reported in the statistics).
  int rank = 1;
  /// Steps [0, start_iter) do a plain (exact) allreduce of the whole bucket, no error feedback
  /// (PyTorch: start_powerSGD_iter; its default 1000 is meant for real training, ours is 0).
  int64_t start_iter = 0;
  /// A matrix is compressed only if (n + m) r * min_compression_rate < n m (PyTorch's test).
  double min_compression_rate = 2.0;
  bool error_feedback = true;  ///< keep error = M - result for compressed tensors
  bool warm_start = true;      ///< keep Q between steps (else re-draw it every step)
  /// Added to column norms before dividing (PyTorch's orthogonalization_epsilon). Columns that
  /// are numerically zero (norm <= 1e-4 x their norm before projection, or exactly 0) become zero
  /// columns whatever epsilon is: never NaN.
  float orthogonalization_epsilon = 0.0f;
  uint64_t seed = 0;             ///< keys the initial Q: identical on every rank, CPU and CUDA
  uint32_t first_tensor_id = 0;  ///< tensor i of the bucket uses RNG tensor id first_tensor_id + i
  Orthogonalization orthogonalization = Orthogonalization::kAuto;
  /// Send the uncompressed pack and P in one allreduce (2 collectives per step instead of 3).
  bool fuse_uncompressed_with_p = true;
  /// Find a gradient holding NaN/Inf and skip (or raise on) the step on every rank, error, Q and
  /// step as they were (OnNonFinite, gradcomp/plan.hpp). The test rides on P and the
  /// uncompressed pack in the first next() phase (a finite gradient whose P overflows counts as
  /// bad too; CUDA also scans the bucket in begin()); the bucket is scanned only to name the
  /// index. The bad rank sends NaN in place of P (and the pack); every rank scans the reduced P
  /// (small), which also catches a sum over ranks that overflows. The error and Q are saved
  /// before each step (a copy of the error: one read and one write of it, and its size in
  /// memory), so that a skipped step on CUDA, and undo_step() anywhere, restore them. Off: a
  /// NaN/Inf enters the error and Q and stays there.
  bool check_finite = true;
  void validate() const;
};

/// What happened to the bucket in its last step.
struct PowerSGDStats {
  int64_t step = -1;           ///< step index (0-based) of the last completed step
  bool compressed = false;     ///< false for the plain allreduce steps before start_iter
  uint64_t dense_bytes = 0;    ///< sum of numel * dtype size of the bucket's gradients
  uint64_t sent_bytes = 0;     ///< bytes this rank sent in the step's collectives (fp32)
  int collectives = 0;         ///< number of collectives of the step
  std::vector<int> rank_used;  ///< per tensor: rank used, 0 = sent uncompressed
  double compression_ratio() const {
    return sent_bytes ? static_cast<double>(dense_bytes) / static_cast<double>(sent_bytes) : 0.0;
  }
};

/// Bucket layout: how each tensor is handled (fixed at construction).
struct PowerSGDTensorInfo {
  int64_t n = 0, m = 0;  ///< matrix view shape[0] x rest (1-D: numel x 1)
  int rank = 0;          ///< rank used, 0 = uncompressed
  int group = -1;        ///< batch group (same n, m, rank) of a compressed tensor
  int64_t m_offset = 0;  ///< offset (elements) of its M / error block (compressed)
  int64_t p_offset = 0;  ///< offset of its P block in the P buffer (compressed)
  int64_t q_offset = 0;  ///< offset of its Q block (compressed)
  int64_t u_offset = 0;  ///< offset in the uncompressed pack (uncompressed)
};

/// The state of PowerSGD for one bucket on one rank: error, Q, step, workspaces. Not thread-safe.
///
/// Example:  gradcomp::PowerSGDState st(cfg, {{64, 32}, {64}}, gradcomp::DType::kFloat32);
///           auto bytes = st.state_dict();   // error, Q, step
class PowerSGDState {
 public:
  PowerSGDState(const PowerSGDConfig& cfg, const std::vector<std::vector<int64_t>>& shapes,
                DType grad_dtype = DType::kFloat32, Device device = Device::kCPU,
                int device_index = 0, void* stream = nullptr);
  ~PowerSGDState();
  PowerSGDState(const PowerSGDState&) = delete;
  PowerSGDState& operator=(const PowerSGDState&) = delete;

  const PowerSGDConfig& config() const { return cfg_; }
  int64_t step() const { return step_; }
  Device device() const { return device_; }
  DType grad_dtype() const { return dtype_; }
  size_t num_tensors() const { return info_.size(); }
  const PowerSGDTensorInfo& tensor(size_t i) const { return info_.at(i); }
  /// Number of batch groups (distinct (n, m, rank) among compressed tensors).
  size_t num_groups() const;
  int64_t compressed_numel() const { return m_numel_; }
  int64_t uncompressed_numel() const { return u_numel_; }
  int64_t p_numel() const { return p_numel_; }
  int64_t q_numel() const { return q_numel_; }
  const PowerSGDStats& last_stats() const { return stats_; }

  /// Copies tensor i's error (n x m fp32, zeros for uncompressed tensors or without error
  /// feedback) / its current Q (m x r fp32; empty before the first compressed step) to the host.
  std::vector<float> error(size_t i) const;
  std::vector<float> q(size_t i) const;

  /// Serialised state: layout fingerprint, step, whether Q exists, error, Q.
  std::vector<uint8_t> state_dict() const;
  /// Restores state_dict(); on a layout mismatch throws InvalidArgument and changes nothing.
  void load_state_dict(const uint8_t* data, size_t nbytes);

  struct Impl;

 private:
  friend class PowerSGDPlan;
  PowerSGDConfig cfg_;
  DType dtype_;
  Device device_;
  int device_index_;
  std::vector<PowerSGDTensorInfo> info_;
  int64_t m_numel_ = 0, u_numel_ = 0, p_numel_ = 0, q_numel_ = 0;
  int64_t step_ = 0;
  bool q_ready_ = false;
  PowerSGDStats stats_;
  std::unique_ptr<Impl> impl_;
};

// The PowerSGD bucket plan (PowerSGDPlan) is private to the library (plans/powersgd_plan.hpp):
// make_plan("powersgd", ...) builds it.

}  // namespace gradcomp
