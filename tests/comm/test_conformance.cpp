// SPDX-License-Identifier: Apache-2.0
// What every family promises, checked for every registered family by name (family_traits(): a
// family added to the registry is covered without a line here): on 1-4 ranks and buckets of 0, 1,
// odd and large sizes, in every form it has, every rank ends with the same bits and finite values
// from finite gradients; one rank's NaN reaches every rank at that position (a stateless family
// carries it, a stateful one skips the step, which fills the bucket with NaN); unknown options are
// refused; a stateful family's checkpoint, loaded into fresh plans, continues bitwise, a corrupt
// one is refused and changes nothing, and resharding keeps as many ranks bitwise and moves (or
// refuses, with a reason) another number.
//
// Where a family has an independent reference, its result is compared with it (`references`
// below): the fp8 family's is a brute-force encoder over the formats' 256 codes, written from the
// OCP 8-bit float definitions without the library's bit manipulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm_reference.hpp"
#include "core/crc32c.hpp"
#include "core/state_io.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/plan.hpp"
#include "kernels/fp8_kernels.hpp"
#include "plans/family.hpp"

namespace gc = gradcomp;
using gc::test::rank_input;

namespace {

using Plans = std::vector<std::unique_ptr<gc::BucketPlan>>;
using Buckets = std::vector<std::vector<float>>;

gc::BucketSpec spec(int64_t n, int P, int r) {
  gc::BucketSpec b;
  b.numel = n;
  b.world = P;
  b.rank = r;
  return b;
}

Plans make(const std::string& name, int64_t n, int P, gc::PlanForm form,
           const gc::PlanOptions& o = {}) {
  Plans p;
  for (int r = 0; r < P; ++r)
    p.push_back(form == gc::PlanForm::kAllreduce
                    ? gc::make_plan(name, spec(n, P, r), o)
                    : gc::make_shard_plan(name, spec(n, P, r), form, o));
  return p;
}

void step(Plans& p, Buckets& g) {
  std::vector<gc::Plan*> raw;
  for (size_t r = 0; r < p.size(); ++r) {
    p[r]->begin(gc::TensorView::cpu(g[r].data(), static_cast<int64_t>(g[r].size())));
    raw.push_back(p[r].get());
  }
  gc::run_plans_in_process(raw);
}

Buckets inputs(int64_t n, int P, int64_t s) {
  Buckets g;
  for (int r = 0; r < P; ++r) g.push_back(rank_input(n, r, s));
  return g;
}

// The plans of P ranks (make()) after `steps` steps, on inputs(n, P, s) at step s.
Plans trained(const std::string& name, int64_t n, int P, gc::PlanForm form,
              const gc::PlanOptions& o, int64_t steps) {
  auto plans = make(name, n, P, form, o);
  for (int64_t s = 0; s < steps; ++s) {
    auto g = inputs(n, P, s);
    step(plans, g);
  }
  return plans;
}

// The head of the per-rank plan states (two-phase, sharded): rank 1 of P, n elements.
void expect_rank_head(gc::detail::StateReader& r, int64_t n, int P) {
  EXPECT_EQ(r.get<int64_t>("numel"), n);
  EXPECT_EQ(r.get<int32_t>("world"), P);
  EXPECT_EQ(r.get<int32_t>("rank"), 1);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b, size_t from, size_t to) {
  return to <= from || std::memcmp(a.data() + from, b.data() + from, (to - from) * 4) == 0;
}

// ---- fp8: the independent reference --------------------------------------------------------
/// The value of code c by the format's definition, in double.
double fp8_ref_value(int c, bool e5m2) {
  const int M = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7, emax = e5m2 ? 31 : 15;
  const int e = (c >> M) & emax, m = c & ((1 << M) - 1);
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  if (e5m2 && e == 31) return m ? std::nan("") : sign * HUGE_VAL;
  if (!e5m2 && e == 15 && m == 7) return std::nan("");
  return sign *
         (e == 0 ? std::ldexp(m, 1 - bias - M) : std::ldexp(1.0 + m / double(1 << M), e - bias));
}

/// The code nearest x among the finite codes of x's sign (ties: the even code), by search.
int fp8_ref_code(float x, bool e5m2) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  const int largest = e5m2 ? 0x7b : 0x7e;
  if (a >= fp8_ref_value(largest, e5m2)) return sign | largest;  // saturation
  static const auto table = [](bool f) {  // the non-negative codes' values, computed once
    std::vector<double> t(128);
    for (int c = 0; c < 128; ++c) t[c] = fp8_ref_value(c, f);
    return t;
  };
  static const std::vector<double> values[2] = {table(false), table(true)};
  int best = -1;
  double dist = HUGE_VAL;
  for (int c = 0; c < 128; ++c) {
    const double v = values[e5m2][c];
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(v - a);
    if (d < dist || (d == dist && (c & 1) == 0)) {
      best = c;
      dist = d;
    }
  }
  return sign | best;
}

