// SPDX-License-Identifier: Apache-2.0
// Top-k / DGC allreduce plan: encode, size exchange (or padding to the step's bound), then the
// sparse allgather or the densified allreduce chosen by the cost model.
#include "plans/topk_plan.hpp"

#include <algorithm>
#include <cstring>

#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce_kernels.hpp"
#include "kernels/topk_kernels.hpp"
#include "plans/envelope.hpp"
#include "plans/options_hash.hpp"

namespace gradcomp {

namespace k = kernels;

namespace {
/// What the top-k plan's step envelope compares, named in its error.
constexpr const char* kMustMatch =
    "ratio, warm-up, value_dtype, value_bits, route, exchange and the cost model";
}  // namespace

TopKAllreducePlan::TopKAllreducePlan(const TopKConfig& cfg, int64_t numel, int world,
                                     const TopKPlanOptions& opt, DType grad_dtype, Device device,
                                     int device_index, void* stream)
    : SparsifyPlan(cfg, numel, world, grad_dtype, device, device_index, stream),
      opt_(opt),
      payload_(device),
      sizes_(device, stream),
      gathered_(device, stream),
      acc_(device, stream),
      host_sizes_(kSizeFields * (static_cast<size_t>(world) + 1)),
      dense_(device, stream) {
  GC_CHECK_ARG(opt.cost.bandwidth_Bps > 0 && opt.cost.latency_s >= 0,
               "TopKAllreducePlan: cost model needs bandwidth > 0 and latency >= 0, got ",
               opt.cost.bandwidth_Bps, " B/s and ", opt.cost.latency_s, " s");
  payload_.bytes.set_stream(stream);
  // Reserve the worst case once (largest k over the warm-up schedule, index section at most
  // min(raw, bitmap)), so that no step allocates.
  double ratio = cfg.ratio;
  for (double r : cfg.warmup_ratios) ratio = std::max(ratio, r);
  const uint64_t most = topk_payload_bound(cfg, topk_count(ratio, numel), numel);
  max_payload_ = most;
  payload_.bytes.reserve(most);
  gathered_.reserve(most * static_cast<uint64_t>(world));
  if (grad_dtype != DType::kFloat32) acc_.reserve(static_cast<size_t>(numel) * sizeof(float));
  sizes_.reserve(kSizeFields * (static_cast<size_t>(world) + 1) * sizeof(int64_t));
  // FNV-1a over the options that decide every later step's collectives (their sizes, the route,
  // the exchange): the step envelope's options, so that ranks whose options differ are told at
  // the first step, not by an abort later
  detail::OptionsHash h;
  h.add(cfg.ratio).add(cfg.warmup_steps).add_all(cfg.warmup_ratios);
  h.add(static_cast<int>(cfg.value_dtype)).add(static_cast<int>(opt.route));
  if (cfg.value_bits > 0) h.add(cfg.value_bits).add(cfg.value_block);  // (older hashes unchanged)
  h.add(static_cast<int>(opt.exchange)).add(opt.cost.bandwidth_Bps).add(opt.cost.latency_s);
  options_hash_ = static_cast<uint32_t>(h.value());
}

float* TopKAllreducePlan::target() {
  if (dtype_ == DType::kFloat32) return static_cast<float*>(grad_.data);
  return acc_.get<float>(static_cast<size_t>(numel_));
}

void TopKAllreducePlan::finish() {
  // saturating: a finite average beyond fp16's range (residuals accumulate past it) stays finite
  if (dtype_ != DType::kFloat32)
    k::convert_saturating({device_, stream_}, static_cast<const float*>(acc_.data()), grad_.data,
                          dtype_, numel_);
}

size_t TopKAllreducePlan::workspace_bytes() const {
  return payload_.bytes.capacity() + sizes_.capacity() + gathered_.capacity() + acc_.capacity() +
         dense_.capacity();
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

TopKExchange TopKAllreducePlan::next_exchange() const {
  // the first step checks the bucket sizes across ranks, and so does the step after a failed one
  // (the ranks' steps are not known to agree); every input below is the same on every rank (the
  // configuration, the agreed step, and what the last step gathered)
  if (stats_.steps == 0 || agreed_step_ < 0) return TopKExchange::kSizes;
  if (opt_.exchange != TopKExchange::kAuto) return opt_.exchange;
  if (opt_.route == TopKRoute::kDense) return TopKExchange::kBound;  // the sizes go unused
  const uint64_t estimate = stats_.last_max_payload;
  if (estimate == 0) return TopKExchange::kBound;  // unknown (a dense step without sizes)
  const double P = world_;
  const auto bound = static_cast<double>(comp_.payload_bound(agreed_step_));
  const double by_bound = opt_.cost.seconds(bound * (P - 1), P - 1);
  const double by_sizes = opt_.cost.seconds(2.0 * sizeof(int64_t) * (P - 1), P - 1) +
                          opt_.cost.seconds(double(estimate) * (P - 1), P - 1);
  return by_bound <= by_sizes ? TopKExchange::kBound : TopKExchange::kSizes;
}

std::optional<Collective> TopKAllreducePlan::send(uint64_t longest) {
  const auto n = static_cast<size_t>(numel_);
  {  // the model's estimates, for the statistics
    const double Pd = world_;
    stats_.last_sparse_cost_s = opt_.cost.seconds(double(longest) * (Pd - 1), Pd - 1);
    stats_.last_dense_cost_s =
        opt_.cost.seconds(2.0 * double(n) * sizeof(float) * (Pd - 1) / Pd, 2 * (Pd - 1));
  }
  route_ = choose(longest);
  stats_.last_route = route_;
  stats_.last_exchange = exchange_;
  stats_.steps += 1;
  if (exchange_ == TopKExchange::kBound) stats_.bound_steps += 1;
  if (route_ == TopKRoute::kDense) {
    // own payload decoded (scaled by 1/P) into fp32 values, the consensus slots after them; a
    // rank whose gradient was not finite sends zeros and counts itself in the last slot
    stats_.dense_steps += 1;
    stats_.last_stride = 0;
    float* d = dense_.get<float>(n + kDenseSlots);
    device_zero(device_, d, n * sizeof(float), stream_);
    if (bad_ < 0)
      comp_.decode_add(payload_.data(), payload_.size(),
                       TensorView(d, {numel_}, DType::kFloat32, device_, device_index_, stream_),
                       1.0f / float(world_));
    put_dense_slots(d + n);
    phase_ = 2;
    return make(CollectiveKind::kAllreduceSum, ElemType::kF32, d, d, n + kDenseSlots,
                "topk dense sum");
  }
  stats_.sparse_steps += 1;
  stride_ = static_cast<size_t>((longest + 7) / 8 * 8);
  phase_ = 3;
  return gather_payloads(exchange_ == TopKExchange::kBound ? "topk payloads (bound)"
                                                           : "topk payloads");
}

Collective TopKAllreducePlan::gather_payloads(const char* tag) {
  const auto P = static_cast<size_t>(world_);
  const size_t mine = payload_.size();
  stats_.last_stride = stride_;
  if (mine > stride_) {
    // Only the bound exchange pads to a bound it did not measure: this rank's own step is not
    // the agreed one (its state was replaced). Its header alone, flagged, keeps the allgather's
    // size; the others learn the step from it, or gather again at the real sizes.
    GC_CHECK(exchange_ == TopKExchange::kBound, "topk plan: a payload of ", mine,
             " bytes exceeds the stride ", stride_);
    PayloadHeader h = payload_.header;
    h.flags |= kPayloadOverflow;
    device_copy(payload_.bytes.data(), device_, &h, Device::kCPU, sizeof(h), stream_);
    overflowed_ = true;
  } else {
    if (overflowed_) {  // the gathering again: the real header back in place
      device_copy(payload_.bytes.data(), device_, &payload_.header, Device::kCPU,
                  sizeof(PayloadHeader), stream_);
      overflowed_ = false;
    }
    payload_.bytes.resize(stride_, true);
    if (stride_ > mine)
      device_zero(device_, static_cast<uint8_t*>(payload_.bytes.data()) + mine, stride_ - mine,
                  stream_);
  }
  auto* all = gathered_.get<uint8_t>(stride_ * P);
  return make(CollectiveKind::kAllgather, ElemType::kU8, payload_.bytes.data(), all, stride_, tag);
}

void TopKAllreducePlan::put_dense_slots(float* slots) {
  // the step envelope (plans/envelope.hpp): this rank's step and options, and as its flag
  // whether this rank's gradient was bad
  const detail::StepEnvelope e{own_step_, options_hash_, bad_ >= 0};
  const std::vector<uint8_t> h = detail::sum_envelope(e, DType::kFloat32, world_);
  device_copy(slots, device_, h.data(), Device::kCPU, h.size(), stream_);
}

bool TopKAllreducePlan::check_dense_slots() {
  static_assert(kDenseSlots == detail::kSumEnvelopeSlots, "the dense route carries the envelope");
  std::vector<uint8_t> h(kDenseSlots * sizeof(float));
  device_copy(h.data(), Device::kCPU, dense_.get<float>(0) + numel_, device_, h.size(), stream_);
  if (device_ == Device::kCUDA) cuda::stream_synchronize(stream_);
  const bool flagged =
      detail::require_agreement(detail::read_sum_envelope(h.data(), DType::kFloat32, world_),
                                "topk", kMustMatch, own_step_, check_finite_);
  return check_finite_ && flagged;
}

std::optional<Collective> TopKAllreducePlan::next() {
  try {
    return advance();
  } catch (const Error&) {
    // the agreement and payload checks throw before anything is committed: the step is over,
    // and the ranks' steps are not known to agree (the next step exchanges sizes)
    if (phase_ >= 0) phase_ = kDone;
    agreed_step_ = -1;
    overflowed_ = false;
    throw;
  }
}

std::optional<Collective> TopKAllreducePlan::advance() {
  require_begun();
  const auto P = static_cast<size_t>(world_);
  const auto n = static_cast<size_t>(numel_);
  switch (phase_) {
    case 0: {  // encode; then exchange (numel, payload bytes), or pad to the bound and send
      exchange_ = next_exchange();
      overflowed_ = false;
      const int64_t step = own_step_ = comp_.step();  // the step encoded now
      const uint64_t bound = comp_.payload_bound(step);
      bad_ = check_finite_ ? first_nonfinite() : -1;
      if (bad_ >= 0)
        comp_.encode_skipped(payload_);  // no data, state untouched
      else
        comp_.encode(grad_, payload_);
      if (exchange_ == TopKExchange::kBound) {
        stats_.last_max_payload = 0;  // known once the headers are gathered (sparse route)
        stats_.last_total_payload = 0;
        // the bound of the agreed step, not of this rank's own (the same as long as they agree)
        return send(comp_.payload_bound(agreed_step_));
      }
      // (numel, payload bytes, bound, step envelope): what every later bound step relies on
      // being equal. The envelope's flag is not raised: a bad gradient is told with the
      // payloads (a kPayloadSkipped header, or the dense route's slots), which every exchange
      // sends.
      int64_t* mine = &host_sizes_[kSizeFields * P];
      mine[0] = numel_;
      mine[1] = static_cast<int64_t>(payload_.size());
      mine[2] = static_cast<int64_t>(bound);
      const detail::ByteEnvelope e = detail::byte_envelope({step, options_hash_, false});
      static_assert(sizeof e == (kSizeFields - kEnvelopeField) * sizeof(int64_t),
                    "the envelope fills the last fields");
      std::memcpy(mine + kEnvelopeField, &e, sizeof e);
      auto* d = sizes_.get<int64_t>(kSizeFields * (P + 1));
      device_copy(d + kSizeFields * P, device_, mine, Device::kCPU, kSizeFields * sizeof(int64_t),
                  stream_);
      phase_ = 1;
      return make(CollectiveKind::kAllgather, ElemType::kI64, d + kSizeFields * P, d, kSizeFields,
                  "topk sizes");
    }
    case 1: {  // check sizes, choose the route
      device_copy(host_sizes_.data(), Device::kCPU, sizes_.data(), device_,
                  kSizeFields * P * sizeof(int64_t), stream_);
      if (device_ == Device::kCUDA) cuda::stream_synchronize(stream_);
      uint64_t longest = 0, total = 0;
      payload_bytes_.resize(P);
      const int64_t* first = &host_sizes_[0];
      for (size_t r = 0; r < P; ++r)
        GC_CHECK_ARG(host_sizes_[kSizeFields * r] == first[0],
                     "plan 'topk': bucket sizes differ across ranks: rank 0 has ", first[0],
                     " elements, rank ", r, " has ", host_sizes_[kSizeFields * r]);
      // every rank holds the same P envelopes: the same verdict, or the same error, on each
      detail::require_agreement(detail::read_byte_envelopes(
                                    reinterpret_cast<const uint8_t*>(&host_sizes_[kEnvelopeField]),
                                    kSizeFields * sizeof(int64_t), world_),
                                "topk", kMustMatch, own_step_, check_finite_);
      for (size_t r = 0; r < P; ++r) {
        const int64_t* f = &host_sizes_[kSizeFields * r];
        // (implied by equal options and steps; checked as well, since a bound that differed
        // would pad the later steps' payloads differently)
        GC_CHECK_ARG(
            f[2] == first[2], "plan 'topk': the largest payload differs across ranks (", first[2],
            " bytes on rank 0, ", f[2], " on rank ", r,
            "): ratio, warm-up, value_dtype and value_bits must be the same on every rank");
        const auto b = static_cast<uint64_t>(f[1]);
        GC_CHECK_ARG(b >= sizeof(PayloadHeader), "plan 'topk': rank ", r,
                     " announced a payload of ", b, " bytes (less than a header)");
        payload_bytes_[r] = b;
        longest = std::max(longest, b);
        total += b;
      }
      stats_.last_max_payload = longest;
      stats_.last_total_payload = total;
      return send(longest);
    }
    case 2: {  // dense route: the sum of the scaled decodes is the average
      // (throws on every rank when the ranks disagree)
      const bool skip = check_dense_slots() || sum_overflowed(dense_.get<float>(0), nullptr);
      if (!skip) {
        const float* d = dense_.get<float>(0);
        if (dtype_ == DType::kFloat32)
          device_copy(grad_.data, device_, d, device_, n * sizeof(float), stream_);
        else  // saturating, as finish()
          k::convert_saturating({device_, stream_}, d, grad_.data, dtype_, numel_);
      }
      phase_ = 4;
      settle(skip);
      return std::nullopt;
    }
    case 3: {  // sparse route: decode all (scaled by 1/P) in rank order
      const auto* all = static_cast<const uint8_t*>(gathered_.data());
      if (exchange_ == TopKExchange::kBound && read_gathered_sizes(all)) {
        // a payload did not fit the agreed bound (every rank's state was replaced alike): the
        // headers gave every size, so gather again at the longest, as the size exchange would
        exchange_ = TopKExchange::kSizes;
        stride_ = static_cast<size_t>((stats_.last_max_payload + 7) / 8 * 8);
        return gather_payloads("topk payloads (past the bound)");
      }
      if (check_finite_ && any_skipped(all)) {
        phase_ = 4;
        settle(true);
        return std::nullopt;
      }
      float* acc = target();
      const TensorView dense(acc, {numel_}, DType::kFloat32, device_, device_index_, stream_);
      device_zero(device_, acc, n * sizeof(float), stream_);
      for (size_t r = 0; r < P; ++r)
        comp_.decode_add(all + r * stride_, static_cast<size_t>(payload_bytes_[r]), dense,
                         1.0f / float(world_));
      const bool skip = sum_overflowed(acc, all);
      if (!skip) finish();
      phase_ = 4;
      settle(skip);
      return std::nullopt;
    }
    default:
      return std::nullopt;
  }
}

bool TopKAllreducePlan::sum_overflowed(const float* sum, const uint8_t* gathered) {
  // Every rank's values are finite here (a rank with a NaN/Inf gradient sent none and flagged
  // it) and each was scaled by 1/P, so the exact average is finite; the fp32 sum of the scaled
  // values still rounds past FLT_MAX at the top of the range (values near FLT_MAX on every rank
  // for P = 10, 18, 20, ...), at any element. Each rank holds the same sum (the allreduce's, or
  // the same payloads decoded in rank order), so the whole of it is scanned and every rank skips
  // alike, as an overflow step.
  if (!check_finite_ || numel_ == 0) return false;
  if (gathered != nullptr && device_ == Device::kCPU && world_ < (1 << 20)) {
    // Sparse route on the CPU: the scan of n elements would cost more than the decode of the
    // P k values. Values all below 2^126 in magnitude cannot reach FLT_MAX (each scaled term is
    // below 2^126 / P times (1 + 2^-24)^2, their sum with P - 1 roundings below 2^127), which
    // the values' sums of squares tell (P k values, in double), or for coded values the bound
    // their blocks' scales give: only then is the sum scanned.
    bool large = false;
    for (size_t r = 0; r < headers_.size() && !large; ++r) {
      const PayloadHeader& h = headers_[r];
      const auto vt = DType(h.value_dtype);
      if (vt == DType::kFloat16 || h.count == 0) continue;  // (fp16 values stay below 65504)
      if (h.section_bytes[1] == 0) {  // coded values (value_bits): their scales bound them
        const double most =
            topk_coded_values_bound(comp_.config(), gathered + r * stride_ + h.section_offset(2),
                                    static_cast<int64_t>(h.count));
        large = !(most < 0x1p126);
        continue;
      }
      const double ss = k::cpu::sum_squares(gathered + r * stride_ + h.section_offset(1), vt,
                                            static_cast<int64_t>(h.count));
      large = !(ss < 0x1p252);
    }
    if (!large) return false;
  }
  return first_nonfinite(sum, DType::kFloat32, numel_) >= 0;
}

void TopKAllreducePlan::settle(bool skip) {
  if (!skip) comp_.commit();  // (a skipped step's staged state is simply not taken)
  // every check passed: every rank was at this rank's step
  agreed_step_ = own_step_ + (skip ? 0 : 1);
  end_step(skip, bad_, check_finite_);
}

void TopKAllreducePlan::copy_headers(const uint8_t* all) {
  const auto P = static_cast<size_t>(world_);
  headers_.resize(P);
  for (size_t r = 0; r < P; ++r)
    device_copy(&headers_[r], Device::kCPU, all + r * stride_, device_, sizeof(PayloadHeader),
                stream_);
  if (device_ == Device::kCUDA) cuda::stream_synchronize(stream_);
}

bool TopKAllreducePlan::any_skipped(const uint8_t* all) {
  // (the bound exchange copied them already, in read_gathered_sizes)
  if (exchange_ != TopKExchange::kBound) copy_headers(all);
  for (const PayloadHeader& h : headers_)
    if (h.flags & kPayloadSkipped) return true;
  return false;
}

bool TopKAllreducePlan::read_gathered_sizes(const uint8_t* all) {
  // Each rank's header says how long its payload is; decode_add validates the rest. Checked here:
  // that the rank's bucket has this plan's size and that every rank is at the same step (first,
  // so that a rank restored alone is named as such, whatever it sent), then that the sections
  // fit the stride (so that nothing is read beyond it, and the sum cannot wrap) or, for a header
  // flagged kPayloadOverflow, the largest payload the schedule allows.
  const auto P = static_cast<size_t>(world_);
  copy_headers(all);
  for (size_t r = 0; r < P; ++r) {
    const PayloadHeader& h = headers_[r];
    GC_CHECK_ARG(h.numel == static_cast<uint64_t>(numel_),
                 "plan 'topk': bucket sizes differ across ranks: this rank has ", numel_,
                 " elements, rank ", r, " has ", h.numel);
    // the header carries the sender's step: a rank restored alone (or an older state loaded
    // into one live plan) is told on every rank, as the size exchange does
    GC_CHECK_ARG(h.aux == headers_[0].aux, "plan 'topk': ranks are at different steps: rank 0 at ",
                 headers_[0].aux, ", rank ", r, " at ", h.aux,
                 " (restore every rank's state, or none)");
  }
  payload_bytes_.resize(P);
  uint64_t longest = 0, total = 0;
  bool again = false;
  for (size_t r = 0; r < P; ++r) {
    const PayloadHeader& h = headers_[r];
    const bool over = (h.flags & kPayloadOverflow) != 0;
    const uint64_t limit = over ? max_payload_ : stride_;
    for (const uint64_t b : h.section_bytes)
      GC_CHECK_PAYLOAD(b <= limit, "plan 'topk': rank ", r, "'s payload declares a section of ", b,
                       " bytes in a stride of ", limit);
    const uint64_t b = h.total_bytes();
    GC_CHECK_PAYLOAD(b <= limit, "plan 'topk': rank ", r, "'s payload declares ", b,
                     " bytes in a stride of ", limit);
    again = again || over;
    payload_bytes_[r] = b;
    longest = std::max(longest, b);
    total += b;
  }
  stats_.last_max_payload = longest;
  stats_.last_total_payload = total;
  return again;
}

}  // namespace gradcomp
