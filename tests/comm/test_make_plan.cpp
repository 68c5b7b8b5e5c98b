// SPDX-License-Identifier: Apache-2.0
// make_plan(): every family by name gives the same bits as the plan built by hand from the
// configuration it documents; defaults, unknown names/options, wrong types and bad values are
// refused with a clear message; the BucketPlan contract (flat in-place begin, state_dict round
// trip, stateless plans refuse a state) holds for every family.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "comm_reference.hpp"
#include "core/state_io.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/straggler.hpp"
#include "plans/cast_plan.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/powersgd_plan.hpp"
#include "plans/quant_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gc = gradcomp;
using gc::test::rank_input;

namespace {

using Plans = std::vector<std::unique_ptr<gc::BucketPlan>>;

/// Runs `steps` steps of the P plans on rank inputs; returns every rank's bucket after each step.
std::vector<std::vector<float>> run(Plans& plans, int64_t n, int steps) {
  std::vector<gc::Plan*> raw;
  for (auto& p : plans) raw.push_back(p.get());
  std::vector<std::vector<float>> out;
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> work;
    for (size_t r = 0; r < plans.size(); ++r) work.push_back(rank_input(n, static_cast<int>(r), s));
    for (size_t r = 0; r < plans.size(); ++r)
      plans[r]->begin(gc::TensorView::cpu(work[r].data(), n));
    gc::run_plans_in_process(raw);
    for (auto& w : work) out.push_back(w);
  }
  return out;
}

gc::BucketSpec spec(int64_t n, int world, int rank, uint32_t bucket_id = 3) {
  gc::BucketSpec b;
  b.numel = n;
  b.world = world;
  b.rank = rank;
  b.bucket_id = bucket_id;
  return b;
}

// A sparsifier's plan (top-k, random-k) built by hand with the options the families are given by
// name below ({ratio 0.05, momentum 0.9}; spec()'s bucket_id is the tensor id).
template <class Plan, class Config>
std::unique_ptr<Plan> sparsifier_by_hand(int64_t n, int P) {
  Config c;
  c.ratio = 0.05;
  c.momentum = 0.9;
  c.tensor_id = 3;
  return std::make_unique<Plan>(c, n, P);
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const gc::InvalidArgument& e) {
    return e.what();
  }
  return "(no InvalidArgument)";
}

}  // namespace

TEST(MakePlan, EveryFamilyMatchesThePlanBuiltByHand) {
  const int P = 3;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{20011}}) {
    for (const std::string& name : gc::plan_names()) {
      // the families with a public plan class to build by hand; a family whose plan is private
      // to its file (fp8 onwards) is checked against its reference by the conformance suite
      static const std::set<std::string> public_classes = {
          "allreduce", "fp16", "bf16", "topk", "randomk", "onebit", "quant", "powersgd"};
      if (public_classes.count(name) == 0) continue;
      SCOPED_TRACE(name + " n=" + std::to_string(n));
      Plans by_name, by_hand;
      for (int r = 0; r < P; ++r) {
        gc::PlanOptions o;
        if (name == "topk" || name == "randomk") o = {{"ratio", 0.05}, {"momentum", 0.9}};
        if (name == "onebit") o = {{"momentum", 0.5}};
        if (name == "powersgd") o = {{"rank", int64_t{2}}};
        gc::BucketSpec b = spec(n, P, r);
        if (name == "powersgd" && n == 20011) b.shapes = {{100, 200}, {11}};
        by_name.push_back(gc::make_plan(name, b, o));
        if (name == "allreduce") {
          by_hand.push_back(std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P));
        } else if (name == "fp16" || name == "bf16") {  // CPU, no backend named: reduce-scatter
          by_hand.push_back(std::make_unique<gc::CastAllreducePlan>(
              n, gc::DType::kFloat32, name == "fp16" ? gc::DType::kFloat16 : gc::DType::kBFloat16,
              P, gc::Device::kCPU, 0, nullptr, gc::CastRoute::kReduceScatter));
        } else if (name == "topk") {
          by_hand.push_back(sparsifier_by_hand<gc::TopKAllreducePlan, gc::TopKConfig>(n, P));
        } else if (name == "randomk") {
          by_hand.push_back(sparsifier_by_hand<gc::RandomKAllreducePlan, gc::RandomKConfig>(n, P));
        } else if (name == "onebit") {  // the documented recommended settings
          gc::OneBitConfig c;
          c.scaling = gc::OneBitScaling::kSignL2;
          c.block_size = 128;
          c.rotate = true;
          c.momentum = 0.5;
          c.tensor_id = 3;
          by_hand.push_back(std::make_unique<gc::OneBitAllreducePlan>(c, n, P, r));
        } else if (name == "quant") {  // QuantConfig{}'s defaults are the plan's
          gc::QuantConfig c;
          c.tensor_id = 3;
          by_hand.push_back(std::make_unique<gc::QuantPlan>(c, n, P, r));
        } else {
          gc::PowerSGDConfig c;
          c.rank = 2;
          c.first_tensor_id = 3 * 65536;
          const std::vector<std::vector<int64_t>> shapes =
              n == 20011 ? std::vector<std::vector<int64_t>>{{100, 200}, {11}}
                         : std::vector<std::vector<int64_t>>{{n}};
          by_hand.push_back(std::make_unique<gc::PowerSGDPlan>(
              std::make_unique<gc::PowerSGDState>(c, shapes, gc::DType::kFloat32), P));
        }
      }
      EXPECT_EQ(by_name[0]->stateful(), gc::plan_is_stateful(name));
      const auto a = run(by_name, n, 3), b = run(by_hand, n, 3);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_TRUE(gc::test::same_bits(b[i], a[i].data())) << "output " << i;
    }
  }
}

