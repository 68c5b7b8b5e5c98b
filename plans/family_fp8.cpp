// SPDX-License-Identifier: Apache-2.0
// The fp8 family: values in blocks of an fp32 scale and one-byte e4m3 or e5m2 codes
// (kernels/fp8_kernels.hpp), summed in fp32 in rank order. The allreduce for DDP, the
// reduce-scatter for FSDP2's gradients and the allgather for its parameters (what an fp8
// all-gather gives FSDP2 users: a quarter of fp32's bytes, about half of bf16's). Stateless: a
// NaN or Inf makes its block's scale NaN, so it reaches the sum (and a GradScaler) on every rank.
//
// Everything of the family is in this file (the plan is private to it) and in its kernels; it is
// registered by one line in plans/families.cpp.
#include <memory>
#include <string>

#include "gradcomp/error.hpp"
#include "kernels/fp8_kernels.hpp"
#include "plans/family.hpp"
#include "plans/gradient_plan.hpp"
#include "plans/options.hpp"

namespace gradcomp::detail {
namespace {

namespace k = kernels;

enum class Fp8Route : uint8_t { kReduceScatter, kGather };

/// The fp8 plan of one form. Allreduce, `reduce_scatter` route: the bucket padded to P chunks of
/// whole blocks, an all-to-all of each rank's records, rank r sums chunk r's P records in rank
/// order, divides by P and encodes the average again, an allgather of the averages (two message
/// rounds; each value rounded to fp8 twice). `gather` route: one allgather of every rank's whole
/// records, each rank sums all P (one round, P - 1 buffers received, one rounding).
/// Reduce-scatter: each chunk in its own blocks, an all-to-all, rank r writes the sum (average)
/// of its chunk in the bucket's dtype. Allgather: rank r's chunk encoded, gathered and decoded
/// into every rank's bucket (its own chunk too, so every rank holds the same values).
class Fp8Plan final : public GradientPlan {
 public:
  Fp8Plan(const BucketSpec& b, PlanForm form, bool e5m2, int block, Fp8Route route, bool average)
      : GradientPlan(b.numel, b.dtype, b.world, b.device, b.device_index, b.stream),
        form_(form),
        e5m2_(e5m2),
        block_(block),
        route_(route),
        average_(average),
        rank_(b.rank),
        wire_(b.device, b.stream),
        recv_(b.device, b.stream),
        mine_(b.device, b.stream) {
    GC_CHECK_ARG(block >= 32 && block <= 4096 && block % 32 == 0,
                 "invalid option for compressor 'fp8': block_size must be a multiple of 32 in "
                 "[32, 4096], got ",
                 block);
    GC_CHECK_ARG(b.rank >= 0 && b.rank < b.world, "fp8 plan: rank ", b.rank, " is outside [0, ",
                 b.world, ")");
    const auto n = static_cast<size_t>(numel_), P = static_cast<size_t>(world_);
    if (form == PlanForm::kAllreduce) {
      // gather: the whole bucket; reduce-scatter: P chunks of whole blocks, padded with zeros
      chunk_blocks_ = route == Fp8Route::kGather ? blocks_of(n) : (blocks_of(n) + P - 1) / P;
    } else {
      GC_CHECK_ARG(numel_ % world_ == 0, "fp8 plan: the bucket's ", numel_,
                   " elements must split into ", world_, " equal chunks (one per rank)");
      chunk_blocks_ = blocks_of(n / P);
    }
    const size_t cb = chunk_bytes();
    const bool whole = form == PlanForm::kAllreduce && route == Fp8Route::kGather;
    wire_.reserve(whole || form == PlanForm::kAllgather ? cb : cb * P);
    recv_.reserve(cb * P);
    if (form == PlanForm::kAllreduce && route == Fp8Route::kReduceScatter) mine_.reserve(cb);
  }

  std::string name() const override {
    const std::string f = e5m2_ ? "fp8_e5m2" : "fp8_e4m3";
    if (form_ == PlanForm::kReduceScatter) return "rs_" + f;
    if (form_ == PlanForm::kAllgather) return "ag_" + f;
    return f + (route_ == Fp8Route::kGather ? "_gather" : "_rs");
  }
  size_t workspace_bytes() const override {
    return wire_.capacity() + recv_.capacity() + mine_.capacity();
  }

  std::optional<Collective> next() override {
    require_begun();
    if (form_ == PlanForm::kAllreduce)
      return route_ == Fp8Route::kGather ? next_gather() : next_reduce_scatter();
    return form_ == PlanForm::kReduceScatter ? next_shard_reduce() : next_shard_gather();
  }

