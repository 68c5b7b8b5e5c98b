// SPDX-License-Identifier: Apache-2.0
// Hostile inputs: PowerSGD shapes that overflow int64 or cannot be allocated,
// tensor views whose shape overflows, payloads addressed to another tensor, and zero-length
// collectives / index sections (memcpy with the null pointers of empty buffers: undefined
// behaviour that the sanitizer build of this test reports).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gradcomp/make_plan.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/topk.hpp"
#include "gradcomp/wire.hpp"

namespace gradcomp {
namespace {

void expect_invalid(const std::function<void()>& f, const std::string& want, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << what << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not an InvalidArgument: " << e.what();
  }
}

TEST(PowerSGDShapes, OverflowAndUnallocatableSizesRejectedBeforeAllocating) {
  PowerSGDConfig cfg;
  cfg.rank = 1;
  const int64_t big = int64_t{1} << 62;
  using Shapes = std::vector<std::vector<int64_t>>;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& c : std::vector<std::pair<Shapes, const char*>>{
           {{{big, 4}}, "2^62 x 4: the product wraps to 0 in int64"},
           {{{int64_t{1} << 31, int64_t{1} << 31}}, "2^31 x 2^31: 2^62 elements"},
           {{{1 << 20, 1 << 20}, {1 << 12, 1 << 20}}, "2^40 and 2^32 elements"},
           {{{4, 4}, {1 << 16, 1 << 16}}, "16 + 2^32 elements: over the bound in total"},
           {{{3, int64_t{1} << 40, 0}}, "a dimension over the bound"}})
    expect_invalid([&] { PowerSGDState st(cfg, c.first); }, "kPowerSGDMaxBucketNumel", c.second);
  // rejected at once: nothing was allocated (a 2^32-float buffer alone takes seconds to zero)
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  expect_invalid([&] { PowerSGDState st(cfg, {{4, -1}}); }, "negative", "negative dimension");
  PowerSGDState ok(cfg, {{3, 4, 0}, {64, 32}, {7}});  // empty tensors and ordinary ones still work
  EXPECT_EQ(ok.compressed_numel(), 64 * 32);
  EXPECT_LE(kPowerSGDMaxBucketNumel, int64_t{1} << 32);
}

TEST(TensorView, ShapeOverflowRejected) {
  float x = 0;
  const int64_t dims[2] = {int64_t{1} << 62, 4};
  expect_invalid([&] { TensorView v(&x, dims, 2, DType::kFloat32, Device::kCPU); }, "overflows",
                 "2^62 x 4 view");
  const int64_t empty[3] = {int64_t{1} << 62, 4, 0};  // overflow is rejected even before a 0
  expect_invalid([&] { TensorView v(&x, empty, 3, DType::kFloat32, Device::kCPU); }, "overflows",
                 "2^62 x 4 x 0 view");
}

// A payload made for tensor 3 must not decode into the compressor of tensor 4.
template <class C, class Cfg>
void expect_tensor_id_checked(Cfg cfg, int64_t n, const char* who) {
  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = std::sin(0.37f * i) + (i % 5 == 0 ? 4.0f : 0.0f);
  cfg.tensor_id = 3;
  C sender(cfg, n);
  cfg.tensor_id = 4;
  C other(cfg, n);
  Payload p;
  sender.encode(TensorView::cpu(g.data(), n), p);
  std::vector<float> out(static_cast<size_t>(n), 0.5f);
  try {
    other.decode_add(p.data(), p.size(), TensorView::cpu(out.data(), n));
    ADD_FAILURE() << who << ": a payload of tensor 3 decoded into tensor 4";
  } catch (const CorruptPayload& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 3"), std::string::npos) << who << e.what();
  }
  EXPECT_EQ(out, std::vector<float>(static_cast<size_t>(n), 0.5f)) << who << ": output written";
  sender.decode_add(p.data(), p.size(), TensorView::cpu(out.data(), n));  // its own tensor: fine
}