TEST(MakePlan, DefaultsComeFromTheConfigurationStructs) {
  EXPECT_EQ(std::get<double>(gc::plan_defaults("topk").at("ratio")), gc::TopKConfig{}.ratio);
  EXPECT_EQ(std::get<double>(gc::plan_defaults("randomk").at("ratio")), gc::RandomKConfig{}.ratio);
  EXPECT_EQ(std::get<int64_t>(gc::plan_defaults("powersgd").at("rank")), gc::PowerSGDConfig{}.rank);
  EXPECT_EQ(std::get<std::string>(gc::plan_defaults("onebit").at("scaling")), "sign_l2");
  EXPECT_TRUE(gc::plan_defaults("allreduce").empty());
  for (const auto& name : gc::plan_names()) {  // every default is accepted as given
    const gc::PlanOptions d = gc::plan_defaults(name);
    EXPECT_NO_THROW(gc::make_plan(name, spec(64, 2, 1), d)) << name;
  }
}

TEST(MakePlan, AnOptionsOtherSpellingIsTheOptionAndNotBoth) {
  // PowerSGD's use_error_feedback (torch's name) is also accepted as error_feedback, every other
  // family's name for it: the same plan either way, refused when both are given
  const gc::BucketSpec b = spec(1000, 1, 0);
  const auto a = gc::make_plan("powersgd", b, {{"use_error_feedback", false}});
  const auto c = gc::make_plan("powersgd", b, {{"error_feedback", false}});
  const auto d = gc::make_plan("powersgd", b, {});
  EXPECT_EQ(a->state_dict(), c->state_dict());
  EXPECT_NE(a->state_dict(), d->state_dict());  // the option took effect: no error buffer kept
  const std::string both = message_of([&] {
    gc::make_plan("powersgd", b, {{"use_error_feedback", true}, {"error_feedback", true}});
  });
  EXPECT_NE(both.find("two spellings of one option"), std::string::npos) << both;
  for (const auto& t : gc::family_traits())
    for (const auto& [spelling, option] : t.aliases) {
      const auto defaults = gc::plan_defaults(t.name);
      EXPECT_EQ(defaults.count(option), 1u) << t.name << ": " << spelling << " names no option";
      EXPECT_EQ(defaults.count(spelling), 0u) << t.name << ": " << spelling << " is an option";
    }
}

