// SPDX-License-Identifier: Apache-2.0
// The engine-independent collectives (Communicator's rank-ordered allreduce / reduce-scatter over
// an engine's primitives) run over InProcessGroup: P ranks as threads. Checked against plain
// scalar references for P = 1..4, element types fp32/fp16/bf16 and sizes 0, 1, odd, one above
// the one-round limit and large; statistics; the plans of every family equal the lockstep
// simulation (run_plans_in_process) bitwise; a missing rank times out on every caller and breaks
// the group; ranks that disagree throw on every rank. On a machine with a GPU the same algorithm
// runs on CUDA buffers and must give the CPU's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm_reference.hpp"
#include "gradcomp/comm.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/runtime.hpp"
#include "gradcomp/workspace.hpp"
#include "kernels/fp8_kernels.hpp"
#include "kernels/reduce_kernels.hpp"
#include "plans/cast_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gc = gradcomp;
using gc::ElemType;
using gc::ReduceOp;

namespace {

/// Runs body(rank) on one thread per rank; returns each rank's exception message ("" if none).
std::vector<std::string> on_ranks(gc::InProcessGroup& g, const std::function<void(int)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(g.size()));
  std::vector<std::thread> ts;
  for (int r = 0; r < g.size(); ++r)
    ts.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

/// The 16-bit rounding of comm_reference.hpp for fp16 / bf16 element types.
gc::test::WireRound wire(ElemType t) {
  return gc::test::WireRound(t == ElemType::kF16 ? gc::DType::kFloat16 : gc::DType::kBFloat16);
}

float load(ElemType t, const uint8_t* p, int64_t i) {
  if (t == ElemType::kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return wire(t).from(h);
}

/// Stores x rounded to type t.
void store(ElemType t, uint8_t* p, int64_t i, float x) {
  if (t == ElemType::kF32) {
    std::memcpy(p + 4 * i, &x, 4);
  } else {
    const uint16_t h = wire(t).to(x);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

/// Element i of rank r's input, stored in type t (16-bit types hold the rounded value).
std::vector<uint8_t> input(ElemType t, int64_t n, int rank, uint64_t salt) {
  const auto v = gc::test::normal(n, 7919u * static_cast<uint64_t>(rank) + salt, 1.0f + rank);
  std::vector<uint8_t> out(static_cast<size_t>(n) * gc::elem_size(t));
  for (int64_t i = 0; i < n; ++i) store(t, out.data(), i, v[i]);
  return out;
}

/// The scalar reference: rank 0 first, rounded to the element type after every addition, then
/// (mean) divided by P in fp32 and rounded once more.
std::vector<uint8_t> ordered_sum(ElemType t, const std::vector<std::vector<uint8_t>>& in, int64_t n,
                                 int64_t offset, bool mean) {
  std::vector<uint8_t> out(static_cast<size_t>(n) * gc::elem_size(t));
  const auto P = static_cast<float>(in.size());
  for (int64_t i = 0; i < n; ++i) {
    store(t, out.data(), i, load(t, in[0].data(), offset + i));
    for (size_t r = 1; r < in.size(); ++r)
      store(t, out.data(), i, load(t, out.data(), i) + load(t, in[r].data(), offset + i));
    if (mean) store(t, out.data(), i, load(t, out.data(), i) / P);
  }
  return out;
}

const int64_t kSizes[] = {0, 1, 3, 1000, 8193, 100003};  // 8193 fp32 = just above 32 KiB

}  // namespace

TEST(InProcessComm, AllreduceAndReduceScatterMatchOrderedReference) {
  for (int P = 1; P <= 4; ++P)
    for (ElemType t : {ElemType::kF32, ElemType::kF16, ElemType::kBF16})
      for (int64_t n : kSizes) {
        SCOPED_TRACE("P=" + std::to_string(P) + " type " + std::to_string(int(t)) +
                     " n=" + std::to_string(n));
        const size_t es = gc::elem_size(t), bytes = static_cast<size_t>(n) * es;
        std::vector<std::vector<uint8_t>> in, blocks;
        for (int r = 0; r < P; ++r) {
          in.push_back(input(t, n, r, 1));
          blocks.push_back(input(t, n * P, r, 2));
        }
        const auto sum = ordered_sum(t, in, n, 0, false), mean = ordered_sum(t, in, n, 0, true);
        std::vector<std::vector<uint8_t>> out(P, std::vector<uint8_t>(bytes)),
            inplace = in, rs(P, std::vector<uint8_t>(bytes));
        gc::InProcessGroup g(P);
        expect_no_errors(on_ranks(g, [&](int r) {
          auto& c = g.comm(r);
          c.allreduce(in[r].data(), out[r].data(), n, t, ReduceOp::kSum);
          c.allreduce(inplace[r].data(), inplace[r].data(), n, t, ReduceOp::kMean);
          c.reduce_scatter(blocks[r].data(), rs[r].data(), n, t, ReduceOp::kSum);
        }));
        for (int r = 0; r < P; ++r) {
          EXPECT_EQ(out[r], sum) << "allreduce sum, rank " << r;
          EXPECT_EQ(inplace[r], mean) << "in-place allreduce mean, rank " << r;
          EXPECT_EQ(rs[r], ordered_sum(t, blocks, n, n * r, false)) << "reduce_scatter, rank " << r;
        }
      }
}

TEST(InProcessComm, DataMovementAndStatistics) {
  for (int P = 1; P <= 4; ++P)
    for (int64_t n : kSizes) {
      SCOPED_TRACE("P=" + std::to_string(P) + " n=" + std::to_string(n));
      gc::InProcessGroup g(P);
      std::vector<std::vector<uint32_t>> a2a(P), got(P), gath(P), bc(P);
      std::vector<gc::CommStats> st(P);
      expect_no_errors(on_ranks(g, [&](int me) {
        auto& c = g.comm(me);
        const auto un = static_cast<size_t>(n), uP = static_cast<size_t>(P);
        a2a[me].resize(un * uP);
        got[me].assign(un * uP, 0);
        for (size_t b = 0; b < uP; ++b)
          for (size_t j = 0; j < un; ++j) a2a[me][b * un + j] = uint32_t(me * 1000003 + b * 7 + j);
        c.alltoall(a2a[me].data(), got[me].data(), un, ElemType::kU32);
        std::vector<uint32_t> mine(un);
        for (size_t j = 0; j < un; ++j) mine[j] = uint32_t(me * 31 + j);
        gath[me].assign(un * uP, 0);
        c.allgather(mine.data(), gath[me].data(), un, ElemType::kU32);
        bc[me] = mine;  // broadcast from the last rank, in place
        c.broadcast(bc[me].data(), bc[me].data(), un, ElemType::kU32, P - 1);
        c.barrier();
        c.reset_stats();
        std::vector<float> x(un, 1.0f);
        c.allreduce(x.data(), x.data(), un, ElemType::kF32, ReduceOp::kSum);
        st[me] = c.stats();
      }));
      for (int me = 0; me < P; ++me)
        for (int r = 0; r < P; ++r)
          for (int64_t j = 0; j < n; ++j) {
            ASSERT_EQ(got[me][r * n + j], uint32_t(r * 1000003 + me * 7 + j)) << me << " " << r;
            ASSERT_EQ(gath[me][r * n + j], uint32_t(r * 31 + j));
            ASSERT_EQ(bc[me][j], uint32_t((P - 1) * 31 + j));
          }
      // one call per collective; bytes by the algorithm: one round (allgather of the whole vector)
      // up to 32 KiB or fewer elements than ranks, else all-to-all + allgather of P chunks
      const uint64_t bytes = 4 * static_cast<uint64_t>(n);
      for (int me = 0; me < P; ++me) {
        EXPECT_EQ(st[me].calls, 1u);
        uint64_t want = 0;
        if (P > 1 && n > 0) {
          const uint64_t mine = 4 * static_cast<uint64_t>(n * (me + 1) / P - n * me / P);
          want = bytes <= 32 * 1024 || n < P ? bytes * (P - 1) : 2 * (bytes - mine);
        }
        EXPECT_EQ(st[me].bytes_sent, want) << "rank " << me;
      }
    }
}

TEST(InProcessComm, PlansOverThreadsEqualLockstepSimulation) {
  // every family's plan run by run_plan on P threads gives the bits of run_plans_in_process
  for (int P : {2, 3, 4})
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{100003}}) {
      SCOPED_TRACE("P=" + std::to_string(P) + " n=" + std::to_string(n));
      using Maker = std::function<std::unique_ptr<gc::test::RankPlan>(int)>;
      gc::TopKConfig tk;
      tk.ratio = 0.01;
      tk.momentum = 0.9;
      gc::RandomKConfig rk;
      rk.ratio = 0.02;
      gc::OneBitConfig ob;
      ob.scaling = gc::OneBitScaling::kSignL2;
      gc::PowerSGDConfig ps;
      ps.rank = 2;
      const std::vector<std::vector<int64_t>> shapes = {{n / 10, 10}, {n % 10}};
      const std::vector<std::pair<std::string, Maker>> makers = {
          {"dense",
           [&](int) {
             return std::make_unique<gc::test::GradientRankPlan>(
                 std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P));
           }},
          {"cast fp16",
           [&](int) {
             return std::make_unique<gc::test::GradientRankPlan>(
                 std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32,
                                                         gc::DType::kFloat16, P));
           }},
          {"topk",
           [&](int) {
             return std::make_unique<gc::test::GradientRankPlan>(
                 std::make_unique<gc::TopKAllreducePlan>(tk, n, P));
           }},
          {"randomk",
           [&](int) {
             return std::make_unique<gc::test::GradientRankPlan>(
                 std::make_unique<gc::RandomKAllreducePlan>(rk, n, P));
           }},
          {"onebit",
           [&](int r) { return std::make_unique<gc::test::OneBitRankPlan>(ob, n, P, r); }},
          {"powersgd",
           [&](int) { return std::make_unique<gc::test::PowerSGDRankPlan>(ps, shapes, P); }},
      };
      for (const auto& [name, make] : makers) {
        if (name == "powersgd" && n < 10) continue;  // its layout needs a 10-column matrix
        std::vector<std::unique_ptr<gc::test::RankPlan>> threaded, sims;
        std::vector<gc::Plan*> raw;
        for (int r = 0; r < P; ++r) {
          threaded.push_back(make(r));
          sims.push_back(make(r));
          raw.push_back(&sims.back()->plan());
        }
        const int64_t len = threaded[0]->numel();
        gc::InProcessGroup g(P);
        for (int step = 0; step < 3; ++step) {
          std::vector<std::vector<float>> in, sim;
          for (int r = 0; r < P; ++r) in.push_back(gc::test::rank_input(len, r, step));
          sim = in;
          expect_no_errors(on_ranks(g, [&](int r) {
            threaded[r]->begin(in[r].data());
            gc::run_plan(threaded[r]->plan(), g.comm(r), gc::Handshake::kEvery);
          }));
          for (int r = 0; r < P; ++r) sims[r]->begin(sim[r].data());
          gc::run_plans_in_process(raw);
          for (int r = 0; r < P; ++r) {
            const float* want = sims[r]->result(sim[r].data());
            const float* got = threaded[r]->result(in[r].data());
            ASSERT_TRUE(len == 0 ||  // memcmp's pointers must be valid, and empty ones are null
                        std::memcmp(want, got, sizeof(float) * static_cast<size_t>(len)) == 0)
                << name << " step " << step << " rank " << r;
          }
        }
      }
    }
}

