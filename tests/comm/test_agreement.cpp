// SPDX-License-Identifier: Apache-2.0
// Agreement across ranks, for every stateful family by name: a rank whose state is at another
// step (one rank's live load of an older checkpoint) or whose options differ must fail the step
// on every rank - never average values that do not belong together, never leave a peer waiting -
// with its state as before the step, and the job must train on in step once every rank holds the
// same state again. Then the step envelope itself (plans/envelope.hpp): both carriers against a
// direct comparison, at the limits of exact sums.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm_reference.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/make_plan.hpp"
#include "plans/envelope.hpp"

namespace gc = gradcomp;
using gc::test::rank_input;

namespace {

using Plans = std::vector<std::unique_ptr<gc::BucketPlan>>;

float load(const uint8_t* p, gc::ElemType t) {
  if (t == gc::ElemType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == gc::ElemType::kF16 ? gc::half_to_float(h) : gc::bf16_to_float(h);
}

void store(uint8_t* p, gc::ElemType t, float v) {
  if (t == gc::ElemType::kF32) {
    std::memcpy(p, &v, 4);
    return;
  }
  const uint16_t h = t == gc::ElemType::kF16 ? gc::float_to_half(v) : gc::float_to_bf16(v);
  std::memcpy(p, &h, 2);
}

/// One step of every rank's plan, driven by hand as ranks in separate processes would be: each
/// rank's next() runs whatever the others did, a rank that throws leaves the step, and the ranks
/// still running get their collective (sums in rank order, in fp32). Returns each rank's error
/// ("" when its step ended). A collective asked for by some ranks only - the others having
/// thrown or finished - would leave them waiting forever: reported as a failure.
/// `g`: each rank's bucket (the average comes back in it).
std::vector<std::string> step_each(Plans& plans, std::vector<std::vector<float>>& g) {
  const size_t P = plans.size();
  for (size_t r = 0; r < P; ++r)
    plans[r]->begin(gc::TensorView::cpu(g[r].data(), static_cast<int64_t>(g[r].size())));
  std::vector<std::string> err(P);
  std::vector<bool> running(P, true);
  for (int round = 0; round < 64; ++round) {
    std::vector<std::optional<gc::Collective>> cs(P);
    size_t asking = 0, alive = 0;
    for (size_t r = 0; r < P; ++r) {
      if (!running[r]) continue;
      try {
        cs[r] = plans[r]->next();
      } catch (const gc::InvalidArgument& e) {
        err[r] = e.what();
        running[r] = false;
        continue;
      }
      if (cs[r]) {
        ++asking;
      } else {
        running[r] = false;
      }
      ++alive;
    }
    if (asking == 0) return err;
    if (asking != P) {
      ADD_FAILURE() << asking << " of " << P << " ranks ask for a collective the others never join";
      return err;
    }
    const gc::Collective& c0 = *cs[0];
    for (size_t r = 1; r < P; ++r)
      if (cs[r]->kind != c0.kind || cs[r]->type != c0.type || cs[r]->count != c0.count) {
        ADD_FAILURE() << "rank " << r << " asks for another collective than rank 0 (" << c0.tag
                      << ")";
        return err;
      }
    const size_t es = gc::elem_size(c0.type), bytes = c0.count * es;
    auto src = [&](size_t r) { return static_cast<const uint8_t*>(cs[r]->send); };
    auto dst = [&](size_t r) { return static_cast<uint8_t*>(cs[r]->recv); };
    std::vector<std::vector<uint8_t>> sent(P);
    const size_t out = c0.kind == gc::CollectiveKind::kAllToAll ? bytes * P : bytes;
    for (size_t r = 0; r < P; ++r) sent[r].assign(src(r), src(r) + out);
    switch (c0.kind) {
      case gc::CollectiveKind::kAllreduceSum:
        for (size_t i = 0; i < c0.count; ++i) {
          float s = 0.0f;
          for (size_t r = 0; r < P; ++r) s += load(sent[r].data() + i * es, c0.type);
          for (size_t r = 0; r < P; ++r) store(dst(r) + i * es, c0.type, s);
        }
        break;
      case gc::CollectiveKind::kAllgather:
        for (size_t r = 0; r < P; ++r)
          for (size_t q = 0; q < P; ++q) std::memcpy(dst(r) + q * bytes, sent[q].data(), bytes);
        break;
      case gc::CollectiveKind::kAllToAll:
        for (size_t r = 0; r < P; ++r)
          for (size_t q = 0; q < P; ++q)
            std::memcpy(dst(r) + q * bytes, sent[q].data() + r * bytes, bytes);
        break;
      case gc::CollectiveKind::kBroadcast:
        for (size_t r = 0; r < P; ++r)
          std::memcpy(dst(r), sent[static_cast<size_t>(c0.root)].data(), bytes);
        break;
    }
  }
  ADD_FAILURE() << "the step did not end in 64 collectives";
  return err;
}

std::vector<std::string> step_each(Plans& plans, int64_t n, int64_t step) {
  std::vector<std::vector<float>> g(plans.size());
  for (size_t r = 0; r < g.size(); ++r) g[r] = rank_input(n, static_cast<int>(r), step);
  return step_each(plans, g);
}

/// Options that make the families send what they compress (no dense start, no warm-up).
gc::PlanOptions options_of(const std::string& name) {
  if (name == "topk") return {{"ratio", 0.05}, {"route", std::string("dense")}};
  if (name == "randomk") return {{"ratio", 0.05}};
  if (name == "powersgd") return {{"rank", int64_t{2}}};
  return {};
}

gc::BucketSpec spec(int64_t n, int world, int rank) {
  gc::BucketSpec b;
  b.numel = n;
  b.world = world;
  b.rank = rank;
  b.bucket_id = 1;
  if (n == 6000) b.shapes = {{50, 100}, {1000}};
  return b;
}

Plans make(const std::string& name, int64_t n, int P, const gc::PlanOptions& o) {
  Plans plans;
  for (int r = 0; r < P; ++r) plans.push_back(gc::make_plan(name, spec(n, P, r), o));
  return plans;
}

std::vector<std::string> stateful_families() {
  std::vector<std::string> out;
  for (const std::string& name : gc::plan_names())
    if (gc::plan_is_stateful(name)) out.push_back(name);
  return out;
}

}  // namespace

TEST(Agreement, EveryStatefulFamilyToldOfARankAtAnotherStepOnEveryRank) {
  const auto families = stateful_families();
  for (const char* must : {"topk", "randomk", "onebit", "quant", "powersgd"})
    ASSERT_NE(std::find(families.begin(), families.end(), must), families.end()) << must;
  const int P = 3;
  const int64_t n = 6000;
  for (const std::string& name : families) {
    SCOPED_TRACE(name);
    Plans plans = make(name, n, P, options_of(name));
    for (int64_t s = 0; s < 2; ++s)
      for (const auto& e : step_each(plans, n, s)) ASSERT_EQ(e, "");
    const auto older = plans[1]->state_dict();
    for (int64_t s = 2; s < 4; ++s)
      for (const auto& e : step_each(plans, n, s)) ASSERT_EQ(e, "");
    const auto now = plans[1]->state_dict();
    plans[1]->load_state_dict(older.data(), older.size());  // rank 1 two steps behind, alone
    std::vector<std::vector<uint8_t>> before;
    for (auto& p : plans) before.push_back(p->state_dict());
    const auto errors = step_each(plans, n, 4);
    for (int r = 0; r < P; ++r) {
      EXPECT_NE(errors[r].find("different steps"), std::string::npos)
          << "rank " << r << ": " << (errors[r].empty() ? "(the step was accepted)" : errors[r]);
      EXPECT_EQ(plans[r]->state_dict(), before[r]) << "rank " << r << " changed its state";
    }
    // rank 1 takes the job's state back: the job trains on, in step
    plans[1]->load_state_dict(now.data(), now.size());
    for (const auto& e : step_each(plans, n, 5)) EXPECT_EQ(e, "");
    EXPECT_NE(plans[0]->state_dict(), before[0]) << "the step after the restore changed nothing";
  }
}

// The envelope rides on the same first collective as a bad rank's news (NaN values, scales or
// P, or a flag): one rank's NaN or Inf - what an fp16 overflow hands DDP - must still end the
// step alike on every rank, skipped (NaN average everywhere), nothing raised, no state changed,
// and the next clean step must run in step on every rank.
TEST(Agreement, EveryStatefulFamilySkipsOneRanksOverflowOnEveryRank) {
  const int P = 3;
  const int64_t n = 6000;
  for (const std::string& name : stateful_families())
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      SCOPED_TRACE(name + (std::isnan(bad) ? " NaN" : " Inf"));
      Plans plans = make(name, n, P, options_of(name));
      for (int64_t s = 0; s < 2; ++s)
        for (const auto& e : step_each(plans, n, s)) ASSERT_EQ(e, "");
      std::vector<std::vector<uint8_t>> before;
      for (auto& p : plans) before.push_back(p->state_dict());
      std::vector<std::vector<float>> g(P);
      for (int r = 0; r < P; ++r) g[r] = rank_input(n, r, 2);
      g[1][4321] = bad;  // rank 1's gradient overflowed
      const auto errors = step_each(plans, g);
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(errors[r], "") << "rank " << r;
        EXPECT_TRUE(plans[r]->skipped()) << "rank " << r;
        EXPECT_EQ(plans[r]->state_dict(), before[r]) << "rank " << r << " changed its state";
        EXPECT_TRUE(std::isnan(g[r][0])) << "rank " << r << ": the average is not NaN";
      }
      std::vector<std::vector<float>> h(P);
      for (int r = 0; r < P; ++r) h[r] = rank_input(n, r, 3);
      for (const auto& e : step_each(plans, h)) EXPECT_EQ(e, "");
      for (int r = 0; r < P; ++r) {
        EXPECT_FALSE(plans[r]->skipped()) << "rank " << r;
        EXPECT_EQ(h[r], h[0]) << "rank " << r << " ended the clean step with another average";
      }
    }
}