TEST(MakePlan, RefusesUnknownNamesOptionsTypesAndValues) {
  const auto b = spec(64, 2, 0);
  EXPECT_NE(message_of([&] { gc::make_plan("top-k", b); }).find("unknown compressor 'top-k'"),
            std::string::npos);
  const std::string unknown = message_of([&] { gc::make_plan("topk", b, {{"rato", 0.1}}); });
  EXPECT_NE(unknown.find("unknown option(s) ['rato']"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("'ratio'"), std::string::npos) << unknown;  // lists the known ones
  const std::string type = message_of([&] {
    gc::make_plan("topk", b, {{"ratio", std::string("0.1")}});
  });
  EXPECT_NE(type.find("ratio must be a number, got a name"), std::string::npos) << type;
  EXPECT_NE(message_of([&] {
              gc::make_plan("onebit", b, {{"rotate", int64_t{1}}});
            }).find("rotate must be a flag"),
            std::string::npos);
  EXPECT_NO_THROW(gc::make_plan("topk", b, {{"ratio", int64_t{1}}}));  // an integer for a real
  EXPECT_THROW(gc::make_plan("topk", b, {{"ratio", 2.0}}), gc::InvalidArgument);
  EXPECT_THROW(gc::make_plan("topk", b, {{"method", std::string("fast")}}), gc::InvalidArgument);
  EXPECT_THROW(gc::make_plan("topk", b, {{"seed", int64_t{-1}}}), gc::InvalidArgument);
  EXPECT_THROW(gc::make_plan("fp16", b, {{"route", std::string("ring")}}), gc::InvalidArgument);
  EXPECT_THROW(gc::make_plan("onebit", b, {{"block_size", int64_t{100}}}), gc::InvalidArgument);
  EXPECT_THROW(gc::make_plan("powersgd", b, {{"rank", int64_t{0}}}), gc::InvalidArgument);
  gc::BucketSpec s = b;
  s.shapes = {{8, 7}};  // 56 elements for a 64-element bucket
  EXPECT_NE(message_of([&] { gc::make_plan("powersgd", s); }).find("hold 56 elements"),
            std::string::npos);
  s = b;
  s.rank = 2;  // outside the group of 2
  EXPECT_THROW(gc::make_plan("onebit", s), gc::InvalidArgument);
}

TEST(MakePlan, CodecConfigsAreThePlansConfigs) {
  // topk_config / randomk_config (what the per-tensor codec bindings read their keyword
  // arguments with) give the configuration make_plan hands its compressor, field by field
  const gc::PlanOptions o = {{"ratio", 0.02},
                             {"momentum", 0.8},
                             {"nesterov", true},
                             {"momentum_masking", false},
                             {"clip_norm", 2.5},
                             {"warmup_ratios", std::vector<double>{0.5}},
                             {"warmup_steps", int64_t{3}},
                             {"value_dtype", std::string("float16")},
                             {"error_feedback", false},
                             {"check_finite", false},
                             {"seed", int64_t{9}}};
  auto same = [](const gc::SparsifyConfig& a, const gc::SparsifyConfig& b) {
    EXPECT_EQ(a.ratio, b.ratio);
    EXPECT_EQ(a.momentum, b.momentum);
    EXPECT_EQ(a.nesterov, b.nesterov);
    EXPECT_EQ(a.momentum_masking, b.momentum_masking);
    EXPECT_EQ(a.clip_norm, b.clip_norm);
    EXPECT_EQ(a.warmup_ratios, b.warmup_ratios);
    EXPECT_EQ(a.warmup_steps, b.warmup_steps);
    EXPECT_EQ(a.value_dtype, b.value_dtype);
    EXPECT_EQ(a.error_feedback, b.error_feedback);
    EXPECT_EQ(a.check_finite, b.check_finite);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.tensor_id, b.tensor_id);
  };
  gc::BucketSpec b;
  b.numel = 1000;
  b.bucket_id = 7;  // world 1: the plan's per-rank clipping threshold is clip_norm itself
  for (bool defaults : {true, false}) {
    const gc::PlanOptions given = defaults ? gc::PlanOptions{} : o;
    gc::PlanOptions topk = given;
    topk["method"] = std::string("exact");
    topk["sample_rate"] = 0.05;
    const gc::TopKConfig c = gc::topk_config(topk, 7);
    auto plan = gc::make_plan("topk", b, topk);
    const gc::TopKConfig& pc = dynamic_cast<gc::TopKAllreducePlan&>(*plan).compressor().config();
    same(c, pc);
    EXPECT_EQ(c.select.method, gc::SelectMethod::kExact);
    EXPECT_EQ(c.select.method, pc.select.method);
    EXPECT_EQ(c.select.sample_rate, pc.select.sample_rate);
    const gc::RandomKConfig r = gc::randomk_config(given, 7);
    auto rplan = gc::make_plan("randomk", b, given);
    same(r, dynamic_cast<gc::RandomKAllreducePlan&>(*rplan).compressor().config());
    if (!defaults) EXPECT_EQ(r.ratio, 0.02);
  }
  // a codec refuses what only a plan has, and everything make_plan refuses
  for (const char* k : {"route", "exchange", "clip_scaling"}) {
    EXPECT_THROW(gc::topk_config({{k, std::string("auto")}}), gc::InvalidArgument) << k;
    EXPECT_THROW(gc::randomk_config({{k, std::string("none")}}), gc::InvalidArgument) << k;
  }
  EXPECT_THROW(gc::topk_config({{"latency_s", 0.1}}), gc::InvalidArgument);
  EXPECT_THROW(gc::topk_config({{"bogus", 1.0}}), gc::InvalidArgument);
  EXPECT_THROW(gc::topk_config({{"ratio", std::string("x")}}), gc::InvalidArgument);
  EXPECT_THROW(gc::topk_config({{"ratio", 0.0}}), gc::InvalidArgument);
  EXPECT_THROW(gc::randomk_config({{"method", std::string("exact")}}), gc::InvalidArgument);
  EXPECT_THROW(gc::randomk_config({{"seed", int64_t{-1}}}), gc::InvalidArgument);
}

