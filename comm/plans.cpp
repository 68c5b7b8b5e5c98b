// SPDX-License-Identifier: Apache-2.0
// The compressed-allreduce plans of plans.hpp. Local work goes through kernels (by device) and
// the compressors; the collectives are only asked for, never executed here.
#include "gradcomp/plans.hpp"

#include <algorithm>
#include <cstring>

#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce.hpp"

namespace gradcomp {

namespace k = kernels;

ElemType elem_type(DType t) {
  switch (t) {
    case DType::kFloat32: return ElemType::kF32;
    case DType::kFloat16: return ElemType::kF16;
    case DType::kBFloat16: return ElemType::kBF16;
  }
  return ElemType::kF32;
}

// ---------------------------------------------------------------------------------------------
GradientPlan::GradientPlan(int64_t numel, DType dtype, int world, Device device, int device_index,
                           void* stream)
    : numel_(numel), dtype_(dtype), world_(world), device_(device), device_index_(device_index),
      stream_(stream) {
  GC_CHECK_ARG(numel >= 0, "plan: numel must be >= 0, got ", numel);
  GC_CHECK_ARG(world >= 1, "plan: the number of ranks must be >= 1, got ", world);
  GC_CHECK_ARG(dtype_valid(static_cast<uint8_t>(dtype)), "plan: unsupported gradient dtype");
  if (device == Device::kCUDA && !built_with_cuda()) throw_not_built_with_cuda("a plan on CUDA");
}

void GradientPlan::begin(const TensorView& grad) {
  GC_CHECK_ARG(grad.numel == numel_, "plan '", name(), "': gradient has ", grad.numel,
               " elements, the plan was built for ", numel_, " (", grad.describe(), ")");
  GC_CHECK_ARG(grad.dtype == dtype_, "plan '", name(), "': gradient is ", dtype_name(grad.dtype),
               ", the plan was built for ", dtype_name(dtype_));
  GC_CHECK_ARG(grad.device == device_, "plan '", name(), "': gradient is on ",
               device_name(grad.device), ", the plan was built for ", device_name(device_));
  GC_CHECK_ARG(grad.data != nullptr || numel_ == 0, "plan '", name(), "': null gradient");
  grad_ = grad;
  phase_ = 0;
  on_begin();
}

void GradientPlan::require_begun() const {
  GC_CHECK_ARG(phase_ >= 0, "plan '", name(), "': next() called before begin(grad)");
}

Collective GradientPlan::make(CollectiveKind kind, ElemType type, const void* send, void* recv,
                              size_t count, const char* tag) const {
  Collective c;
  c.kind = kind;
  c.type = type;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.device = device_;
  c.stream = stream_;
  c.tag = tag;
  c.world = world_;
  return c;
}

// ---------------------------------------------------------------------------------------------
DenseAllreducePlan::DenseAllreducePlan(int64_t numel, DType dtype, int world, Device device,
                                       int device_index, void* stream)
    : GradientPlan(numel, dtype, world, device, device_index, stream) {}

std::optional<Collective> DenseAllreducePlan::next() {
  require_begun();
  switch (phase_) {
    case 0:
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(dtype_), grad_.data, grad_.data,
                  static_cast<size_t>(numel_), "dense sum");
    case 1:
      k::convert(device_, grad_.data, dtype_, grad_.data, dtype_, numel_, float(world_), stream_);
      phase_ = 2;
      return std::nullopt;
    default: return std::nullopt;
  }
}

// ---------------------------------------------------------------------------------------------
namespace {
/// Elements per rank of the reduce-scatter cast route (the buffer padded to P equal chunks).
size_t cast_chunk(int64_t numel, int world) {
  return (static_cast<size_t>(numel) + static_cast<size_t>(world) - 1) / static_cast<size_t>(world);
}
}  // namespace

CastAllreducePlan::CastAllreducePlan(int64_t numel, DType grad_dtype, DType wire_dtype, int world,
                                     Device device, int device_index, void* stream,
                                     CastRoute route)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      wire_dtype_(wire_dtype),
      route_(route),
      wire_(device, stream),
      chunks_(device, stream),
      wide_(device, stream) {
  GC_CHECK_ARG(wire_dtype == DType::kFloat16 || wire_dtype == DType::kBFloat16,
               "CastAllreducePlan: wire dtype must be fp16 or bf16, got ", dtype_name(wire_dtype));
  GC_CHECK_ARG(route == CastRoute::kAllreduce || route == CastRoute::kReduceScatter,
               "CastAllreducePlan: unknown route ", static_cast<int>(route));
  if (route == CastRoute::kAllreduce) {
    wire_.reserve(static_cast<size_t>(numel) * 2);
  } else {
    const size_t padded = cast_chunk(numel, world) * static_cast<size_t>(world);
    wire_.reserve(padded * 2);
    chunks_.reserve(padded * 2);
    wide_.reserve(padded * sizeof(float));
  }
}

std::string CastAllreducePlan::name() const {
  std::string n = wire_dtype_ == DType::kFloat16 ? "cast_fp16" : "cast_bf16";
  return route_ == CastRoute::kAllreduce ? n : n + "_rs";
}