 private:
  size_t blocks_of(size_t elems) const {
    return (elems + static_cast<size_t>(block_) - 1) / static_cast<size_t>(block_);
  }
  size_t chunk_bytes() const { return chunk_blocks_ * k::fp8_record_bytes(block_); }
  float divisor() const { return average_ ? static_cast<float>(world_) : 1.0f; }
  int64_t chunk_elems() const { return numel_ / world_; }
  /// Element `e` of the bound bucket.
  void* at(int64_t e) const {
    return static_cast<uint8_t*>(grad_.data) + static_cast<size_t>(e) * dtype_size(dtype_);
  }
  std::optional<Collective> finish() {
    phase_ = kDone;
    end_step(false, -1);
    return std::nullopt;
  }

  std::optional<Collective> next_reduce_scatter() {
    const size_t cb = chunk_bytes(), P = static_cast<size_t>(world_);
    const auto nb = static_cast<int64_t>(chunk_blocks_);
    switch (phase_) {
      case 0: {  // P chunks of nb records; chunk r goes to rank r
        auto* w = wire_.get<uint8_t>(cb * P);
        k::fp8_encode_blocks({device_, stream_}, grad_.data, dtype_, numel_, nb * world_, block_,
                             e5m2_, w);
        phase_ = 1;
        return make(CollectiveKind::kAllToAll, ElemType::kU8, w, recv_.get<uint8_t>(cb * P), cb,
                    "fp8 chunks");
      }
      case 1: {  // chunk r of every rank, summed in rank order, averaged, encoded again
        auto* mine = mine_.get<uint8_t>(cb);
        k::fp8_sum_blocks({device_, stream_}, static_cast<uint8_t*>(recv_.data()), world_, cb, nb,
                          block_, e5m2_, divisor(), mine, nullptr, dtype_, 0);
        phase_ = 2;
        return make(CollectiveKind::kAllgather, ElemType::kU8, mine, wire_.get<uint8_t>(cb * P), cb,
                    "fp8 gather");
      }
      case 2:  // every rank's averaged chunk, decoded into the bucket
        k::fp8_sum_blocks({device_, stream_}, static_cast<uint8_t*>(wire_.data()), 1, 0,
                          nb * world_, block_, e5m2_, 1.0f, nullptr, grad_.data, dtype_, numel_);
        return finish();
      default:
        return std::nullopt;
    }
  }

  std::optional<Collective> next_gather() {
    const size_t cb = chunk_bytes(), P = static_cast<size_t>(world_);
    const auto nb = static_cast<int64_t>(chunk_blocks_);
    switch (phase_) {
      case 0: {  // the whole bucket's records to every rank
        auto* w = wire_.get<uint8_t>(cb);
        k::fp8_encode_blocks({device_, stream_}, grad_.data, dtype_, numel_, nb, block_, e5m2_, w);
        phase_ = 1;
        return make(CollectiveKind::kAllgather, ElemType::kU8, w, recv_.get<uint8_t>(cb * P), cb,
                    "fp8 gather all");
      }
      case 1:  // the P buffers summed in rank order, averaged, written in the bucket's dtype
        k::fp8_sum_blocks({device_, stream_}, static_cast<uint8_t*>(recv_.data()), world_, cb, nb,
                          block_, e5m2_, divisor(), nullptr, grad_.data, dtype_, numel_);
        return finish();
      default:
        return std::nullopt;
    }
  }

  std::optional<Collective> next_shard_reduce() {
    const size_t cb = chunk_bytes(), P = static_cast<size_t>(world_);
    const auto nb = static_cast<int64_t>(chunk_blocks_);
    const int64_t c = chunk_elems();
    switch (phase_) {
      case 0: {  // each destination chunk in blocks of its own
        auto* w = wire_.get<uint8_t>(cb * P);
        for (int r = 0; r < world_; ++r)
          k::fp8_encode_blocks({device_, stream_}, at(r * c), dtype_, c, nb, block_, e5m2_,
                               w + static_cast<size_t>(r) * cb);
        phase_ = 1;
        return make(CollectiveKind::kAllToAll, ElemType::kU8, w, recv_.get<uint8_t>(cb * P), cb,
                    "fp8 shard chunks");
      }
      case 1:  // the P records of this rank's chunk, summed in rank order into its chunk
        k::fp8_sum_blocks({device_, stream_}, static_cast<uint8_t*>(recv_.data()), world_, cb, nb,
                          block_, e5m2_, divisor(), nullptr, at(rank_ * c), dtype_, c);
        return finish();
      default:
        return std::nullopt;
    }
  }