TEST(MakePlan, OneBitCodecConfigIsThePlansConfig) {
  // The per-tensor 1-bit codec reads the plan's table: the same scaling, block and error
  // settings by default and as given, without the plan's rotation and momentum
  gc::BucketSpec b;
  b.numel = 1000;
  for (const gc::PlanOptions& given :
       {gc::PlanOptions{}, gc::PlanOptions{{"scaling", std::string("sign_l1")},
                                           {"block_size", int64_t{64}},
                                           {"error_feedback", false},
                                           {"check_finite", false}}}) {
    const gc::OneBitConfig c = gc::onebit_config(given, 5);
    gc::PlanOptions plan_given = given;
    plan_given["rotate"] = false;
    auto plan = gc::make_plan("onebit", b, plan_given);
    const gc::OneBitConfig& pc = dynamic_cast<gc::OneBitAllreducePlan&>(*plan).config();
    EXPECT_EQ(c.scaling, pc.scaling);
    EXPECT_EQ(c.block_size, pc.block_size);
    EXPECT_EQ(c.error_feedback, pc.error_feedback);
    EXPECT_EQ(c.check_finite, pc.check_finite);
    EXPECT_EQ(c.tensor_id, 5u);
    EXPECT_FALSE(c.rotate);
    EXPECT_EQ(c.momentum, 0.0);
  }
  const gc::OneBitConfig d = gc::onebit_config({});
  EXPECT_EQ(d.scaling, gc::OneBitScaling::kSignL2);
  EXPECT_EQ(d.block_size, 128);
  // the codec's old keyword for the block
  EXPECT_EQ(gc::onebit_config({{"chunk_size", int64_t{256}}}).block_size, 256);
  EXPECT_THROW(gc::onebit_config({{"chunk_size", int64_t{256}}, {"block_size", int64_t{256}}}),
               gc::InvalidArgument);
  // column means: its groups are the columns, so no block unless one is asked for (refused)
  const gc::OneBitConfig cm = gc::onebit_config({{"scaling", std::string("column_means")}});
  EXPECT_EQ(cm.scaling, gc::OneBitScaling::kColumnMeans);
  EXPECT_EQ(cm.block_size, 0);
  EXPECT_THROW(
      gc::onebit_config({{"scaling", std::string("column_means")}, {"block_size", int64_t{128}}}),
      gc::InvalidArgument);
  // the plan refuses column means with a reason
  EXPECT_THROW(gc::make_plan("onebit", b, {{"scaling", std::string("column_means")}}),
               gc::InvalidArgument);
  // what only the plan has
  EXPECT_NO_THROW(gc::onebit_config({{"rotate", false}, {"momentum", 0.0}}));
  EXPECT_THROW(gc::onebit_config({{"rotate", true}}), gc::InvalidArgument);
  EXPECT_THROW(gc::onebit_config({{"momentum", 0.9}}), gc::InvalidArgument);
  EXPECT_THROW(gc::onebit_config({{"on_nonfinite", std::string("raise")}}), gc::InvalidArgument);
  EXPECT_THROW(gc::onebit_config({{"bogus", 1.0}}), gc::InvalidArgument);
  EXPECT_THROW(gc::onebit_config({{"block_size", int64_t{33}}}), gc::InvalidArgument);
}