// The two families that carried no agreement check before the envelope: another option on one
// rank (its collectives keep their sizes) is an error on every rank, not a wrong average.
TEST(Agreement, OneBitAndPowerSGDToldOfOtherOptionsOnEveryRank) {
  const int P = 3;
  const int64_t n = 6000;
  struct Case {
    std::string name;
    gc::PlanOptions same, other;
  };
  const std::vector<Case> cases = {
      {"onebit", {}, {{"momentum", 0.9}}},
      {"onebit", {}, {{"scaling", std::string("sign_l1")}}},
      {"powersgd", {{"rank", int64_t{2}}}, {{"rank", int64_t{2}}, {"seed", int64_t{7}}}},
      {"powersgd", {{"rank", int64_t{2}}}, {{"rank", int64_t{2}}, {"warm_start", false}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Plans plans = make(c.name, n, P, c.same);
    plans[2] = gc::make_plan(c.name, spec(n, P, 2), c.other);
    std::vector<std::vector<uint8_t>> before;
    for (auto& p : plans) before.push_back(p->state_dict());
    const auto errors = step_each(plans, n, 0);
    for (int r = 0; r < P; ++r) {
      EXPECT_NE(errors[r].find("the options differ across ranks"), std::string::npos)
          << "rank " << r << ": " << (errors[r].empty() ? "(the step was accepted)" : errors[r]);
      EXPECT_EQ(plans[r]->state_dict(), before[r]) << "rank " << r;
    }
  }
}

// The summed carrier: the verdict of P ranks' slots summed in rank order must be what comparing
// the envelopes directly says, in every value dtype, up to the largest P whose 0/1 sums are exact
// (beyond it the steps and options are not compared, the flag still is).
TEST(StepEnvelope, SummedSlotsTellWhatTheRanksDisagreeOn) {
  using gc::DType;
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const int limit = t == DType::kFloat32 ? 4096 : t == DType::kFloat16 ? 2048 : 256;
    for (int P : {1, 2, 3, 7, limit, limit + 1}) {
      SCOPED_TRACE(std::string(gc::dtype_name(t)) + " P=" + std::to_string(P));
      const bool exact = P > 1 && (t == DType::kFloat32 || P <= limit);
      EXPECT_EQ(gc::detail::sum_envelope_exact(t, P), exact);
      // every rank alike, then one rank at another step, with other options, flagged
      for (int variant = 0; variant < 4; ++variant) {
        std::vector<float> sum(gc::detail::kSumEnvelopeSlots, 0.0f);
        const size_t es = gc::dtype_size(t);
        for (int r = 0; r < P; ++r) {
          gc::detail::StepEnvelope e{int64_t{1} << 33 | 12345, 0xdeadbeefu, false};
          if (r == P - 1 && variant == 1) e.step += 1;
          if (r == P - 1 && variant == 2) e.options ^= 0x80000000u;
          if (r == P - 1 && variant == 3) e.flag = true;
          const auto bytes = gc::detail::sum_envelope(e, t, P);
          ASSERT_EQ(bytes.size(), gc::detail::kSumEnvelopeSlots * es);
          for (size_t i = 0; i < sum.size(); ++i)
            sum[i] += load(bytes.data() + i * es, static_cast<gc::ElemType>(t));
        }
        std::vector<uint8_t> summed(sum.size() * es);
        for (size_t i = 0; i < sum.size(); ++i)
          store(summed.data() + i * es, static_cast<gc::ElemType>(t), sum[i]);
        const auto v = gc::detail::read_sum_envelope(summed.data(), t, P);
        EXPECT_EQ(v.step_differs, exact && variant == 1 && P > 1);
        EXPECT_EQ(v.options_differ, exact && variant == 2 && P > 1);
        EXPECT_EQ(v.flagged, variant == 3);
      }
    }
  }
}

// The gathered carrier: every receiver compares all P envelopes; a block without the magic (not
// written by a peer of this kind) counts as other options; the flag rides in the step's top bit.
TEST(StepEnvelope, GatheredEnvelopesCompareStepOptionsAndFlag) {
  for (int P : {1, 2, 5}) {
    SCOPED_TRACE(P);
    const size_t stride = 40;  // envelopes inside larger blocks
    for (int variant = 0; variant < 5; ++variant) {
      std::vector<uint8_t> blocks(stride * P, 0xab);
      for (int r = 0; r < P; ++r) {
        gc::detail::StepEnvelope e{77, 0x1234u, false};
        const bool last = r == P - 1;
        if (last && variant == 1) e.step = 78;
        if (last && variant == 2) e.options = 0x1235u;
        if (last && variant == 3) e.flag = true;
        gc::detail::ByteEnvelope b = gc::detail::byte_envelope(e);
        if (last && variant == 4) b.magic = 0;
        std::memcpy(blocks.data() + r * stride, &b, sizeof(b));
      }
      const auto v = gc::detail::read_byte_envelopes(blocks.data(), stride, P);
      EXPECT_EQ(v.step_differs, variant == 1 && P > 1);
      EXPECT_EQ(v.options_differ, (variant == 2 && P > 1) || variant == 4);
      EXPECT_EQ(v.flagged, variant == 3);
    }
  }
}