  std::optional<Collective> next_shard_gather() {
    const size_t cb = chunk_bytes(), P = static_cast<size_t>(world_);
    const auto nb = static_cast<int64_t>(chunk_blocks_);
    const int64_t c = chunk_elems();
    switch (phase_) {
      case 0: {  // this rank's chunk to every rank
        auto* w = wire_.get<uint8_t>(cb);
        k::fp8_encode_blocks({device_, stream_}, at(rank_ * c), dtype_, c, nb, block_, e5m2_, w);
        phase_ = 1;
        return make(CollectiveKind::kAllgather, ElemType::kU8, w, recv_.get<uint8_t>(cb * P), cb,
                    "fp8 shard gather");
      }
      case 1:  // every chunk decoded, this rank's own included
        for (int r = 0; r < world_; ++r)
          k::fp8_sum_blocks({device_, stream_},
                            static_cast<uint8_t*>(recv_.data()) + static_cast<size_t>(r) * cb, 1, 0,
                            nb, block_, e5m2_, 1.0f, nullptr, at(r * c), dtype_, c);
        return finish();
      default:
        return std::nullopt;
    }
  }

  PlanForm form_;
  bool e5m2_;
  int block_;
  Fp8Route route_;
  bool average_;
  int rank_;
  size_t chunk_blocks_ = 0;  ///< records per chunk (allreduce gather route: of the whole bucket)
  Buffer wire_, recv_, mine_;
};

PlanOptions fp8_defaults() {
  return {{"format", std::string("e4m3")},
          {"block_size", int64_t{256}},
          {"route", std::string("auto")}};
}

bool e5m2_of(const Options& o) {
  const std::string& f = o.name("format");
  GC_CHECK_ARG(f == "e4m3" || f == "e5m2",
               "invalid option for compressor 'fp8': format must be "
               "'e4m3' or 'e5m2', got '",
               f, "'");
  return f == "e5m2";
}

int block_of(const Options& o) {
  const int64_t b = o.integer("block_size");
  GC_CHECK_ARG(b >= 32 && b <= 4096 && b % 32 == 0,
               "invalid option for compressor 'fp8': block_size must be a multiple of 32 in "
               "[32, 4096], got ",
               b);
  return static_cast<int>(b);
}

std::unique_ptr<BucketPlan> fp8_plan(const BucketSpec& b, const Options& o) {
  const std::string& r = o.name("route");
  GC_CHECK_ARG(r == "auto" || r == "reduce_scatter" || r == "gather",
               "invalid option for compressor 'fp8': route must be 'auto', 'reduce_scatter' or "
               "'gather', got '",
               r,
               "' (no backend sums scaled fp8 blocks, so there is no "
               "allreduce route)");
  // on 2 ranks one allgather moves the reduce-scatter route's bytes in one message round
  const Fp8Route route =
      r == "gather" || (r == "auto" && b.world <= 2) ? Fp8Route::kGather : Fp8Route::kReduceScatter;
  return std::make_unique<Fp8Plan>(b, PlanForm::kAllreduce, e5m2_of(o), block_of(o), route, true);
}

std::unique_ptr<BucketPlan> fp8_shard_plan(const BucketSpec& b, PlanForm form, const Options& o) {
  const bool average = form == PlanForm::kReduceScatter ? o.flag("average") : false;
  return std::make_unique<Fp8Plan>(b, form, e5m2_of(o), block_of(o), Fp8Route::kReduceScatter,
                                   average);
}

}  // namespace

const Family& fp8_family() {
  static const Family f = [] {
    Family e;
    e.name = "fp8";
    e.summary =
        "fp8 (e4m3 or e5m2) values with an fp32 scale per block, summed in fp32 in rank order; "
        "the allreduce, and FSDP2's gradient reduce-scatter and parameter allgather.";
    e.defaults = fp8_defaults;
    e.build = fp8_plan;
    e.shard_forms = {PlanForm::kReduceScatter, PlanForm::kAllgather};
    e.shard_defaults = [](PlanForm form) { return shard_defaults_from(fp8_defaults(), form); };
    e.build_shard = fp8_shard_plan;
    e.option_docs = {
        {"format",
         "",
         "The 8-bit float: `e4m3` (3 mantissa bits, values to 448: the finer grid) or `e5m2` (2 "
         "mantissa bits, values to 57344).",
         {"e4m3", "e5m2"}},
        {"block_size",
         "",
         "Values per fp32 scale, a multiple of 32 in [32, 4096]: 4 bytes more per block, and each "
         "block's largest magnitude maps to the format's largest value.",
         {}},
        {"route",
         "",
         "How the records are summed (no backend sums scaled fp8): `reduce_scatter`, an "
         "all-to-all of chunks, a rank-ordered fp32 sum encoded again and an allgather (two "
         "rounds, two fp8 roundings); `gather`, one allgather of every rank's records and the "
         "same sum (one round, P - 1 buffers received per rank); `auto`, `gather` on 2 ranks and "
         "`reduce_scatter` on more.",
         {"auto", "reduce_scatter", "gather"}},
    };
    return e;
  }();
  return f;
}

}  // namespace gradcomp::detail