TEST(MakePlan, AnotherSpellingOfAnOptionIsThatOption) {
  // the two-level plan's state carries a hash of its options: a state saved by a plan built with
  // one spelling loads into one built with the other, and not into one with another value
  const gc::BucketSpec b = spec(256, 4, 0);
  auto saved = gc::make_hierarchical_plan("onebit", b, 2, {{"chunk_size", int64_t{64}}});
  const std::vector<uint8_t> sd = saved->state_dict();
  auto same = gc::make_hierarchical_plan("onebit", b, 2, {{"block_size", int64_t{64}}});
  EXPECT_NO_THROW(same->load_state_dict(sd.data(), sd.size()));
  auto other = gc::make_hierarchical_plan("onebit", b, 2, {{"block_size", int64_t{32}}});
  EXPECT_THROW(other->load_state_dict(sd.data(), sd.size()), gc::InvalidArgument);
}

TEST(MakePlan, CastRouteAutoFollowsTheBackend) {
  auto route_of = [](const char* backend, int world = 3) {
    gc::BucketSpec b = spec(64, world, 0);
    b.backend = backend;
    auto p = gc::make_plan("fp16", b);
    return dynamic_cast<gc::CastAllreducePlan&>(*p).route();
  };
  EXPECT_EQ(route_of("gloo"), gc::CastRoute::kReduceScatter);
  EXPECT_EQ(route_of("gloo", 2), gc::CastRoute::kGather);  // the ring's bytes in one round
  EXPECT_EQ(route_of("nccl"), gc::CastRoute::kAllreduce);
  EXPECT_EQ(route_of("nccl", 2), gc::CastRoute::kAllreduce);
  EXPECT_EQ(route_of("mpi"), gc::CastRoute::kAllreduce);
  EXPECT_EQ(route_of(""), gc::CastRoute::kReduceScatter);  // unknown, on the CPU
  EXPECT_EQ(route_of("", 2), gc::CastRoute::kGather);
  auto p = gc::make_plan("bf16", spec(64, 2, 0), {{"route", std::string("allreduce")}});
  EXPECT_EQ(dynamic_cast<gc::CastAllreducePlan&>(*p).route(), gc::CastRoute::kAllreduce);
}

TEST(MakePlan, StateRoundTripsThroughTheContract) {
  const int P = 2;
  const int64_t n = 3000;
  for (const std::string& name : gc::plan_names()) {
    SCOPED_TRACE(name);
    Plans a, b;
    for (int r = 0; r < P; ++r) {
      a.push_back(gc::make_plan(name, spec(n, P, r)));
      b.push_back(gc::make_plan(name, spec(n, P, r)));
    }
    run(a, n, 2);
    if (!a[0]->stateful()) {
      EXPECT_TRUE(a[0]->state_dict().empty());
      const uint8_t byte = 0;
      EXPECT_NO_THROW(a[0]->load_state_dict(nullptr, 0));
      EXPECT_THROW(a[0]->load_state_dict(&byte, 1), gc::InvalidArgument);
      continue;
    }
    for (int r = 0; r < P; ++r) {
      const auto st = a[r]->state_dict();
      ASSERT_FALSE(st.empty());
      b[r]->load_state_dict(st.data(), st.size());
      EXPECT_EQ(b[r]->state_dict(), st);
    }
    // restored plans continue exactly as the originals
    const auto x = run(a, n, 2), y = run(b, n, 2);
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_TRUE(gc::test::same_bits(x[i], y[i].data())) << "output " << i;
  }
}