/// A block's values after encoding and decoding (the reference of one record).
void fp8_ref_block(const float* x, int B, bool e5m2, float* out) {
  float amax = 0;
  bool finite = true;
  for (int j = 0; j < B; ++j) {
    if (!std::isfinite(x[j]))
      finite = false;
    else
      amax = std::max(amax, std::fabs(x[j]));
  }
  const float s = finite ? amax / static_cast<float>(fp8_ref_value(e5m2 ? 0x7b : 0x7e, e5m2))
                         : std::numeric_limits<float>::quiet_NaN();
  for (int j = 0; j < B; ++j) {
    const int c = s > 0 ? fp8_ref_code(x[j] / s, e5m2) : 0;
    out[j] = static_cast<float>(fp8_ref_value(c, e5m2)) * s;
  }
}

/// Each rank's n values in blocks of B (zero-padded to `blocks` blocks), encoded and decoded.
Buckets fp8_ref_decoded(const Buckets& in, size_t first, size_t n, size_t blocks, int B,
                        bool e5m2) {
  Buckets out;
  for (const auto& v : in) {
    std::vector<float> x(blocks * B, 0.0f), d(blocks * B);
    std::copy(v.begin() + first, v.begin() + first + n, x.begin());
    for (size_t b = 0; b < blocks; ++b) fp8_ref_block(&x[b * B], B, e5m2, &d[b * B]);
    out.push_back(d);
  }
  return out;
}

std::vector<float> rank_ordered(const Buckets& d, float divisor) {
  std::vector<float> s(d[0].size());
  for (size_t i = 0; i < s.size(); ++i) {
    float acc = d[0][i];
    for (size_t r = 1; r < d.size(); ++r) acc = acc + d[r][i];
    s[i] = acc / divisor;
  }
  return s;
}

/// What every rank's bucket holds after the fp8 plan of `form` (reduce-scatter: rank r's chunk r).
Buckets fp8_reference(const Buckets& in, gc::PlanForm form, const gc::PlanOptions& o) {
  const bool e5m2 = std::get<std::string>(o.at("format")) == "e5m2";
  const int B = static_cast<int>(std::get<int64_t>(o.at("block_size")));
  const size_t P = in.size(), n = in[0].size();
  const auto blocks = [&](size_t m) { return (m + B - 1) / B; };
  Buckets out = in;
  if (form == gc::PlanForm::kAllreduce) {
    const std::string route = std::get<std::string>(o.at("route"));
    if (route == "gather" || (route == "auto" && P <= 2)) {
      const auto s = rank_ordered(fp8_ref_decoded(in, 0, n, blocks(n), B, e5m2), float(P));
      for (auto& v : out) std::copy(s.begin(), s.begin() + n, v.begin());
      return out;
    }
    const size_t cb = (blocks(n) + P - 1) / P, c = cb * B;
    const auto avg = rank_ordered(fp8_ref_decoded(in, 0, n, cb * P, B, e5m2), float(P));
    const auto again = fp8_ref_decoded({avg}, 0, c * P, cb * P, B, e5m2)[0];
    for (auto& v : out) std::copy(again.begin(), again.begin() + n, v.begin());
    (void)c;
    return out;
  }
  const size_t c = n / P;
  for (size_t r = 0; r < P; ++r) {
    Buckets chunk;
    for (const auto& v : in)
      chunk.push_back(std::vector<float>(v.begin() + r * c, v.begin() + (r + 1) * c));
    if (form == gc::PlanForm::kReduceScatter) {
      const bool average = std::get<bool>(o.at("average"));
      const auto s =
          rank_ordered(fp8_ref_decoded(chunk, 0, c, blocks(c), B, e5m2), average ? float(P) : 1.0f);
      std::copy(s.begin(), s.begin() + c, out[r].begin() + r * c);
    } else {
      const auto d = fp8_ref_decoded({in[r]}, r * c, c, blocks(c), B, e5m2)[0];
      for (auto& v : out) std::copy(d.begin(), d.begin() + c, v.begin() + r * c);
    }
  }
  return out;
}

/// Families with an independent reference: every rank's expected bucket (for a reduce-scatter,
/// only chunk r of rank r is compared).
using Reference = std::function<Buckets(const Buckets&, gc::PlanForm, const gc::PlanOptions&)>;
const std::map<std::string, Reference>& references() {
  static const std::map<std::string, Reference> r = {{"fp8", fp8_reference}};
  return r;
}