TEST(DecodeTensorId, EveryDecoderChecksTheHeaderTensorId) {
  TopKConfig tk;
  tk.ratio = 0.1;
  expect_tensor_id_checked<TopKCompressor>(tk, 200, "topk");
  RandomKConfig rk;
  rk.ratio = 0.1;
  expect_tensor_id_checked<RandomKCompressor>(rk, 200, "randomk");
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1, OneBitScaling::kSignL2}) {
    OneBitConfig ob;
    ob.scaling = sc;
    expect_tensor_id_checked<OneBitCompressor>(ob, 200, enum_name(sc));
  }
}

// Found by tests/fuzz/fuzz_randomk_decode: a random-k payload's step (header aux) of 2^63 or more
// became a negative step, and SparsifyConfig::ratio_at read warmup_ratios[-k] (SEGV).
TEST(RandomKStep, HugeStepInPayloadRejectedAndNegativeStepRefused) {
  RandomKConfig cfg;
  cfg.ratio = 0.01;
  cfg.warmup_ratios = {0.25, 0.05};
  cfg.warmup_steps = 2;
  const int64_t n = 1000;
  RandomKCompressor comp(cfg, n);
  std::vector<float> g(n, 1.0f), out(n, 0.5f);
  Payload p;
  comp.encode(TensorView::cpu(g.data(), n), p);
  std::vector<uint8_t> b(p.data(), p.data() + p.size());
  comp.decode_add(b.data(), b.size(), TensorView::cpu(out.data(), n));  // the valid one decodes
  std::fill(out.begin(), out.end(), 0.5f);
  for (uint64_t step : {uint64_t{1} << 63, ~uint64_t{0}, (uint64_t{1} << 63) + 2}) {
    PayloadHeader h;
    std::memcpy(&h, b.data(), sizeof h);
    h.aux = step;
    std::memcpy(b.data(), &h, sizeof h);
    expect_invalid([&] { comp.decode_add(b.data(), b.size(), TensorView::cpu(out.data(), n)); },
                   "not a step count", "step 2^63 and above");
    for (float v : out) ASSERT_EQ(v, 0.5f) << "a rejected payload changed the output";
  }
  expect_invalid([&] { (void)cfg.ratio_at(-1); }, "step must be >= 0", "ratio_at(-1)");
  expect_invalid([&] { (void)cfg.ratio_at(std::numeric_limits<int64_t>::min()); },
                 "step must be >= 0", "ratio_at(INT64_MIN)");
  std::vector<uint32_t> idx(n);
  expect_invalid([&] { comp.indices_at(-3, idx.data()); }, "step must be >= 0", "indices_at(-3)");
}

// A plan that asks for every kind of collective with zero elements and null buffers.
class EmptyCollectivesPlan : public Plan {
 public:
  std::optional<Collective> next() override {
    if (i_ == 4) return std::nullopt;
    Collective c;
    c.kind = static_cast<CollectiveKind>(i_++);
    c.type = ElemType::kF32;
    return c;  // send = recv = nullptr, count = 0
  }
  std::string name() const override { return "empty"; }

 private:
  int i_ = 0;
};

TEST(ZeroLength, EmptyCollectivesAndIndexSectionsTouchNoPointer) {
  static_assert(static_cast<int>(CollectiveKind::kAllreduceSum) == 0 &&
                static_cast<int>(CollectiveKind::kBroadcast) == 3);
  EmptyCollectivesPlan a, b;
  const auto log = run_plans_in_process({&a, &b});
  EXPECT_EQ(log.size(), 4u);
  for (auto coding : {IndexCoding::kRaw32, IndexCoding::kDeltaVarint}) {
    encode_indices(nullptr, 0, 10, coding, nullptr);
    decode_indices(nullptr, 0, coding, 0, 10, nullptr);
  }
  decode_indices(nullptr, 0, IndexCoding::kNone, 0, 10, nullptr);
}

}  // namespace
}  // namespace gradcomp