// The registry's traits are what the plans do: callers (the bindings, the Python hooks, the
// option document) read the traits instead of keeping lists, so a trait that lies would mislead
// all of them at once.
TEST(Registry, TraitsAreWhatThePlansDo) {
  const auto traits = gc::family_traits();
  std::vector<std::string> names, shard_names;
  for (const auto& t : traits) {
    names.push_back(t.name);
    if (!t.shard_forms.empty()) shard_names.push_back(t.name);
  }
  EXPECT_EQ(names, gc::plan_names());
  EXPECT_EQ(shard_names, gc::shard_plan_names());
  const int64_t n = 96;  // 12 x 8: one matrix PowerSGD compresses
  for (const auto& t : traits) {
    SCOPED_TRACE(t.name);
    EXPECT_EQ(gc::plan_is_stateful(t.name), t.stateful);
    // stateful: the plan says so and writes a state of one of the kinds listed
    std::vector<std::unique_ptr<gc::BucketPlan>> plans;
    for (int r = 0; r < 2; ++r) plans.push_back(gc::make_plan(t.name, spec(n, 2, r)));
    EXPECT_EQ(plans[0]->stateful(), t.stateful);
    run(plans, n, 1);
    const auto st = plans[0]->state_dict();
    if (t.stateful) {
      ASSERT_FALSE(st.empty());
      const std::string kind = gc::detail::StateReader(st.data(), st.size()).kind();
      EXPECT_NE(std::find(t.state_kinds.begin(), t.state_kinds.end(), kind), t.state_kinds.end())
          << kind;
    } else {
      EXPECT_TRUE(st.empty());
      EXPECT_TRUE(t.state_kinds.empty());
    }
    // uses_shapes: shapes that do not fill the bucket are refused by a family that reads them,
    // and ignored (the same plan) by one that does not
    gc::BucketSpec bad = spec(n, 2, 0);
    bad.shapes = {{5, 3}};
    if (t.uses_shapes)
      EXPECT_THROW(gc::make_plan(t.name, bad), gc::InvalidArgument);
    else
      EXPECT_NO_THROW(gc::make_plan(t.name, bad));
    // every form listed builds with its defaults; every other is refused, naming the form
    for (const gc::PlanForm form : {gc::PlanForm::kReduceScatter, gc::PlanForm::kAllgather}) {
      const bool listed =
          std::find(t.shard_forms.begin(), t.shard_forms.end(), form) != t.shard_forms.end();
      if (listed) {
        auto p =
            gc::make_shard_plan(t.name, spec(n, 2, 0), form, gc::shard_plan_defaults(t.name, form));
        EXPECT_EQ(p->numel(), n);
      } else {
        EXPECT_NE(message_of([&] {
                    gc::shard_plan_defaults(t.name, form);
                  }).find(std::string("has no ") + gc::enum_name(form) + " form"),
                  std::string::npos);
      }
    }
  }
}

TEST(MakePlan, PowerSGDFlatBucketEqualsItsTensorViews) {
  const std::vector<std::vector<int64_t>> shapes = {{40, 30}, {}, {7}, {6, 5, 2}};
  const int64_t n = 1200 + 1 + 7 + 60;
  const int P = 2;
  gc::PowerSGDConfig c;
  c.rank = 2;
  std::vector<std::unique_ptr<gc::PowerSGDState>> st;
  std::vector<std::unique_ptr<gc::PowerSGDPlan>> flat, views;
  for (int r = 0; r < P; ++r) {
    gc::BucketSpec b = spec(n, P, r, 0);
    b.shapes = shapes;
    flat.emplace_back(static_cast<gc::PowerSGDPlan*>(
        gc::make_plan("powersgd", b, {{"rank", int64_t{2}}}).release()));
    st.push_back(std::make_unique<gc::PowerSGDState>(c, shapes, gc::DType::kFloat32));
    views.push_back(std::make_unique<gc::PowerSGDPlan>(*st.back(), P));
  }
  for (int s = 0; s < 3; ++s) {
    std::vector<std::vector<float>> a, b;
    for (int r = 0; r < P; ++r) a.push_back(rank_input(n, r, s));
    b = a;
    for (int r = 0; r < P; ++r) {
      flat[r]->begin(gc::TensorView::cpu(a[r].data(), n));
      float* p = b[r].data();
      std::vector<gc::TensorView> v;
      v.emplace_back(p, std::initializer_list<int64_t>{40, 30}, gc::DType::kFloat32,
                     gc::Device::kCPU);
      v.emplace_back(p + 1200, std::initializer_list<int64_t>{1}, gc::DType::kFloat32,
                     gc::Device::kCPU);
      v.emplace_back(p + 1201, std::initializer_list<int64_t>{7}, gc::DType::kFloat32,
                     gc::Device::kCPU);
      v.emplace_back(p + 1208, std::initializer_list<int64_t>{6, 5, 2}, gc::DType::kFloat32,
                     gc::Device::kCPU);
      views[r]->begin(v);
    }
    gc::run_plans_in_process({flat[0].get(), flat[1].get()});
    gc::run_plans_in_process({views[0].get(), views[1].get()});
    for (int r = 0; r < P; ++r) ASSERT_TRUE(gc::test::same_bits(b[r], a[r].data()));
  }
  // a bucket of the wrong size or dtype is refused before the step starts
  std::vector<float> small(static_cast<size_t>(n - 1));
  EXPECT_THROW(flat[0]->begin(gc::TensorView::cpu(small.data(), n - 1)), gc::InvalidArgument);
}