std::vector<gc::PlanForm> forms_of(const gc::FamilyTraits& t) {
  std::vector<gc::PlanForm> f = {gc::PlanForm::kAllreduce};
  for (const gc::PlanForm s : t.shard_forms) f.push_back(s);
  return f;
}

gc::PlanOptions defaults_of(const std::string& name, gc::PlanForm form) {
  return form == gc::PlanForm::kAllreduce ? gc::plan_defaults(name)
                                          : gc::shard_plan_defaults(name, form);
}

/// The part of rank r's bucket a form defines: the whole bucket, or chunk r for a reduce-scatter.
std::pair<size_t, size_t> defined(gc::PlanForm form, size_t n, size_t P, size_t r) {
  if (form != gc::PlanForm::kReduceScatter) return {0, n};
  return {r * (n / P), (r + 1) * (n / P)};
}

std::string form_name(gc::PlanForm f) { return std::string(gc::enum_name(f)); }

/// Options beyond a family's defaults that change what its allreduce sends, each run as a case of
/// its own: top-k's coded values (the multi-bit codec inside a sparse payload); quant by each of
/// its routes on every rank count (its default takes the gather route on 2 ranks only).
const std::map<std::string, std::vector<gc::PlanOptions>>& variants() {
  static const std::map<std::string, std::vector<gc::PlanOptions>> v = {
      {"topk", {{{"value_bits", int64_t{2}}, {"value_block", int64_t{32}}}}},
      {"quant", {{{"route", std::string("two_phase")}}, {{"route", std::string("gather")}}}}};
  return v;
}

/// What the suite runs: every registered family in every form it has with its defaults, and its
/// allreduce with each of its variants.
struct Case {
  std::string name;
  gc::PlanForm form;
  gc::PlanOptions options;
  std::string label;
};
std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& t : gc::family_traits())
    for (const gc::PlanForm form : forms_of(t)) {
      out.push_back({t.name, form, {}, t.name + " " + form_name(form)});
      const auto v = variants().find(t.name);
      if (form != gc::PlanForm::kAllreduce || v == variants().end()) continue;
      for (const auto& o : v->second) {
        std::string label = t.name + " " + form_name(form);
        for (const auto& [k, x] : o)
          label += " " + k + "=" +
                   (std::holds_alternative<std::string>(x) ? std::get<std::string>(x)
                                                           : std::to_string(std::get<int64_t>(x)));
        out.push_back({t.name, form, o, label});
      }
    }
  return out;
}

// make() and trained() for one of cases().
Plans make(const Case& c, int64_t n, int P) { return make(c.name, n, P, c.form, c.options); }
Plans trained(const Case& c, int64_t n, int P, int64_t steps) {
  return trained(c.name, n, P, c.form, c.options, steps);
}

}  // namespace

TEST(Conformance, EveryFamilyEveryFormEverySizeAgreesAcrossRanks) {
  for (const Case& c : cases())
    for (const gc::PlanForm form : {c.form})
      for (const int P : {1, 2, 3, 4})
        for (const int64_t base :
             {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{25001}}) {
          // a shard form's bucket is P equal chunks
          const int64_t n = form == gc::PlanForm::kAllreduce ? base : base * P;
          SCOPED_TRACE(c.label + " P=" + std::to_string(P) + " n=" + std::to_string(n));
          auto plans = make(c, n, P);
          auto o = defaults_of(c.name, form);
          for (const auto& [k, x] : c.options) o[k] = x;
          for (int64_t s = 0; s < 3; ++s) {
            auto g = inputs(n, P, s);
            const auto in = g;
            step(plans, g);
            const auto un = static_cast<size_t>(n);
            for (int r = 0; r < P; ++r) {
              const auto [lo, hi] = defined(form, un, P, r);
              for (size_t i = lo; i < hi; ++i)
                ASSERT_TRUE(std::isfinite(g[r][i])) << "rank " << r << " element " << i;
              if (form != gc::PlanForm::kReduceScatter)
                ASSERT_TRUE(same_bits(g[r], g[0], 0, un)) << "rank " << r << " step " << s;
            }
            const auto ref = references().find(c.name);
            if (ref == references().end()) continue;
            const auto want = ref->second(in, form, o);
            for (int r = 0; r < P; ++r) {
              const auto [lo, hi] = defined(form, un, P, r);
              ASSERT_TRUE(same_bits(g[r], want[r], lo, hi))
                  << "rank " << r << " step " << s << " differs from the reference";
            }
          }
        }
}

