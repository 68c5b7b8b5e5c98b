// SPDX-License-Identifier: Apache-2.0
// Top-k / DGC allreduce plan: encode, size exchange, then the sparse allgather or the densified
// allreduce chosen by the cost model.
#include <algorithm>
#include <cstring>

#include "gradcomp/error.hpp"
#include "gradcomp/plans.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce.hpp"
#include "plans/per_rank.hpp"

namespace gradcomp {

namespace k = kernels;

TopKAllreducePlan::TopKAllreducePlan(const TopKConfig& cfg, int64_t numel, int world,
                                     const TopKPlanOptions& opt, DType grad_dtype, Device device,
                                     int device_index, void* stream)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      comp_(detail::per_rank(cfg, world), numel, grad_dtype, device, device_index, stream),
      opt_(opt),
      payload_(device),
      sizes_(device, stream),
      gathered_(device, stream),
      acc_(device, stream),
      host_sizes_(2 * static_cast<size_t>(world) + 2) {
  GC_CHECK_ARG(opt.cost.bandwidth_Bps > 0 && opt.cost.latency_s >= 0,
               "TopKAllreducePlan: cost model needs bandwidth > 0 and latency >= 0, got ",
               opt.cost.bandwidth_Bps, " B/s and ", opt.cost.latency_s, " s");
  payload_.bytes.set_stream(stream);
  // Reserve the worst case once (largest k over the warm-up schedule, index section at most
  // min(raw, bitmap)), so that no step allocates.
  double ratio = cfg.ratio;
  for (double r : cfg.warmup_ratios) ratio = std::max(ratio, r);
  const auto kmax = static_cast<uint64_t>(topk_count(ratio, numel));
  const uint64_t idx = std::min<uint64_t>(4 * kmax, (static_cast<uint64_t>(numel) + 7) / 8);
  const uint64_t most = sizeof(PayloadHeader) + PayloadHeader::align(idx) +
                        PayloadHeader::align(kmax * dtype_size(cfg.value_dtype));
  payload_.bytes.reserve(most);
  gathered_.reserve(most * static_cast<uint64_t>(world));
  if (grad_dtype != DType::kFloat32) acc_.reserve(static_cast<size_t>(numel) * sizeof(float));
  sizes_.reserve((2 * static_cast<size_t>(world) + 2) * sizeof(int64_t));
}

float* TopKAllreducePlan::target() {
  if (dtype_ == DType::kFloat32) return static_cast<float*>(grad_.data);
  return acc_.get<float>(static_cast<size_t>(numel_));
}

void TopKAllreducePlan::finish() {
  if (dtype_ != DType::kFloat32)
    k::convert(device_, acc_.data(), DType::kFloat32, grad_.data, dtype_, numel_, 1.0f, stream_);
}

size_t TopKAllreducePlan::workspace_bytes() const {
  return payload_.bytes.capacity() + sizes_.capacity() + gathered_.capacity() + acc_.capacity();
}

TopKRoute TopKAllreducePlan::choose(uint64_t max_payload_bytes) const {
  if (opt_.route != TopKRoute::kAuto) return opt_.route;
  const double P = world_;
  if (world_ == 1) return TopKRoute::kSparse;
  const double sparse = opt_.cost.seconds(double(max_payload_bytes) * (P - 1), P - 1);
  const double dense =
      opt_.cost.seconds(2.0 * double(numel_) * sizeof(float) * (P - 1) / P, 2 * (P - 1));
  return dense < sparse ? TopKRoute::kDense : TopKRoute::kSparse;
}

std::optional<Collective> TopKAllreducePlan::next() {
  require_begun();
  const auto P = static_cast<size_t>(world_);
  const auto n = static_cast<size_t>(numel_);
  switch (phase_) {
    case 0: {  // encode, then exchange (numel, payload bytes)
      comp_.encode(grad_, payload_);
      host_sizes_[2 * P] = numel_;
      host_sizes_[2 * P + 1] = static_cast<int64_t>(payload_.size());
      auto* d = sizes_.get<int64_t>(2 * P + 2);
      device_copy(d + 2 * P, device_, &host_sizes_[2 * P], Device::kCPU, 2 * sizeof(int64_t),
                  stream_);
      phase_ = 1;
      return make(CollectiveKind::kAllgather, ElemType::kI64, d + 2 * P, d, 2, "topk sizes");
    }
    case 1: {  // check sizes, choose the route
      device_copy(host_sizes_.data(), Device::kCPU, sizes_.data(), device_, 2 * P * sizeof(int64_t),
                  stream_);
      if (device_ == Device::kCUDA) cuda::stream_synchronize(stream_);
      uint64_t longest = 0, total = 0;
      for (size_t r = 0; r < P; ++r) {
        GC_CHECK_ARG(host_sizes_[2 * r] == host_sizes_[0],
                     "plan 'topk': bucket sizes differ across ranks: rank 0 has ", host_sizes_[0],
                     " elements, rank ", r, " has ", host_sizes_[2 * r]);
        const auto b = static_cast<uint64_t>(host_sizes_[2 * r + 1]);
        GC_CHECK_ARG(b >= sizeof(PayloadHeader), "plan 'topk': rank ", r,
                     " announced a payload of ", b, " bytes (less than a header)");
        longest = std::max(longest, b);
        total += b;
      }
      stats_.last_max_payload = longest;
      stats_.last_total_payload = total;
      {  // the model's estimates, for the statistics
        const double Pd = world_;
        stats_.last_sparse_cost_s = opt_.cost.seconds(double(longest) * (Pd - 1), Pd - 1);
        stats_.last_dense_cost_s =
            opt_.cost.seconds(2.0 * double(n) * sizeof(float) * (Pd - 1) / Pd, 2 * (Pd - 1));
      }
      route_ = choose(longest);
      stats_.last_route = route_;
      stats_.steps += 1;
      // fp32 gradients are decoded straight into the gradient (its values were consumed by
      // encode); fp16/bf16 ones through an fp32 accumulator
      float* acc = target();
      const TensorView dense(acc, {numel_}, DType::kFloat32, device_, device_index_, stream_);
      if (route_ == TopKRoute::kDense) {
        stats_.dense_steps += 1;
        device_zero(device_, acc, n * sizeof(float), stream_);
        comp_.decode_add(payload_.data(), payload_.size(), dense, 1.0f / float(world_));
        phase_ = 2;
        return make(CollectiveKind::kAllreduceSum, ElemType::kF32, acc, acc, n, "topk dense sum");
      }
      stats_.sparse_steps += 1;
      stride_ = static_cast<size_t>((longest + 7) / 8 * 8);
      const size_t mine = payload_.size();
      payload_.bytes.resize(stride_, true);
      if (stride_ > mine)
        device_zero(device_, static_cast<uint8_t*>(payload_.bytes.data()) + mine, stride_ - mine,
                    stream_);
      auto* all = gathered_.get<uint8_t>(stride_ * P);
      phase_ = 3;
      return make(CollectiveKind::kAllgather, ElemType::kU8, payload_.bytes.data(), all, stride_,
                  "topk payloads");
    }
    case 2: {  // dense route: the sum of the scaled decodes is the average
      finish();
      phase_ = 4;
      return std::nullopt;
    }
    case 3: {  // sparse route: decode all (scaled by 1/P) in rank order
      float* acc = target();
      const TensorView dense(acc, {numel_}, DType::kFloat32, device_, device_index_, stream_);
      device_zero(device_, acc, n * sizeof(float), stream_);
      const auto* all = static_cast<const uint8_t*>(gathered_.data());
      for (size_t r = 0; r < P; ++r)
        comp_.decode_add(all + r * stride_, static_cast<size_t>(host_sizes_[2 * r + 1]), dense,
                         1.0f / float(world_));
      finish();
      phase_ = 4;
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

}  // namespace gradcomp