std::optional<Collective> CastAllreducePlan::next() {
  require_begun();
  if (route_ == CastRoute::kReduceScatter) return next_reduce_scatter();
  switch (phase_) {
    case 0: {
      auto* w = wire_.get<uint16_t>(static_cast<size_t>(numel_));
      k::convert(device_, grad_.data, dtype_, w, wire_dtype_, numel_, float(world_), stream_);
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(wire_dtype_), w, w,
                  static_cast<size_t>(numel_), "cast sum");
    }
    case 1:
      k::convert(device_, wire_.data(), wire_dtype_, grad_.data, dtype_, numel_, 1.0f, stream_);
      phase_ = 2;
      return std::nullopt;
    default: return std::nullopt;
  }
}

std::optional<Collective> CastAllreducePlan::next_reduce_scatter() {
  const size_t c = cast_chunk(numel_, world_), P = static_cast<size_t>(world_);
  const size_t n = static_cast<size_t>(numel_);
  const ElemType wt = elem_type(wire_dtype_);
  switch (phase_) {
    case 0: {  // wire = cast(grad / P), zero-padded to P chunks; chunk r goes to rank r
      auto* w = wire_.get<uint16_t>(P * c);
      k::convert(device_, grad_.data, dtype_, w, wire_dtype_, numel_, float(world_), stream_);
      if (P * c > n) device_zero(device_, w + n, (P * c - n) * 2, stream_);
      auto* in = chunks_.get<uint16_t>(P * c);
      phase_ = 1;
      return make(CollectiveKind::kAllToAll, wt, w, in, c, "cast chunks");
    }
    case 1: {  // chunk j of every rank, widened, summed in rank order, rounded once
      auto* in = chunks_.get<uint16_t>(P * c);
      auto* f = wide_.get<float>(P * c);
      k::convert(device_, in, wire_dtype_, f, DType::kFloat32, static_cast<int64_t>(P * c), 1.0f,
                 stream_);
      k::reduce_blocks(device_, f, P, c, c, ElemType::kF32, f, stream_);
      k::convert(device_, f, DType::kFloat32, in, wire_dtype_, static_cast<int64_t>(c), 1.0f,
                 stream_);
      phase_ = 2;
      return make(CollectiveKind::kAllgather, wt, in, wire_.data(), c, "cast gather");
    }
    case 2:
      k::convert(device_, wire_.data(), wire_dtype_, grad_.data, dtype_, numel_, 1.0f, stream_);
      phase_ = 3;
      return std::nullopt;
    default: return std::nullopt;
  }
}

// ---------------------------------------------------------------------------------------------
namespace {
/// The compressor configuration of one rank: clip_norm becomes the rank's local threshold.
template <class Cfg>
Cfg per_rank(Cfg cfg, int world) {
  cfg.clip_norm = cfg.local_clip_norm(world);
  return cfg;
}
}  // namespace

TopKAllreducePlan::TopKAllreducePlan(const TopKConfig& cfg, int64_t numel, int world,
                                     const TopKPlanOptions& opt, DType grad_dtype, Device device,
                                     int device_index, void* stream)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      comp_(per_rank(cfg, world), numel, grad_dtype, device, device_index, stream),
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
      device_copy(host_sizes_.data(), Device::kCPU, sizes_.data(), device_,
                  2 * P * sizeof(int64_t), stream_);
      if (device_ == Device::kCUDA) cuda::stream_synchronize(stream_);
      uint64_t longest = 0, total = 0;
      for (size_t r = 0; r < P; ++r) {
        GC_CHECK_ARG(host_sizes_[2 * r] == host_sizes_[0], "plan 'topk': bucket sizes differ across ranks: rank 0 has ",
                     host_sizes_[0], " elements, rank ", r, " has ", host_sizes_[2 * r]);
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
    default: return std::nullopt;
  }
}

// ---------------------------------------------------------------------------------------------
RandomKAllreducePlan::RandomKAllreducePlan(const RandomKConfig& cfg, int64_t numel, int world,
                                           DType grad_dtype, Device device, int device_index,
                                           void* stream)
    : GradientPlan(numel, grad_dtype, world, device, device_index, stream),
      comp_(per_rank(cfg, world), numel, grad_dtype, device, device_index, stream),
      payload_(device),
      acc_(device, stream) {
  payload_.bytes.set_stream(stream);
}

size_t RandomKAllreducePlan::workspace_bytes() const {
  return payload_.bytes.capacity() + acc_.capacity();
}

std::optional<Collective> RandomKAllreducePlan::next() {
  require_begun();
  switch (phase_) {
    case 0: {  // encode; sum the values section of every rank in place
      comp_.encode(grad_, payload_);
      const PayloadHeader& h = payload_.header;
      auto* values = static_cast<uint8_t*>(payload_.bytes.data()) + h.section_offset(1);
      phase_ = 1;
      return make(CollectiveKind::kAllreduceSum, elem_type(DType(h.value_dtype)), values, values,
                  static_cast<size_t>(h.count), "randomk values");
    }
    case 1: {  // one decode of the summed values, scaled by 1/P (into the gradient when fp32)
      const auto n = static_cast<size_t>(numel_);
      const bool direct = dtype_ == DType::kFloat32;
      float* acc = direct ? static_cast<float*>(grad_.data) : acc_.get<float>(n);
      device_zero(device_, acc, n * sizeof(float), stream_);
      comp_.decode_add(payload_.data(), payload_.size(),
                       TensorView(acc, {numel_}, DType::kFloat32, device_, device_index_, stream_),
                       1.0f / float(world_));
      if (!direct)
        k::convert(device_, acc, DType::kFloat32, grad_.data, dtype_, numel_, 1.0f, stream_);
      phase_ = 2;
      return std::nullopt;
    }
    default: return std::nullopt;
  }
}

}  // namespace gradcomp