TEST(Conformance, OneRanksNaNReachesEveryRank) {
  for (const Case& c : cases()) {
    const gc::PlanForm form = c.form;
    if (form == gc::PlanForm::kAllgather) continue;  // parameters are gathered, not summed
    const int P = 3;
    const int64_t n = 3 * 700;
    SCOPED_TRACE(c.label);
    auto plans = make(c, n, P);
    for (int64_t s = 0; s < 2; ++s) {  // a clean step first: state to keep
      auto g = inputs(n, P, s);
      const size_t bad = 2 * 700 + 11;  // in rank 2's chunk: its owner in a reduce-scatter
      if (s == 1) g[1][bad] = std::numeric_limits<float>::quiet_NaN();
      step(plans, g);
      for (int r = 0; r < P; ++r) {
        const auto [lo, hi] = defined(form, static_cast<size_t>(n), P, r);
        if (s == 1 && bad >= lo && bad < hi) EXPECT_TRUE(std::isnan(g[r][bad])) << "rank " << r;
        if (form != gc::PlanForm::kReduceScatter)
          EXPECT_TRUE(same_bits(g[r], g[0], 0, static_cast<size_t>(n))) << "rank " << r;
      }
    }
  }
}

TEST(Conformance, UnknownOptionsAreRefusedNamingThem) {
  for (const auto& t : gc::family_traits())
    for (const gc::PlanForm form : forms_of(t)) {
      SCOPED_TRACE(t.name + " " + form_name(form));
      try {
        make(t.name, 8, 2, form, {{"no_such_option", true}});
        ADD_FAILURE() << "accepted an unknown option";
      } catch (const gc::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("no_such_option"), std::string::npos) << e.what();
      }
    }
}

TEST(Conformance, CheckpointsContinueBitwise) {
  for (const Case& c : cases()) {
    const int P = 2;
    const int64_t n = 2 * 3001;
    SCOPED_TRACE(c.label);
    auto plans = trained(c, n, P, 3);
    auto fresh = make(c, n, P);
    for (int r = 0; r < P; ++r) {
      const auto st = plans[r]->state_dict();
      EXPECT_EQ(st.empty(), !plans[r]->stateful());
      if (!st.empty()) fresh[r]->load_state_dict(st.data(), st.size());
    }
    auto a = inputs(n, P, 3), b = a;
    step(plans, a);
    step(fresh, b);
    for (int r = 0; r < P; ++r)
      EXPECT_TRUE(same_bits(a[r], b[r], 0, static_cast<size_t>(n))) << "rank " << r;
  }
}

TEST(Conformance, ACorruptCheckpointIsRefusedAndChangesNothing) {
  int checked = 0;
  for (const Case& c : cases()) {
    const int P = 2;
    const int64_t n = 2 * 1001;
    SCOPED_TRACE(c.label);
    auto plans = trained(c, n, P, 1);
    const auto good = plans[0]->state_dict();
    if (good.empty()) continue;  // nothing to corrupt
    auto other = make(c, n, P);  // at step 0: what a refused load must leave
    const auto before = other[0]->state_dict();
    for (const size_t at : {size_t{0}, good.size() / 2, good.size() - 1}) {
      auto bad = good;
      bad[at] ^= 0x10;
      EXPECT_THROW(other[0]->load_state_dict(bad.data(), bad.size()), gc::InvalidArgument)
          << "byte " << at;
      EXPECT_EQ(other[0]->state_dict(), before) << "byte " << at;
    }
    EXPECT_THROW(other[0]->load_state_dict(good.data(), good.size() - 3), gc::InvalidArgument);
    EXPECT_EQ(other[0]->state_dict(), before);
    // past the checksum: the last fp32 of the last array made NaN, or the last 4 bytes cut,
    // each with a checksum that matches, so the fields themselves must be checked
    const auto resealed = [](std::vector<uint8_t> v) {
      const uint32_t crc = gc::detail::crc32c(v.data(), v.size() - 4);
      std::memcpy(v.data() + v.size() - 4, &crc, 4);
      return v;
    };
    auto nan = good;
    ASSERT_GE(nan.size(), 16u);
    const float q = std::numeric_limits<float>::quiet_NaN();
    uint32_t qbits;
    std::memcpy(&qbits, &q, 4);
    for (size_t b = 0; b < 4; ++b)  // little-endian, as states are written
      nan.at(nan.size() - 8 + b) = static_cast<uint8_t>(qbits >> (8 * b));
    nan = resealed(nan);
    EXPECT_THROW(other[0]->load_state_dict(nan.data(), nan.size()), gc::InvalidArgument);
    EXPECT_EQ(other[0]->state_dict(), before);
    auto cut = good;
    cut.erase(cut.end() - 8, cut.end() - 4);
    cut = resealed(cut);
    EXPECT_THROW(other[0]->load_state_dict(cut.data(), cut.size()), gc::InvalidArgument);
    EXPECT_EQ(other[0]->state_dict(), before);
    other[0]->load_state_dict(good.data(), good.size());  // the intact one loads
    EXPECT_EQ(other[0]->state_dict(), good);
    ++checked;
  }
  EXPECT_GE(checked, 5) << "the stateful families' forms were not all reached";
}