// ---- the enum name tables (EnumNames beside each enum, gradcomp/types.hpp) ----
namespace {

/// Every member's canonical name parses back to it, names are distinct, every alias parses to a
/// member, and an unknown name is refused with the member names listed.
template <class E>
void check_enum_table(std::vector<std::string> expected_members) {
  using N = gc::EnumNames<E>;
  ASSERT_EQ(N::members, expected_members.size()) << N::what;
  std::vector<std::string> seen;
  for (const auto& e : N::table) {
    for (const auto& s : seen) EXPECT_NE(s, e.name) << N::what << ": name listed twice";
    seen.emplace_back(e.name);
    EXPECT_EQ(gc::parse_enum<E>(e.name), e.value) << e.name;
  }
  for (std::size_t i = 0; i < N::members; ++i) {
    EXPECT_EQ(expected_members[i], N::table[i].name) << N::what;
    EXPECT_STREQ(gc::enum_name(N::table[i].value), N::table[i].name) << N::what;
    for (std::size_t j = 0; j < i; ++j)  // one canonical name per value
      EXPECT_NE(N::table[j].value, N::table[i].value) << N::what << " " << N::table[i].name;
  }
  const std::string msg = message_of([] { gc::parse_enum<E>("no-such-name"); });
  EXPECT_NE(msg.find(std::string("unknown ") + N::what + " 'no-such-name'"), std::string::npos)
      << msg;
  for (const auto& m : expected_members) EXPECT_NE(msg.find(m), std::string::npos) << msg;
  EXPECT_THROW(gc::parse_enum<E>(""), gc::InvalidArgument);
  EXPECT_STREQ(gc::enum_name(static_cast<E>(200)), "?");
}

}  // namespace

// Error feedback carries what a step did not send into the next, so the sum of many steps'
// averages tracks the sum of the true averages, off by what the errors hold now: that must stay
// bounded, not grow with the steps. Every family at its defaults (the sparsifiers at 25%), and
// the quant and 1-bit settings a user picks, over 400 steps of 2 ranks on random, opposite-sign
// (the ranks' gradients nearly cancel) and heavy-tailed gradients: the drift must stay within
// `bound` x the largest gradient, and no single average may exceed it either. (Stochastic
// rounding at 2 bits once drifted 14-18x and sent single averages of 22-45x.)
TEST(MakePlan, ErrorFeedbackStaysBoundedForEveryFamily) {
  const int64_t n = 1024;
  const int P = 2, steps = 400;
  struct Case {
    std::string name;
    gc::PlanOptions opts;
    double bound;
    std::string label;
  };
  std::vector<Case> cases;
  for (const auto& name : gc::plan_names()) {
    gc::PlanOptions o;
    if (name == "topk" || name == "randomk") o["ratio"] = 0.25;
    if (name == "randomk") o["dense_below"] = int64_t{1};
    cases.push_back({name, o, 4.0, name + " defaults"});
  }
  for (int64_t bits : {2, 4, 8})
    for (const char* r : {"nearest", "stochastic"})
      for (bool rotate : {false, true})
        cases.push_back(
            {"quant",
             {{"bits", bits}, {"rounding", std::string(r)}, {"rotate", rotate}},
             4.0,
             "quant " + std::to_string(bits) + " bits " + r + (rotate ? " rotate" : "")});
  for (const char* sc : {"sign_l2", "sign_l1"})
    for (bool rotate : {false, true})
      cases.push_back({"onebit",
                       {{"scaling", std::string(sc)}, {"rotate", rotate}},
                       4.0,
                       std::string("onebit ") + sc + (rotate ? " rotate" : "")});
  const auto fixed = gc::test::rank_input(n, 0, 91);
  for (const auto& c : cases)
    for (int kind = 0; kind < 3; ++kind) {
      gc::BucketSpec b;
      b.numel = n;
      b.world = P;
      b.shapes = {{32, 32}};
      Plans plans;
      for (int r = 0; r < P; ++r) {
        b.rank = r;
        plans.push_back(gc::make_plan(c.name, b, c.opts));
      }
      std::vector<gc::Plan*> raw;
      for (auto& p : plans) raw.push_back(p.get());
      std::vector<double> drift(n, 0.0);
      double gmax = 0, outmax = 0;
      for (int s = 0; s < steps; ++s) {
        std::vector<std::vector<float>> g(P);
        for (int r = 0; r < P; ++r) {
          if (kind == 1) {
            g[r] = fixed;
            if (r == 1)
              for (float& v : g[r]) v *= -0.9f;
          } else {
            g[r] = gc::test::rank_input(n, r, 1000 + s);
            if (kind == 2) {
              const auto d = gc::test::rank_input(n, r, 5000 + s);
              for (int64_t i = 0; i < n; ++i) g[r][i] /= std::sqrt(0.5f * (d[i] * d[i] + 1e-3f));
            }
          }
        }
        std::vector<double> mean(n, 0.0);
        for (int r = 0; r < P; ++r)
          for (int64_t i = 0; i < n; ++i) {
            mean[i] += g[r][i] / P;
            gmax = std::max(gmax, double(std::fabs(g[r][i])));
          }
        auto work = g;
        for (int r = 0; r < P; ++r) plans[r]->begin(gc::TensorView::cpu(work[r].data(), n));
        gc::run_plans_in_process(raw);
        for (int64_t i = 0; i < n; ++i) {
          drift[i] += work[0][i] - mean[i];
          outmax = std::max(outmax, double(std::fabs(work[0][i])));
        }
      }
      double worst = 0;
      for (double d : drift) worst = std::max(worst, std::fabs(d));
      const std::string& what = c.label;
      EXPECT_LT(worst, c.bound * gmax)
          << what << " gradients " << kind << ": drift " << worst / gmax << " x the largest";
      EXPECT_LT(outmax, c.bound * gmax)
          << what << " gradients " << kind << ": an average of " << outmax / gmax << " x";
    }
}

