// SPDX-License-Identifier: Apache-2.0
// One small object of every kind that saves state (every StateWriter user), behind one interface:
// what the checkpoint-corruption tests (tests/robustness), the load_state_dict fuzzers and their
// seed-corpus generator (tests/fuzz) load into. A new state kind is added here once.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/crc32c.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/topk.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/powersgd_plan.hpp"
#include "plans/quant_plan.hpp"

namespace gradcomp::test {

class StateSubject {
 public:
  virtual ~StateSubject() = default;
  virtual std::vector<uint8_t> save() const = 0;
  virtual void load(const uint8_t* data, size_t n) = 0;
  /// One training step with a gradient drawn from `seed` (small finite values); `poison`: every
  /// value NaN instead (which a subject made with check_finite off takes into its state).
  virtual void step(uint32_t seed, bool poison = false) = 0;
};

/// Names of every state kind (the kind string written into the state, plus variants).
inline const std::vector<std::string>& state_kinds() {
  static const std::vector<std::string> k = {
      "topk",     "topk-momentum",        "randomk",
      "onebit",   "onebit-allreduce",     "quant-allreduce",
      "powersgd", "quant-reduce-scatter", "topk-reduce-scatter"};
  return k;
}

namespace detail_subjects {

inline std::vector<float> grad(int64_t n, uint32_t seed, bool poison) {
  std::vector<float> g(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
  if (poison) return g;
  uint32_t x = seed * 2654435761u + 12345u;
  for (auto& v : g) {
    x = x * 1664525u + 1013904223u;  // LCG: deterministic, no <random> distribution differences
    v = static_cast<float>(static_cast<int32_t>(x >> 8) - (1 << 23)) / float(1 << 23);
  }
  return g;
}

// A Compressor fed rows x cols gradients.
class CompressorSubject : public StateSubject {
 public:
  CompressorSubject(std::unique_ptr<Compressor> c, int64_t cols) : c_(std::move(c)), cols_(cols) {}
  std::vector<uint8_t> save() const override { return c_->state_dict(); }
  void load(const uint8_t* d, size_t n) override { c_->load_state_dict(d, n); }
  void step(uint32_t seed, bool poison) override {
    auto g = grad(c_->numel(), seed, poison);
    c_->encode(TensorView::cpu(g.data(), {c_->numel() / cols_, cols_}), payload_);
  }

 private:
  std::unique_ptr<Compressor> c_;
  int64_t cols_;
  Payload payload_;
};

// The plan of the only rank of a job (world 1) over kN elements, whose state is the plan's
// state_dict(): what the two-phase plan subjects share.
template <class Plan>
class OneRankPlanSubject : public StateSubject {
 public:
  std::vector<uint8_t> save() const override { return plan_.state_dict(); }
  void load(const uint8_t* d, size_t n) override { plan_.load_state_dict(d, n); }
  void step(uint32_t seed, bool poison) override {
    auto g = grad(kN, seed, poison);
    std::vector<float> out(kN);
    begin(TensorView::cpu(g.data(), kN), TensorView::cpu(out.data(), kN));
    run_plans_in_process({&plan_});
  }

 protected:
  static constexpr int64_t kN = 80;
  template <class Config>
  explicit OneRankPlanSubject(const Config& c) : plan_(c, kN, 1, 0) {}
  /// Starts the plan's step on g; `out` is for a plan that can write the average elsewhere.
  virtual void begin(const TensorView& g, const TensorView& out) = 0;
  Plan plan_;
};

class OneBitPlanSubject : public OneRankPlanSubject<OneBitAllreducePlan> {
 public:
  explicit OneBitPlanSubject(bool check_finite) : OneRankPlanSubject(cfg(check_finite)) {}

 private:
  void begin(const TensorView& g, const TensorView& out) override { plan_.begin(g, out); }
  // the hook's recommended form (rotated 32-element blocks, L2 scales) with momentum, so that the
  // fuzzed state holds every array the plan can save: worker and server error and the momentum
  static OneBitConfig cfg(bool check_finite) {
    OneBitConfig c;
    c.scaling = OneBitScaling::kSignL2;
    c.block_size = 32;
    c.rotate = true;
    c.momentum = 0.5;
    c.check_finite = check_finite;
    return c;
  }
};

class QuantPlanSubject : public OneRankPlanSubject<QuantPlan> {
 public:
  explicit QuantPlanSubject(bool check_finite) : OneRankPlanSubject(cfg(check_finite)) {}

 private:
  void begin(const TensorView& g, const TensorView&) override { plan_.begin(g); }  // in place
  static QuantConfig cfg(bool check_finite) {
    QuantConfig c;
    c.bits = 2;
    c.block_size = 32;
    c.check_finite = check_finite;
    return c;
  }
};

// A reduce-scatter plan of sharded training (make_shard_plan), one rank. The quant form refuses
// check_finite off (consensus needs the flag): without it, this subject forges what a NaN
// gradient would leave, a well-sealed state whose error array is NaN.
class ShardPlanSubject : public StateSubject {
 public:
  ShardPlanSubject(const std::string& family, bool check_finite)
      : forge_(family == "quant" && !check_finite) {
    BucketSpec b;
    b.numel = kN;
    b.bucket_id = 7;
    PlanOptions o{{"check_finite", check_finite || forge_}};
    if (family == "quant") o["bits"] = int64_t{2};
    if (family == "topk") o["ratio"] = 0.1;
    plan_ = make_shard_plan(family, b, PlanForm::kReduceScatter, o);
  }
  std::vector<uint8_t> save() const override {
    return forged_.empty() ? plan_->state_dict() : forged_;
  }
  void load(const uint8_t* d, size_t n) override {
    plan_->load_state_dict(d, n);
    forged_.clear();
  }
  void step(uint32_t seed, bool poison) override {
    auto g = grad(kN, seed, poison);
    plan_->begin(TensorView::cpu(g.data(), kN));
    run_plans_in_process({plan_.get()});
    if (poison && forge_) {  // the error array ends 4 bytes (the CRC-32C) before the end
      forged_ = plan_->state_dict();
      const size_t end = forged_.size() - sizeof(uint32_t);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (size_t i = end - kN * sizeof(float); i < end; i += sizeof(float))
        std::memcpy(forged_.data() + i, &nan, sizeof nan);
      const uint32_t crc = gradcomp::detail::crc32c(forged_.data(), end);
      std::memcpy(forged_.data() + end, &crc, sizeof crc);
    }
  }

 private:
  static constexpr size_t kN = 80;
  bool forge_;
  std::vector<uint8_t> forged_;
  std::unique_ptr<BucketPlan> plan_;
};

class PowerSGDSubject : public StateSubject {
 public:
  explicit PowerSGDSubject(bool check_finite) : st_(cfg(check_finite), {{6, 5}, {7}}) {}
  std::vector<uint8_t> save() const override { return st_.state_dict(); }
  void load(const uint8_t* d, size_t n) override { st_.load_state_dict(d, n); }
  void step(uint32_t seed, bool poison) override {
    auto a = grad(30, seed, poison), b = grad(7, seed + 1, poison);
    PowerSGDPlan plan(st_, 1);
    plan.begin({TensorView::cpu(a.data(), {6, 5}), TensorView::cpu(b.data(), 7)});
    run_plans_in_process({&plan});
  }

 private:
  static PowerSGDConfig cfg(bool check_finite) {
    PowerSGDConfig c;
    c.rank = 2;
    c.check_finite = check_finite;
    c.min_compression_rate = 0.0;  // compress the small matrix too
    return c;
  }
  PowerSGDState st_;
};

/// The sparsifiers' (top-k, random-k) common configuration of the fuzz seeds: ratio 0.1, tensor 7.
template <class Config>
Config sparsifier_config(bool check_finite) {
  Config c;
  c.ratio = 0.1;
  c.tensor_id = 7;
  c.check_finite = check_finite;
  return c;
}

}  // namespace detail_subjects

/// A fresh object of `kind` (see state_kinds()), with the fixed small configuration that the
/// committed fuzz seeds were made with. Tensor ids are 7 so that a state of another id is wrong.
/// check_finite is not part of the saved state: a subject made without it saves what a NaN
/// gradient left in its state, and one made with it must refuse that state.
inline std::unique_ptr<StateSubject> make_state_subject(const std::string& kind,
                                                        bool check_finite = true) {
  using namespace detail_subjects;
  if (kind == "topk" || kind == "topk-momentum") {
    auto c = sparsifier_config<TopKConfig>(check_finite);
    c.momentum = kind == "topk" ? 0.0 : 0.9;
    return std::make_unique<CompressorSubject>(std::make_unique<TopKCompressor>(c, 40), 1);
  }
  if (kind == "randomk") {
    const auto c = sparsifier_config<RandomKConfig>(check_finite);
    return std::make_unique<CompressorSubject>(std::make_unique<RandomKCompressor>(c, 40), 1);
  }
  if (kind == "onebit") {
    OneBitConfig c;
    c.tensor_id = 7;
    c.check_finite = check_finite;
    return std::make_unique<CompressorSubject>(std::make_unique<OneBitCompressor>(c, 6, 8), 8);
  }
  if (kind == "onebit-allreduce") return std::make_unique<OneBitPlanSubject>(check_finite);
  if (kind == "quant-allreduce") return std::make_unique<QuantPlanSubject>(check_finite);
  if (kind == "powersgd") return std::make_unique<PowerSGDSubject>(check_finite);
  if (kind == "quant-reduce-scatter")
    return std::make_unique<ShardPlanSubject>("quant", check_finite);
  if (kind == "topk-reduce-scatter")
    return std::make_unique<ShardPlanSubject>("topk", check_finite);
  throw InvalidArgument("make_state_subject: unknown kind " + kind);
}

}  // namespace gradcomp::test