TEST(Conformance, ResharingKeepsAsManyRanksBitwiseAndMovesOrRefusesOthers) {
  // reshard_state on as many ranks gives each rank its own bytes; on another world size it gives
  // states that load into that many ranks' plans and train on in step, or refuses with a reason
  int moved_forms = 0, rewritten = 0;
  for (const Case& c : cases()) {
    const gc::PlanForm form = c.form;
    const int P = 2;
    const int64_t n = 6 * 500;  // P equal chunks for 2 and 3 ranks
    SCOPED_TRACE(c.label);
    auto plans = trained(c, n, P, 3);
    std::vector<std::vector<uint8_t>> states;
    for (auto& p : plans) states.push_back(p->state_dict());
    if (states[0].empty()) continue;  // stateless: nothing to reshard
    for (int r = 0; r < P; ++r) EXPECT_EQ(gc::reshard_state(states, P, r), states[r]);
    {  // the family's own resharding (reshard_state hands back a rank's own bytes on as many
       // ranks without calling it) from one rank to one: its parse and rewrite lose nothing
      auto one = make(c, n, 1);
      auto g1 = inputs(n, 1, 0);
      step(one, g1);
      const auto st = one[0]->state_dict();
      const std::string kind = gc::detail::StateReader(st.data(), st.size()).kind();
      const auto* k = gc::detail::state_kind(kind);
      ASSERT_NE(k, nullptr) << kind;
      const auto again = k->reshard({st}, 1, 0);  // {}: "the caller's own bytes" (allowed)
      if (!again.empty()) {
        EXPECT_EQ(again, st) << kind;
        ++rewritten;
      }
    }
    const int Q = 3;
    std::vector<std::vector<uint8_t>> moved;
    try {
      for (int r = 0; r < Q; ++r) moved.push_back(gc::reshard_state(states, Q, r));
    } catch (const gc::InvalidArgument& e) {
      EXPECT_FALSE(std::string(e.what()).empty());
      continue;  // refused with a reason (a sharded job's state belongs to its world size)
    }
    auto resumed = make(c, n, Q);
    for (int r = 0; r < Q; ++r) resumed[r]->load_state_dict(moved[r].data(), moved[r].size());
    auto g = inputs(n, Q, 3);
    step(resumed, g);
    for (int r = 0; r < Q; ++r) {
      const auto [lo, hi] = defined(form, static_cast<size_t>(n), Q, r);
      for (size_t i = lo; i < hi; ++i) ASSERT_TRUE(std::isfinite(g[r][i])) << r << " " << i;
      if (form != gc::PlanForm::kReduceScatter)
        EXPECT_TRUE(same_bits(g[r], g[0], 0, static_cast<size_t>(n))) << "rank " << r;
    }
    ++moved_forms;
  }
  EXPECT_GE(moved_forms, 5) << "every stateful family's allreduce state moves to 3 ranks";
  EXPECT_GE(rewritten, 5) << "every allreduce state's resharding rewrites a state";
}

TEST(StateLayouts, TwoPhaseStatesKeepTheirFieldOrderAndSizes) {
  // the 1-bit and quant states are written from a declared schema (core/state_schema.hpp); read
  // here field by field in the order and widths their checkpoints have always had, so states
  // saved before stay loadable and a reordered schema fails this
  const int P = 2;
  const int64_t n = 1000;
  for (const bool momentum : {false, true}) {
    auto plans =
        trained("onebit", n, P, gc::PlanForm::kAllreduce, {{"momentum", momentum ? 0.9 : 0.0}}, 1);
    const auto st = plans[1]->state_dict();
    gc::detail::StateReader r(st.data(), st.size(), "onebit-allreduce");
    expect_rank_head(r, n, P);
    r.get<uint8_t>("scaling");
    EXPECT_EQ(r.get<uint8_t>("error_feedback"), 1);
    EXPECT_EQ(r.get<int64_t>("block_size"), 128);
    EXPECT_EQ(r.get<uint8_t>("has_momentum"), momentum ? 1 : 0);
    EXPECT_EQ(r.get<uint8_t>("rotate"), 1);
    EXPECT_EQ(r.get_step(), 1);
    r.finite_array("worker_error", n * 4);
    r.finite_array("server_error", 512 * 4);  // 1000 over 2 ranks in blocks of 128: 4 blocks
    if (momentum) r.finite_array("momentum", n * 4);
    r.finish();
  }
  for (const gc::PlanForm form : {gc::PlanForm::kAllreduce, gc::PlanForm::kReduceScatter}) {
    auto plans = trained("quant", n, P, form, {}, 1);
    const auto st = plans[1]->state_dict();
    const bool ar = form == gc::PlanForm::kAllreduce;
    gc::detail::StateReader r(st.data(), st.size(),
                              ar ? "quant-allreduce" : "quant-reduce-scatter");
    expect_rank_head(r, n, P);
    EXPECT_EQ(r.get<uint8_t>("bits"), 4);
    EXPECT_EQ(r.get<int64_t>("block_size"), 128);
    r.get<uint8_t>("rounding");
    r.get<uint8_t>("scale");
    r.get<uint8_t>("scale_dtype");
    r.get<uint8_t>("error_feedback");
    r.get<uint8_t>("rotate");
    r.get<uint64_t>("seed");
    EXPECT_EQ(r.get_step(), 1);
    r.finite_array("worker_error", n * 4);
    if (ar) r.finite_array("server_error", 512 * 4);
    r.finish();
  }
}