TEST(InProcessComm, MissingRankTimesOutAndBreaksTheGroup) {
  gc::InProcessGroup g(3, gc::Device::kCPU, 0.2);
  float x = 1.0f;
  auto errors = on_ranks(g, [&](int r) {
    if (r == 2) return;  // never arrives
    float y = 1.0f;
    g.comm(r).allreduce(&y, &y, 1, ElemType::kF32, ReduceOp::kSum);
  });
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("did not complete within 0.2 s"), std::string::npos) << errors[r];
  }
  EXPECT_EQ(errors[2], "");
  try {
    g.comm(2).allreduce(&x, &x, 1, ElemType::kF32, ReduceOp::kSum);
    ADD_FAILURE() << "a broken group accepted a collective";
  } catch (const gc::BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("broken"), std::string::npos) << e.what();
  }
  EXPECT_EQ(x, 1.0f);
}

TEST(InProcessComm, DisagreementThrowsOnEveryRankAndBadArgumentsLeaveNoTrace) {
  gc::InProcessGroup g(2);
  std::vector<uint32_t> out(8, 0);
  auto errors = on_ranks(g, [&](int r) {
    std::vector<uint32_t> mine(3 + r, 5);
    std::vector<uint32_t> all(8, 0);
    g.comm(r).allgather(mine.data(), all.data(), mine.size(), ElemType::kU32);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("rank 0 asks for allgather of 3 elements"), std::string::npos)
        << errors[r];
  // argument errors are raised before any rank waits: the group stays usable
  uint32_t v = 1;
  EXPECT_THROW(g.comm(0).broadcast(&v, &v, 1, ElemType::kU32, 2), gc::InvalidArgument);
  EXPECT_THROW(g.comm(0).alltoall(&v, &v, 1, ElemType::kU32), gc::InvalidArgument);
  EXPECT_THROW(g.comm(0).allreduce(&v, &v, 1, ElemType::kU32, ReduceOp::kMean),
               gc::InvalidArgument);
  EXPECT_EQ(v, 1u);
  EXPECT_THROW(g.comm(2), gc::InvalidArgument);
  EXPECT_THROW(gc::InProcessGroup(0), gc::InvalidArgument);
  expect_no_errors(on_ranks(g, [&](int r) {
    uint32_t w = uint32_t(r + 1);
    g.comm(r).allreduce(&w, &out[r], 1, ElemType::kU32, ReduceOp::kSum);
  }));
  EXPECT_EQ(out[0], 3u);
  EXPECT_EQ(out[1], 3u);
}

TEST(InProcessComm, CudaBuffersGiveTheCpuBits) {
  if (gc::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const int P = 4;
  for (ElemType t : {ElemType::kF32, ElemType::kF16, ElemType::kBF16})
    for (int64_t n : kSizes) {
      SCOPED_TRACE("type " + std::to_string(int(t)) + " n=" + std::to_string(n));
      const size_t bytes = static_cast<size_t>(n) * gc::elem_size(t);
      std::vector<std::vector<uint8_t>> in, host(P, std::vector<uint8_t>(bytes));
      for (int r = 0; r < P; ++r) in.push_back(input(t, n, r, 3));
      const auto mean = ordered_sum(t, in, n, 0, true);
      gc::InProcessGroup g(P, gc::Device::kCUDA);
      expect_no_errors(on_ranks(g, [&](int r) {
        gc::Buffer d(gc::Device::kCUDA);
        auto* p = d.get<uint8_t>(bytes + 1);
        gc::device_copy(p, gc::Device::kCUDA, in[r].data(), gc::Device::kCPU, bytes, nullptr);
        g.comm(r).allreduce(p, p, n, t, ReduceOp::kMean);
        gc::device_copy(host[r].data(), gc::Device::kCPU, p, gc::Device::kCUDA, bytes, nullptr);
        gc::cuda::stream_synchronize(nullptr);
      }));
      for (int r = 0; r < P; ++r) EXPECT_EQ(host[r], mean) << "rank " << r;
    }
}

TEST(InProcessComm, HierarchicalPlanOnCudaBuffersGivesTheCpuResult) {
  // 2 nodes x 2 ranks, a CUDA bucket per rank, node and cross groups of CUDA buffers: the plain
  // two-level average is bitwise the CPU simulation's (fp32 sums in rank order on both); top-k's
  // equals it to rounding (its CUDA selection and coding differ from the CPU's)
  if (gc::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* name : {"allreduce", "topk"}) {
    SCOPED_TRACE(name);
    const int64_t n = 40003;
    const size_t bytes = static_cast<size_t>(n) * 4;
    // (exact selection: the sampled threshold's estimate may differ between the devices)
    const gc::PlanOptions o =
        std::string(name) == "topk"
            ? gc::PlanOptions{{"ratio", 0.05}, {"method", std::string("exact")}}
            : gc::PlanOptions{};
    std::vector<std::vector<float>> in(4), want(4), got(4, std::vector<float>(n));
    std::vector<std::unique_ptr<gc::BucketPlan>> cpu, gpu;
    std::vector<gc::Plan*> ps;
    for (int r = 0; r < 4; ++r) {
      in[r] = gc::test::rank_input(n, r, 1);
      want[r] = in[r];
      gc::BucketSpec b;
      b.numel = n;
      b.world = 4;
      b.rank = r;
      cpu.push_back(gc::make_hierarchical_plan(name, b, 2, o));
      b.device = gc::Device::kCUDA;
      gpu.push_back(gc::make_hierarchical_plan(name, b, 2, o));
      cpu[r]->begin(gc::TensorView::cpu(want[r].data(), n));
      ps.push_back(cpu[r].get());
    }
    gc::run_plans_in_process(ps, 2);
    gc::InProcessGroup node0(2, gc::Device::kCUDA), node1(2, gc::Device::kCUDA),
        cross0(2, gc::Device::kCUDA), cross1(2, gc::Device::kCUDA);
    gc::InProcessGroup* nodes[2] = {&node0, &node1};
    gc::InProcessGroup* cross[2] = {&cross0, &cross1};
    std::vector<std::thread> ts;
    for (int r = 0; r < 4; ++r)
      ts.emplace_back([&, r] {
        gc::Buffer d(gc::Device::kCUDA);
        float* p = d.get<float>(static_cast<size_t>(n));
        gc::device_copy(p, gc::Device::kCUDA, in[r].data(), gc::Device::kCPU, bytes, nullptr);
        const int64_t dims[1] = {n};
        gpu[r]->begin(gc::TensorView(p, dims, 1, gc::DType::kFloat32, gc::Device::kCUDA));
        gc::run_plan(*gpu[r], nodes[r / 2]->comm(r % 2), cross[r % 2]->comm(r / 2));
        gc::device_copy(got[r].data(), gc::Device::kCPU, p, gc::Device::kCUDA, bytes, nullptr);
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < 4; ++r) {
      if (std::string(name) == "allreduce") {
        ASSERT_EQ(std::memcmp(got[r].data(), want[r].data(), bytes), 0) << "rank " << r;
      } else {
        for (int64_t i = 0; i < n; ++i)
          ASSERT_NEAR(got[r][i], want[r][i], 1e-5f * (1.0f + std::abs(want[r][i])))
              << "rank " << r << " element " << i;
      }
      ASSERT_EQ(std::memcmp(got[r].data(), got[0].data(), bytes), 0) << "rank " << r;
    }
  }
}

// The cast plans' one-pass sum (kernels::sum_widened): the CUDA twin gives the CPU bits
// (skipped without a CUDA device; the CPU twin against the composition it replaced is in
// test_comm_plans.cpp). Here because this suite carries the cuda label the GPU check runs.
TEST(SumWidened, CudaTwinGivesTheCpuBits) {
  if (gc::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  namespace k = gc::kernels;
  const size_t P = 4;
  for (const gc::DType wire : {gc::DType::kFloat16, gc::DType::kBFloat16})
    for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}})
      for (const gc::DType out_t :
           {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16}) {
        SCOPED_TRACE(::testing::Message()
                     << gc::dtype_name(wire) << " n " << n << " out " << gc::dtype_name(out_t));
        const auto un = static_cast<size_t>(n);
        // same-signed values, some past fp16's range: sums that overflow to Inf but are never
        // NaN (a NaN's sign and payload follow each backend's fp32 addition)
        const size_t stride = un + 5;
        std::vector<uint16_t> blocks(P * stride, 0);
        for (size_t r = 0; r < P; ++r) {
          const auto v = gc::test::rank_input(n, static_cast<int>(r), 7);
          for (size_t i = 0; i < un; ++i)
            blocks[r * stride + i] = wire == gc::DType::kFloat16
                                         ? gc::float_to_half(std::fabs(v[i]) * 3e4f)
                                         : gc::float_to_bf16(std::fabs(v[i]));
        }
        const size_t ob = un * gc::dtype_size(out_t);
        std::vector<uint16_t> want_wire(un), got_wire(un), got_in_place(P * stride);
        std::vector<uint8_t> want(ob), got(ob);
        k::cpu::sum_widened(blocks.data(), wire, P, un, stride, want_wire.data(), want.data(),
                            out_t);
        gc::Buffer b(gc::Device::kCUDA), w(gc::Device::kCUDA), o(gc::Device::kCUDA);
        auto* db = b.get<uint16_t>(P * stride);
        gc::device_copy(db, gc::Device::kCUDA, blocks.data(), gc::Device::kCPU, P * stride * 2,
                        nullptr);
        k::sum_widened({gc::Device::kCUDA, nullptr}, db, wire, P, un, stride, w.get<uint16_t>(un),
                       o.get<uint8_t>(ob), out_t);
        k::sum_widened({gc::Device::kCUDA, nullptr}, db, wire, P, un, stride, db, nullptr, wire);
        gc::device_copy(got_wire.data(), gc::Device::kCPU, w.data(), gc::Device::kCUDA, un * 2,
                        nullptr);
        gc::device_copy(got.data(), gc::Device::kCPU, o.data(), gc::Device::kCUDA, ob, nullptr);
        gc::device_copy(got_in_place.data(), gc::Device::kCPU, db, gc::Device::kCUDA,
                        P * stride * 2, nullptr);
        gc::cuda::stream_synchronize(nullptr);
        EXPECT_EQ(got_wire, want_wire);
        EXPECT_EQ(got, want);
        EXPECT_TRUE(std::equal(want_wire.begin(), want_wire.end(), got_in_place.begin()))
            << "in place over block 0";
      }
}

TEST(Fp8Blocks, CudaTwinGivesTheCpuBits) {
  // the fp8 family's encode and rank-ordered sum on a GPU against the CPU twin: records (scales
  // and codes) and sums bitwise; a block with an Inf has a NaN scale on both, whose NaN's bits
  // follow each backend (so NaNs compare as NaNs)
  if (gc::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  namespace k = gc::kernels;
  const auto same = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, bool floats) {
    if (!floats) return a == b;
    for (size_t i = 0; i + 4 <= a.size(); i += 4) {
      float x, y;
      std::memcpy(&x, &a[i], 4);
      std::memcpy(&y, &b[i], 4);
      if (!(std::isnan(x) && std::isnan(y)) && std::memcmp(&x, &y, 4) != 0) return false;
    }
    return a.size() == b.size();
  };
  const int P = 3;
  for (const bool e5m2 : {false, true})
    for (const int block : {32, 256, 4096})
      for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}})
        for (const gc::DType t : {gc::DType::kFloat32, gc::DType::kFloat16, gc::DType::kBFloat16}) {
          SCOPED_TRACE(::testing::Message() << "e5m2 " << e5m2 << " block " << block << " n " << n
                                            << " " << gc::dtype_name(t));
          const size_t un = static_cast<size_t>(n), ts = gc::dtype_size(t);
          const int64_t nb = (n + block - 1) / block;
          const size_t rb = k::fp8_record_bytes(block), bytes = static_cast<size_t>(nb) * rb;
          std::vector<uint8_t> x(P * un * ts), want(P * bytes), got(P * bytes);
          for (int r = 0; r < P; ++r) {
            auto v = gc::test::rank_input(n, r, 3);
            if (r == 1 && n > 500) v[500] = INFINITY;
            for (size_t i = 0; i < un; ++i) gc::store_float(&x[r * un * ts], t, int64_t(i), v[i]);
          }
          for (int r = 0; r < P; ++r)
            k::fp8_encode_blocks({gc::Device::kCPU, nullptr}, &x[r * un * ts], t, n, nb, block,
                                 e5m2, &want[r * bytes]);
          gc::Buffer dx(gc::Device::kCUDA), dr(gc::Device::kCUDA), dsum(gc::Device::kCUDA),
              dout(gc::Device::kCUDA);
          auto* px = dx.get<uint8_t>(x.size());
          auto* pr = dr.get<uint8_t>(got.size());
          gc::device_copy(px, gc::Device::kCUDA, x.data(), gc::Device::kCPU, x.size(), nullptr);
          for (int r = 0; r < P; ++r)
            k::fp8_encode_blocks({gc::Device::kCUDA, nullptr}, px + r * un * ts, t, n, nb, block,
                                 e5m2, pr + r * bytes);
          gc::device_copy(got.data(), gc::Device::kCPU, pr, gc::Device::kCUDA, got.size(), nullptr);
          gc::cuda::stream_synchronize(nullptr);
          ASSERT_TRUE(same(got, want, false)) << "records";
          // the sum, encoded again and written in t, from the same records
          std::vector<uint8_t> want_rec(bytes), got_rec(bytes), want_out(un * ts), got_out(un * ts);
          k::fp8_sum_blocks({gc::Device::kCPU, nullptr}, want.data(), P, bytes, nb, block, e5m2,
                            float(P), want_rec.data(), want_out.data(), t, n);
          k::fp8_sum_blocks({gc::Device::kCUDA, nullptr}, pr, P, bytes, nb, block, e5m2, float(P),
                            dsum.get<uint8_t>(bytes), dout.get<uint8_t>(un * ts), t, n);
          gc::device_copy(got_rec.data(), gc::Device::kCPU, dsum.data(), gc::Device::kCUDA, bytes,
                          nullptr);
          gc::device_copy(got_out.data(), gc::Device::kCPU, dout.data(), gc::Device::kCUDA, un * ts,
                          nullptr);
          gc::cuda::stream_synchronize(nullptr);
          for (size_t i = 0; i < un; ++i) {  // in t, NaN-aware
            const auto value = [&](const std::vector<uint8_t>& v) {
              uint16_t h;
              float f;
              if (t == gc::DType::kFloat32) {
                std::memcpy(&f, &v[i * 4], 4);
                return f;
              }
              std::memcpy(&h, &v[i * 2], 2);
              return t == gc::DType::kFloat16 ? gc::half_to_float(h) : gc::bf16_to_float(h);
            };
            const float w = value(want_out), g = value(got_out);
            ASSERT_TRUE((std::isnan(w) && std::isnan(g)) ||
                        std::memcmp(&want_out[i * ts], &got_out[i * ts], ts) == 0)
                << "sum element " << i;
          }
          for (int64_t b = 0; b < nb; ++b) {  // scales as floats (NaN-aware), codes as bytes
            const size_t o = static_cast<size_t>(b) * rb;
            EXPECT_TRUE(same({want_rec.begin() + o, want_rec.begin() + o + 4},
                             {got_rec.begin() + o, got_rec.begin() + o + 4}, true))
                << "scale " << b;
            EXPECT_TRUE(std::equal(want_rec.begin() + o + 4, want_rec.begin() + o + rb,
                                   got_rec.begin() + o + 4))
                << "codes of block " << b;
          }
        }
}
