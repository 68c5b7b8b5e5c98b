// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator (label cuda): bootstrapped over MPI, its collectives and the plans on CUDA
// buffers must give the bits of the CPU/MPI path. Compiled always; skips without a GPU (and with
// more ranks than GPUs: NCCL needs one GPU per rank). In a CPU-only build the constructor must
// throw NotBuiltWithCuda.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "comm_reference.hpp"
#include "gradcomp/comm.hpp"
#include "gradcomp/runtime.hpp"
#include "mpi_main.hpp"
#include "plans/cast_plan.hpp"
#include "plans/randomk_plan.hpp"
#include "plans/topk_plan.hpp"

namespace gc = gradcomp;

namespace {

gc::MpiCommunicator& mpi() { return gc::test::world(); }

struct DeviceVec {
  explicit DeviceVec(const std::vector<float>& h) : n(h.size()) {
    p = gc::cuda::malloc_async(std::max<size_t>(n, 1) * sizeof(float), nullptr);
    if (n) gc::cuda::memcpy_async(p, h.data(), n * sizeof(float), nullptr);
  }
  ~DeviceVec() { gc::cuda::free_async(p, nullptr); }
  std::vector<float> host() const {
    std::vector<float> h(n);
    if (n) gc::cuda::memcpy_async(h.data(), p, n * sizeof(float), nullptr);
    gc::cuda::stream_synchronize(nullptr);
    return h;
  }
  size_t n;
  void* p;
};

#define REQUIRE_GPU_PER_RANK()                                                            \
  do {                                                                                    \
    GC_REQUIRE_GPU();                                                                     \
    if (mpi().size() > 1)                                                                 \
      GTEST_SKIP() << "NCCL needs one GPU per rank; this test selects device 0 only, so " \
                      "it runs with -np 1 (got "                                          \
                   << mpi().size() << " ranks)";                                          \
  } while (0)

}  // namespace

TEST(Nccl, WithoutCudaTheConstructorThrows) {
  if (gc::built_with_cuda()) GTEST_SKIP() << "built with CUDA";
  EXPECT_THROW(gc::NcclCommunicator(mpi(), nullptr), gc::NotBuiltWithCuda);
}

TEST(Nccl, CollectivesMatchOrderedReference) {
  REQUIRE_GPU_PER_RANK();
  gc::NcclCommunicator nccl(mpi(), nullptr, {.timeout_s = 60});
  const int P = nccl.size();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1001}, int64_t{300007}}) {
    auto x = gc::test::normal(n, 7 + nccl.rank());
    DeviceVec d(x);
    nccl.allreduce(d.p, d.p, n, gc::ElemType::kF32, gc::ReduceOp::kMean);
    std::vector<float> want(x.size());
    mpi().allreduce(x.data(), want.data(), n, gc::ElemType::kF32, gc::ReduceOp::kMean);
    EXPECT_TRUE(gc::test::same_bits(want, d.host().data())) << "n=" << n << " P=" << P;
  }
  nccl.barrier();
}

TEST(Nccl, PlansOnCudaMatchCpuPlans) {
  REQUIRE_GPU_PER_RANK();
  gc::NcclCommunicator nccl(mpi(), nullptr, {.timeout_s = 60});
  const int P = nccl.size(), me = nccl.rank();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{4097}, int64_t{200003}}) {
    auto x = gc::test::rank_input(n, me, 0);
    // dense and fp16 cast
    for (int which = 0; which < 2; ++which) {
      std::unique_ptr<gc::GradientPlan> cpu, gpu;
      if (which == 0) {
        cpu = std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P);
        gpu =
            std::make_unique<gc::DenseAllreducePlan>(n, gc::DType::kFloat32, P, gc::Device::kCUDA);
      } else {
        cpu =
            std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, gc::DType::kFloat16, P);
        gpu = std::make_unique<gc::CastAllreducePlan>(n, gc::DType::kFloat32, gc::DType::kFloat16,
                                                      P, gc::Device::kCUDA);
      }
      auto h = x;
      cpu->begin(gc::TensorView::cpu(h.data(), n));
      gc::run_plan(*cpu, mpi());
      DeviceVec d(x);
      gpu->begin(gc::TensorView(d.p, {n}, gc::DType::kFloat32, gc::Device::kCUDA));
      gc::run_plan(*gpu, nccl);
      EXPECT_TRUE(gc::test::same_bits(h, d.host().data())) << gpu->name() << " n=" << n;
    }
    // top-k (both routes) and random-k over 3 steps
    gc::TopKConfig tcfg;
    tcfg.ratio = 0.01;
    tcfg.select.method = gc::SelectMethod::kExact;
    gc::RandomKConfig rcfg;
    for (auto route : {gc::TopKRoute::kSparse, gc::TopKRoute::kDense}) {
      gc::TopKAllreducePlan cpu(tcfg, n, P, {.route = route});
      gc::TopKAllreducePlan gpu(tcfg, n, P, {.route = route}, gc::DType::kFloat32,
                                gc::Device::kCUDA);
      gc::RandomKAllreducePlan rcpu(rcfg, n, P);
      gc::RandomKAllreducePlan rgpu(rcfg, n, P, gc::DType::kFloat32, gc::Device::kCUDA);
      for (int s = 0; s < 3; ++s) {
        auto in = gc::test::rank_input(n, me, s);
        auto h = in;
        cpu.begin(gc::TensorView::cpu(h.data(), n));
        gc::run_plan(cpu, mpi());
        DeviceVec d(in);
        gpu.begin(gc::TensorView(d.p, {n}, gc::DType::kFloat32, gc::Device::kCUDA));
        gc::run_plan(gpu, nccl);
        EXPECT_TRUE(gc::test::same_bits(h, d.host().data())) << "topk n=" << n << " step " << s;
        auto rh = in;
        rcpu.begin(gc::TensorView::cpu(rh.data(), n));
        gc::run_plan(rcpu, mpi());
        DeviceVec rd(in);
        rgpu.begin(gc::TensorView(rd.p, {n}, gc::DType::kFloat32, gc::Device::kCUDA));
        gc::run_plan(rgpu, nccl);
        EXPECT_TRUE(gc::test::same_bits(rh, rd.host().data()))
            << "randomk n=" << n << " step " << s;
      }
    }
  }
}