TEST(StateLayouts, SparsifierStatesKeepTheirFieldOrderAndSizes) {
  // top-k's and random-k's states are written from a declared schema too (compressors/
  // sparsify_state.cpp); read here field by field as the codecs wrote them by hand before
  const int P = 2;
  const int64_t n = 1000;
  for (const std::string fam : {"topk", "randomk"})
    for (const bool momentum : {false, true}) {
      SCOPED_TRACE(fam + (momentum ? " momentum" : ""));
      auto plans =
          trained(fam, n, P, gc::PlanForm::kAllreduce, {{"momentum", momentum ? 0.9 : 0.0}}, 1);
      const auto st = plans[1]->state_dict();
      gc::detail::StateReader r(st.data(), st.size(), fam);
      EXPECT_EQ(r.get<int64_t>("numel"), n);
      EXPECT_EQ(r.get_step(), 1);
      EXPECT_EQ(r.get<uint8_t>("has_momentum"), momentum ? 1 : 0);
      EXPECT_EQ(r.get<uint32_t>("tensor_id"), 0u);
      r.finite_array("residual", n * 4);
      if (momentum) r.finite_array("momentum", n * 4);
      r.finish();
    }
}

TEST(StateLayouts, SparsifierStatesWrittenByHandLoadAndReshardToTheSameBytes) {
  // a state in the layout the codecs wrote by hand (numel i64, step i64, has_momentum u8,
  // tensor_id u32, residual, momentum when there is one) loads and saves back to the same bytes,
  // and two ranks' states reshard to the hand-written state of their means; tensor_id has its
  // top bit set, so a u32 that went through a signed or wider field would show
  const int64_t n = 5;
  const uint32_t tid = 0x80000003u;
  const auto by_hand = [&](const std::string& kind, int64_t step, bool momentum, float v0,
                           float u0) {
    gc::detail::StateWriter w(kind);
    w.put<int64_t>(n);
    w.put<int64_t>(step);
    w.put<uint8_t>(momentum ? 1 : 0);
    w.put<uint32_t>(tid);
    std::vector<float> v, u;
    for (int64_t i = 0; i < n; ++i) {
      v.push_back(v0 + 0.25f * static_cast<float>(i));
      u.push_back(u0 - 0.5f * static_cast<float>(i));
    }
    w.put_floats(v);
    if (momentum) w.put_floats(u);
    return w.take();
  };
  for (const std::string fam : {"topk", "randomk"})
    for (const bool momentum : {false, true}) {
      SCOPED_TRACE(fam + (momentum ? " momentum" : ""));
      gc::BucketSpec b = spec(n, 2, 1);
      b.bucket_id = tid;
      auto plan = gc::make_plan(fam, b, {{"momentum", momentum ? 0.9 : 0.0}});
      const auto st = by_hand(fam, 7, momentum, 1.0f, -2.0f);
      plan->load_state_dict(st.data(), st.size());
      EXPECT_EQ(plan->state_dict(), st);
      // means exact in fp32: (1 + 2) / 2 and (-2 + 4) / 2, element by element
      const std::vector<std::vector<uint8_t>> two = {by_hand(fam, 7, momentum, 1.0f, -2.0f),
                                                     by_hand(fam, 7, momentum, 2.0f, 4.0f)};
      const auto want = by_hand(fam, 7, momentum, 1.5f, 1.0f);
      for (int q = 0; q < 3; ++q) EXPECT_EQ(gc::reshard_state(two, 3, q), want) << q;
      const auto* k = gc::detail::state_kind(fam);
      ASSERT_NE(k, nullptr);
      EXPECT_EQ(k->reshard(two, 2, 0), want);  // the family's own, on as many ranks
      EXPECT_EQ(k->reshard({st}, 1, 0), st);
    }
}