TEST(EnumNames, EveryTableParsesItsNamesAndRefusesOthers) {
  check_enum_table<gc::DType>({"float32", "float16", "bfloat16"});
  check_enum_table<gc::Device>({"cpu", "cuda"});
  check_enum_table<gc::ElemType>({"float32", "float16", "bfloat16", "uint8", "uint32", "int64"});
  check_enum_table<gc::CollectiveKind>({"allreduce", "allgather", "all-to-all", "broadcast"});
  check_enum_table<gc::SelectMethod>({"exact", "sampled"});
  check_enum_table<gc::OneBitScaling>({"column_means", "sign_l1", "sign_l2"});
  check_enum_table<gc::Orthogonalization>(
      {"auto", "gram_schmidt", "householder", "gram_schmidt_unfused"});
  check_enum_table<gc::TopKRoute>({"auto", "sparse", "dense"});
  check_enum_table<gc::TopKExchange>({"auto", "bound", "sizes"});
  check_enum_table<gc::CastRoute>({"allreduce", "reduce_scatter", "gather"});
  check_enum_table<gc::SparsifyConfig::ClipScaling>({"sqrt_world", "none"});
  check_enum_table<gc::straggler::DropPoint>(
      {"before_forward", "between_forward_backward", "after_backward"});
  check_enum_table<gc::straggler::StopModel>({"preemptive", "boundary"});
  check_enum_table<gc::straggler::Normalization>({"nominal", "actual"});
  check_enum_table<gc::straggler::DelayKind>({"normal", "lognormal"});
  // the aliases the bindings have always accepted
  EXPECT_EQ(gc::parse_enum<gc::DType>("fp16"), gc::DType::kFloat16);
  EXPECT_EQ(gc::parse_enum<gc::DType>("half"), gc::DType::kFloat16);
  EXPECT_EQ(gc::parse_enum<gc::DType>("bf16"), gc::DType::kBFloat16);
  EXPECT_EQ(gc::parse_enum<gc::DType>("float"), gc::DType::kFloat32);
  EXPECT_EQ(gc::parse_enum<gc::OneBitScaling>("1bit_sgd"), gc::OneBitScaling::kColumnMeans);
  EXPECT_EQ(gc::parse_enum<gc::straggler::StopModel>("micro_batch_boundary"),
            gc::straggler::StopModel::kMicroBatchBoundary);
  EXPECT_EQ(gc::parse_enum<gc::straggler::DelayKind>("bounded_lognormal"),
            gc::straggler::DelayKind::kBoundedLogNormal);
  // a name is matched whole and case-sensitively
  EXPECT_THROW(gc::parse_enum<gc::TopKRoute>("Sparse"), gc::InvalidArgument);
  EXPECT_THROW(gc::parse_enum<gc::TopKRoute>("sparse "), gc::InvalidArgument);
}