/// Largest relative difference between a and b, ignoring at most `allowed_flips` elements whose
/// signs differ (a CUDA and a CPU reduction may round a near-zero average to either side).
void expect_close(const std::vector<float>& want, const std::vector<float>& got, double rtol,
                  int64_t allowed_flips, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int64_t flips = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " i=" << i;
    if (std::signbit(want[i]) != std::signbit(got[i]) && want[i] != 0.0f && got[i] != 0.0f) {
      ++flips;
      continue;
    }
    ASSERT_NEAR(got[i], want[i], rtol * (std::fabs(want[i]) + 1e-3)) << what << " i=" << i;
  }
  EXPECT_LE(flips, allowed_flips) << what << ": sign flips";
}

namespace {

// One step of the same plan on the CPU (over MPI, on h in place) and on CUDA (over NCCL, on d:
// h's device copy).
template <class CpuPlan, class GpuPlan>
void step_both(CpuPlan& cpu, GpuPlan& gpu, std::vector<float>& h, DeviceVec& d,
               gc::NcclCommunicator& nccl) {
  cpu.begin(h.data());
  gc::run_plan(cpu.plan(), mpi());
  gpu.begin(static_cast<float*>(d.p));
  gc::run_plan(gpu.plan(), nccl);
}

}  // namespace

TEST(Nccl, OneBitAndPowerSGDOnCudaMatchCpuPlans) {
  REQUIRE_GPU_PER_RANK();
  gc::NcclCommunicator nccl(mpi(), nullptr, {.timeout_s = 60});
  const int P = nccl.size(), me = nccl.rank();
  gc::OneBitConfig ocfg;
  ocfg.scaling = gc::OneBitScaling::kSignL2;
  gc::PowerSGDConfig pcfg;
  pcfg.rank = 4;
  pcfg.seed = 3;
  const std::vector<std::vector<int64_t>> shapes = {{64, 3, 7, 7},   {64},   {48, 64},  {48, 64},
                                                    {256, 64, 1, 1}, {6, 5}, {1000, 40}};
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{4097}, int64_t{200003}}) {
    gc::test::OneBitRankPlan cpu(ocfg, n, P, me), gpu(ocfg, n, P, me, gc::Device::kCUDA);
    for (int s = 0; s < 3; ++s) {
      auto h = gc::test::rank_input(n, me, s);
      DeviceVec d(h);
      step_both(cpu, gpu, h, d, nccl);
      std::vector<float> got(static_cast<size_t>(n));
      if (n) gc::cuda::memcpy_async(got.data(), gpu.result(nullptr), n * sizeof(float), nullptr);
      gc::cuda::stream_synchronize(nullptr);
      std::vector<float> want(cpu.result(nullptr), cpu.result(nullptr) + n);
      expect_close(want, got, 1e-5, std::max<int64_t>(2, n / 500),
                   "onebit n=" + std::to_string(n) + " step " + std::to_string(s));
    }
  }
  gc::test::PowerSGDRankPlan cpu(pcfg, shapes, P), gpu(pcfg, shapes, P, gc::Device::kCUDA);
  const int64_t n = cpu.numel();
  for (int s = 0; s < 3; ++s) {
    auto h = gc::test::rank_input(n, me, s);
    DeviceVec d(h);
    step_both(cpu, gpu, h, d, nccl);
    // cuBLAS and BLAS sum in different orders: equal up to fp32 rounding of the projections
    // (difference relative to the largest element, as the PowerSGD CUDA twin tests measure it)
    const auto got = d.host();
    double diff = 0, scale = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "powersgd i=" << i;
      diff = std::max(diff, double(std::fabs(got[i] - h[i])));
      scale = std::max(scale, double(std::fabs(h[i])));
    }
    EXPECT_LT(diff, 1e-3 * scale) << "powersgd step " << s;
  }
  nccl.barrier();
}

GC_MPI_TEST_MAIN()