TEST(StateLayouts, AnEmptySparsifierBucketWithMomentumHasNoMomentumArray) {
  // an empty bucket's momentum buffer is never allocated: its state says has_momentum 1 and has
  // no momentum array, as the codecs have always written it; it loads, and reshards to itself
  for (const std::string fam : {"topk", "randomk"}) {
    SCOPED_TRACE(fam);
    gc::detail::StateWriter w(fam);
    w.put<int64_t>(0);
    w.put<int64_t>(4);
    w.put<uint8_t>(1);
    w.put<uint32_t>(0);
    w.put_floats({});
    const auto st = w.take();
    auto plans = make(fam, 0, 2, gc::PlanForm::kAllreduce, {{"momentum", 0.9}});
    EXPECT_EQ(plans[0]->state_dict().size(), st.size());
    plans[1]->load_state_dict(st.data(), st.size());
    EXPECT_EQ(plans[1]->state_dict(), st);
    for (int q = 0; q < 3; ++q) EXPECT_EQ(gc::reshard_state({st, st}, 3, q), st) << q;
  }
}

TEST(StateLayouts, TopKReduceScatterStateWrittenByHandLoadsAndSavesTheSameBytes) {
  // the top-k reduce-scatter state is declared as a schema too (plans/topk_shard_plan.cpp); a
  // state in the layout the plan wrote by hand (numel i64, world i32, rank i32, k i64,
  // error_feedback u8, seed u64, step i64, residual) loads into a plan of those settings and
  // saves back to the same bytes; its reshard to as many ranks hands each its own bytes, to
  // another world size it is refused
  const int P = 2;
  const int64_t n = 1000;
  auto plans = trained("topk", n, P, gc::PlanForm::kReduceScatter, {{"seed", int64_t{7}}}, 1);
  const auto saved = plans[1]->state_dict();
  gc::detail::StateReader r(saved.data(), saved.size(), "topk-reduce-scatter");
  expect_rank_head(r, n, P);
  const auto k = r.get<int64_t>("k");
  EXPECT_EQ(r.get<uint8_t>("error_feedback"), 1);
  EXPECT_EQ(r.get<uint64_t>("seed"), 7u);
  EXPECT_EQ(r.get_step(), 1);
  r.finite_array("residual", n * 4);
  r.finish();
  gc::detail::StateWriter w("topk-reduce-scatter");
  w.put<int64_t>(n);
  w.put<int32_t>(P);
  w.put<int32_t>(1);
  w.put<int64_t>(k);
  w.put<uint8_t>(1);
  w.put<uint64_t>(7);
  w.put<int64_t>(1);  // (the step every rank is at: resharding compares it)
  std::vector<float> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(0.5f - 0.001f * static_cast<float>(i));
  w.put_floats(v);
  const auto st = w.take();
  plans[1]->load_state_dict(st.data(), st.size());
  EXPECT_EQ(plans[1]->state_dict(), st);
  const auto own = gc::reshard_state({plans[0]->state_dict(), st}, P, 1);
  EXPECT_TRUE(own.empty() || own == st);
  EXPECT_THROW(gc::reshard_state({plans[0]->state_dict(), st}, 3, 1), gc::InvalidArgument);
}

// ---- fp8's codes against the definition ------------------------------------------------------
TEST(Fp8Codes, EveryCodeDecodesToItsDefinitionAndBack) {
  namespace k = gc::kernels;
  for (const bool e5m2 : {false, true})
    for (int c = 0; c < 256; ++c) {
      const double want = fp8_ref_value(c, e5m2);
      const float got = k::fp8_decode(static_cast<uint8_t>(c), e5m2);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << c;
        continue;
      }
      EXPECT_EQ(static_cast<double>(got), want) << "code " << c << " e5m2 " << e5m2;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;
      if (std::isfinite(want)) EXPECT_EQ(k::fp8_encode(got, e5m2), c) << "code " << c;
    }
}

TEST(Fp8Codes, EncodeIsTheNearestCodeTiesToEven) {
  namespace k = gc::kernels;
  for (const bool e5m2 : {false, true}) {
    std::vector<float> xs = {0.0f,
                             -0.0f,
                             1e-30f,
                             -1e-30f,
                             1e30f,
                             -1e30f,
                             std::numeric_limits<float>::denorm_min(),
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity()};
    // every midpoint between neighbouring codes (the ties), and a hair either side
    for (int c = 0; c < 127; ++c) {
      const double a = fp8_ref_value(c, e5m2), b = fp8_ref_value(c + 1, e5m2);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const auto mid = static_cast<float>((a + b) / 2);
      for (const float m : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
        xs.push_back(m);
        xs.push_back(-m);
      }
    }
    // and a log-uniform spread from below the smallest subnormal to past the largest value
    for (int i = 0; i < 20000; ++i) {
      const float x = std::ldexp(1.0f + (i % 97) / 97.0f, -30 + (i * 53) % 50);
      xs.push_back(i % 2 ? -x : x);
    }
    for (const float x : xs) {
      const int want =
          std::isinf(x) ? ((x < 0 ? 0x80 : 0) | (e5m2 ? 0x7b : 0x7e)) : fp8_ref_code(x, e5m2);
      ASSERT_EQ(k::fp8_encode(x, e5m2), want) << "x " << x << " e5m2 " << e5m2;
    }
    EXPECT_TRUE(std::isnan(k::fp8_decode(k::fp8_encode(std::nanf(""), e5m2), e5m2)));
  }
}

TEST(Fp8Plan, EveryFormatBlockAndRouteMatchesTheReference) {
  for (const std::string fmt : {"e4m3", "e5m2"})
    for (const int64_t block : {int64_t{32}, int64_t{256}, int64_t{4096}})
      for (const std::string route : {"reduce_scatter", "gather"})
        for (const int P : {2, 3})
          for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{33}, int64_t{10007}}) {
            SCOPED_TRACE(fmt + " block " + std::to_string(block) + " " + route +
                         " P=" + std::to_string(P) + " n=" + std::to_string(n));
            const gc::PlanOptions o = {{"format", fmt}, {"block_size", block}, {"route", route}};
            auto plans = make("fp8", n, P, gc::PlanForm::kAllreduce, o);
            auto g = inputs(n, P, 5);
            const auto want = fp8_reference(g, gc::PlanForm::kAllreduce, o);
            step(plans, g);
            for (int r = 0; r < P; ++r)
              ASSERT_TRUE(same_bits(g[r], want[r], 0, static_cast<size_t>(n))) << "rank " << r;
          }
}

TEST(Fp8Plan, ANonFiniteValueMakesItsWholeBlockNaNOnEveryRank) {
  const int P = 3;
  const int64_t n = 1000;
  for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    auto plans = make("fp8", n, P, gc::PlanForm::kAllreduce, {{"block_size", int64_t{64}}});
    auto g = inputs(n, P, 1);
    g[2][130] = bad;  // block 2: elements [128, 192)
    step(plans, g);
    for (int r = 0; r < P; ++r)
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::isnan(g[r][i]), i >= 128 && i < 192) << "rank " << r << " element " << i;
  }
}

TEST(Fp8Plan, RefusesWhatItCannotDo) {
  const auto refused = [](const gc::PlanOptions& o, const char* says) {
    try {
      gc::make_plan("fp8", spec(100, 2, 0), o);
      ADD_FAILURE() << "accepted";
    } catch (const gc::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{"format", std::string("e3m4")}}, "format must be");
  refused({{"block_size", int64_t{48}}}, "block_size must be");
  refused({{"block_size", int64_t{8192}}}, "block_size must be");
  refused({{"route", std::string("allreduce")}}, "no allreduce route");
  EXPECT_THROW(gc::make_shard_plan("fp8", spec(101, 2, 0), gc::PlanForm::kAllgather, {}),
               gc::InvalidArgument);  // not P equal chunks
}

TEST(Fp8Plan, SendsAQuarterOfFp32sBytesAndAScalePerBlock) {
  const int P = 4;
  const int64_t n = 1 << 20;
  for (const std::string route : {"reduce_scatter", "gather"}) {
    auto plans = make("fp8", n, P, gc::PlanForm::kAllreduce, {{"route", route}});
    auto g = inputs(n, P, 0);
    std::vector<gc::Plan*> raw;
    for (int r = 0; r < P; ++r) {
      plans[r]->begin(gc::TensorView::cpu(g[r].data(), n));
      raw.push_back(plans[r].get());
    }
    size_t sent = 0;  // bytes rank 0 puts on its link (an all-to-all or allgather block each)
    for (const auto& c : gc::run_plans_in_process(raw))
      sent += c.count * gc::elem_size(c.type) * (P - 1);
    const double record = 256 + 4;  // the default block: 256 codes and an fp32 scale
    const double per_value = record / 256;
    const double want =
        route == "gather" ? n * per_value * (P - 1) : 2.0 * n * per_value * (P - 1) / P;
    EXPECT_NEAR(double(sent), want, 2 * record * P) << route;
  }
}
