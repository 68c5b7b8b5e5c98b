// SPDX-License-Identifier: Apache-2.0
// PowerSGD CUDA twins: every CUDA entry point against its CPU twin, and a whole GPU bucket step
// against the CPU one. Always compiled; skipped without a GPU.
#include <cstring>
#include <memory>
#include <utility>

#include "gradcomp/detail/numeric.hpp"
#include "kernels/powersgd_kernels.hpp"
#include "kernels/topk_kernels.hpp"
#include "plans/powersgd_plan.hpp"
#include "psgd_test_util.hpp"

namespace gradcomp::test {
namespace {

/// Device copy of a host vector; freed (after a sync) on destruction.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    p = static_cast<T*>(cuda::malloc_async(std::max<size_t>(1, n) * sizeof(T), nullptr));
    if (n) cuda::memcpy_async(p, h.data(), n * sizeof(T), nullptr);
    cuda::stream_synchronize(nullptr);
  }
  std::vector<T> host() const {
    std::vector<T> h(n);
    if (n) cuda::memcpy_async(h.data(), p, n * sizeof(T), nullptr);
    cuda::stream_synchronize(nullptr);
    return h;
  }
  ~Dev() {
    cuda::stream_synchronize(nullptr);
    cuda::free_async(p, nullptr);
    cuda::stream_synchronize(nullptr);
  }
};

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / std::max(den, 1e-30);
}

TEST(PowerSGDCuda, OrthogonalizeMatchesCpuTwin) {
  GC_REQUIRE_GPU();
  kernels::PsgdContext gctx(Device::kCUDA), cctx(Device::kCPU);
  struct C {
    int64_t n;
    int r;
  };
  for (C c : {C{1, 1}, C{7, 3}, C{1000, 4}, C{30000, 8}, C{64, 32}, C{300, 16}}) {
    const int batch = 3;
    auto p = normal(c.n * c.r * batch, 5 + c.n);
    if (c.r >= 4)  // a zero and a duplicate column in member 0
      for (int64_t i = 0; i < c.n; ++i) {
        p[i * c.r + 1] = 0.0f;
        p[i * c.r + 3] = p[i * c.r + 0];
      }
    for (Orthogonalization how :
         {Orthogonalization::kGramSchmidt, Orthogonalization::kHouseholder}) {
      auto cpu = p;
      kernels::cpu::orthogonalize(cpu.data(), batch, c.n, c.r, 1e-8f, how, cctx);
      Dev<float> d(p);
      kernels::cuda::orthogonalize(d.p, batch, c.n, c.r, 1e-8f, how, gctx);
      const auto gpu = d.host();
      for (float x : gpu) ASSERT_TRUE(std::isfinite(x));
      if (how == Orthogonalization::kGramSchmidt) {
        EXPECT_LT(max_rel(gpu, cpu), 1e-3) << c.n << "x" << c.r;
      } else {
        // Householder: a full-rank member's Q is unique up to the sign of each column. Member 0
        // (r >= 4) has a zero column 1 and a duplicate column 3. Column 1 is exactly zero, so
        // both libraries take the identity reflector there and columns 0 and 2 still agree;
        // column 3 is zero only up to rounding, its reflector follows that rounding (which
        // differs between cuSOLVER and LAPACK), and from there on Q is a completion that only
        // has to be orthonormal and keep the span. Checked: every column of Q has norm 1 and is
        // orthogonal to the others, and each input column k lies in the span of Q's columns
        // 0..k; columns equal up to sign where they are unique.
        auto col = [&](const std::vector<float>& v, int b, int64_t i, int k) {
          return double(v[(b * c.n + i) * c.r + k]);
        };
        for (int b = 0; b < batch; ++b) {
          const bool deficient = b == 0 && c.r >= 4;
          for (int k = 0; k < c.r; ++k) {
            if (c.n < c.r && k >= c.n) break;  // (no test case has n < r)
            for (int l = k; l < c.r; ++l) {
              double dot = 0;
              for (int64_t i = 0; i < c.n; ++i) dot += col(gpu, b, i, k) * col(gpu, b, i, l);
              EXPECT_NEAR(dot, k == l ? 1.0 : 0.0, 1e-3)
                  << c.n << "x" << c.r << " member " << b << " Q^T Q at " << k << "," << l;
            }
            if (!deficient || k == 0 || k == 2) {
              double dot = 0;
              for (int64_t i = 0; i < c.n; ++i) dot += col(gpu, b, i, k) * col(cpu, b, i, k);
              EXPECT_NEAR(std::fabs(dot), 1.0, 1e-3) << c.n << "x" << c.r << " col " << k;
            }
            // the input's column k against span(q_0..q_k): the residual is ~0 relative to |a_k|
            std::vector<double> a(c.n);
            double norm2 = 0;
            for (int64_t i = 0; i < c.n; ++i) {
              a[i] = p[(b * c.n + i) * c.r + k];
              norm2 += a[i] * a[i];
            }
            for (int l = 0; l <= k; ++l) {
              double proj = 0;
              for (int64_t i = 0; i < c.n; ++i) proj += col(gpu, b, i, l) * a[i];
              for (int64_t i = 0; i < c.n; ++i) a[i] -= proj * col(gpu, b, i, l);
            }
            double res2 = 0;
            for (int64_t i = 0; i < c.n; ++i) res2 += a[i] * a[i];
            EXPECT_LE(std::sqrt(res2), 1e-3 * std::sqrt(norm2) + 1e-6)
                << c.n << "x" << c.r << " member " << b << " input column " << k
                << " outside span(q_0..q_k)";
          }
        }
      }
    }
  }
}

TEST(PowerSGDCuda, FillQBitwiseEqualsCpu) {
  GC_REQUIRE_GPU();
  const int64_t m = 37;
  const int r = 3, batch = 2;
  std::vector<uint32_t> ids = {5, 9};
  std::vector<float> q(m * r * batch, 0.0f);
  for (int64_t i = 0; i < m; ++i) q[i * r + 1] = 1.0f;  // member 0 column 1 is not zero
  for (bool only_zero : {false, true}) {
    auto cq = q;
    kernels::PsgdGroup cg{batch, 1, m, r, nullptr, nullptr, cq.data(), ids.data()};
    kernels::cpu::fill_q(cg, 42, 3, only_zero);
    Dev<float> dq(q);
    Dev<uint32_t> did(ids);
    kernels::PsgdGroup gg{batch, 1, m, r, nullptr, nullptr, dq.p, did.p};
    kernels::cuda::fill_q(gg, 42, 3, only_zero, nullptr);
    const auto gq = dq.host();
    EXPECT_EQ(0, std::memcmp(gq.data(), cq.data(), cq.size() * 4)) << "only_zero " << only_zero;
  }
}

TEST(PowerSGDCuda, ElementwiseTwins) {
  GC_REQUIRE_GPU();
  kernels::PsgdContext gctx(Device::kCUDA);
  for (int64_t n : {0, 1, 1001, 300000}) {
    auto x = normal(n, 3);
    std::vector<uint16_t> h(n);
    for (int64_t i = 0; i < n; ++i) h[i] = float_to_half(x[i]);
    Dev<uint16_t> dh(h);
    // load (add), divide, store_result with error
    auto acc = normal(n, 4);
    auto cacc = acc;
    kernels::cpu::load(h.data(), DType::kFloat16, n, cacc.data(), true);
    kernels::cpu::divide(cacc.data(), n, 3.0f);
    Dev<float> dacc(acc);
    kernels::cuda::load(dh.p, DType::kFloat16, n, dacc.p, true, nullptr);
    kernels::cuda::divide(dacc.p, n, 3.0f, nullptr);
    EXPECT_EQ(dacc.host(), cacc);
    auto err = normal(n, 6);
    auto cerr = err;
    auto ch = h;
    kernels::cpu::store_result(cacc.data(), ch.data(), DType::kFloat16, n, cerr.data());
    Dev<float> derr(err);
    kernels::cuda::store_result(dacc.p, dh.p, DType::kFloat16, n, derr.p, nullptr);
    EXPECT_EQ(dh.host(), ch);
    EXPECT_EQ(derr.host(), cerr);
    kernels::cpu::store_mean(cacc.data(), n, 3.0f, ch.data(), DType::kFloat16);
    kernels::cuda::store_mean(dacc.p, n, 3.0f, dh.p, DType::kFloat16, nullptr);
    EXPECT_EQ(dh.host(), ch);
    if (n > 10) {
      x[n / 2] = std::nanf("");
      x[n - 1] = INFINITY;
      Dev<float> dx(x);
      kernels::SelectWorkspace ws(Device::kCUDA);  // the scan every family shares
      EXPECT_EQ(kernels::first_nonfinite({Device::kCUDA, nullptr}, dx.p, DType::kFloat32, n, ws),
                n / 2);
      EXPECT_EQ(kernels::cpu::first_nonfinite(x.data(), DType::kFloat32, n), n / 2);
    }
  }
}

TEST(PowerSGDCuda, BucketStepsMatchCpu) {
  GC_REQUIRE_GPU();
  const Shapes shapes = {{64, 48}, {64}, {32, 8, 3, 3}, {64, 48}, {3, 3}, {200, 150}};
  // fp32 and bf16 with error feedback; fp32 without (the gradient is M, GEMMs on it directly)
  const std::pair<DType, bool> cases[] = {
      {DType::kFloat32, true}, {DType::kBFloat16, true}, {DType::kFloat32, false}};
  for (auto [dt, ef] : cases) {
    PowerSGDConfig c;
    c.rank = 4;
    c.seed = 3;
    c.error_feedback = ef;
    PowerSGDState cst(c, shapes, dt, Device::kCPU);
    PowerSGDState gst(c, shapes, dt, Device::kCUDA);
    for (int step = 0; step < 4; ++step) {
      Bucket b(shapes, 100 + step);
      std::vector<std::vector<uint16_t>> half(shapes.size());
      std::vector<std::unique_ptr<Dev<uint8_t>>> dev;
      std::vector<TensorView> cv, gv;
      for (size_t i = 0; i < shapes.size(); ++i) {
        std::vector<uint8_t> bytes;
        if (dt == DType::kFloat32) {
          bytes.resize(b.data[i].size() * 4);
          std::memcpy(bytes.data(), b.data[i].data(), bytes.size());
        } else {
          half[i].resize(b.data[i].size());
          for (size_t e = 0; e < half[i].size(); ++e) half[i][e] = float_to_bf16(b.data[i][e]);
          bytes.resize(half[i].size() * 2);
          std::memcpy(bytes.data(), half[i].data(), bytes.size());
        }
        dev.push_back(std::make_unique<Dev<uint8_t>>(bytes));
        void* host = dt == DType::kFloat32 ? static_cast<void*>(b.data[i].data()) : half[i].data();
        cv.emplace_back(host, shapes[i].data(), static_cast<int>(shapes[i].size()), dt,
                        Device::kCPU);
        gv.emplace_back(dev.back()->p, shapes[i].data(), static_cast<int>(shapes[i].size()), dt,
                        Device::kCUDA);
      }
      PowerSGDPlan cp(cst, 1), gp(gst, 1);
      cp.begin(cv);
      gp.begin(gv);
      int nc = 0, ng = 0;
      while (cp.next()) ++nc;  // world 1: the allreduce is the identity
      while (gp.next()) ++ng;
      EXPECT_EQ(nc, ng);
      for (size_t i = 0; i < shapes.size(); ++i) {
        const auto bytes = dev[i]->host();
        std::vector<float> g(b.data[i].size()), h(b.data[i].size());
        for (size_t e = 0; e < g.size(); ++e) {
          if (dt == DType::kFloat32) {
            std::memcpy(&g[e], bytes.data() + 4 * e, 4);
            h[e] = b.data[i][e];
          } else {
            uint16_t u;
            std::memcpy(&u, bytes.data() + 2 * e, 2);
            g[e] = bf16_to_float(u);
            h[e] = bf16_to_float(half[i][e]);
          }
        }
        EXPECT_LT(max_rel(g, h), dt == DType::kFloat32 ? 1e-3 : 2e-2)
            << "step " << step << " tensor " << i << " ef " << ef;
        if (ef)
          EXPECT_LT(max_rel(gst.error(i), cst.error(i)), 1e-2)
              << "step " << step << " tensor " << i;
      }
    }
    // the GPU state loads into a CPU state of the same layout
    const auto bytes = gst.state_dict();
    PowerSGDState back(c, shapes, dt, Device::kCPU);
    back.load_state_dict(bytes.data(), bytes.size());
    EXPECT_EQ(back.error(0), gst.error(0));
    EXPECT_EQ(back.q(5), gst.q(5));
  }
}

TEST(PowerSGDCuda, RejectsNaNBeforeStateChanges) {
  GC_REQUIRE_GPU();
  PowerSGDConfig c;
  c.rank = 2;
  PowerSGDState st(c, {{16, 12}}, DType::kFloat32, Device::kCUDA);
  const auto before = st.state_dict();
  auto x = normal(192, 1);
  x[77] = std::nanf("");
  Dev<float> d(x);
  // CUDA scans the gradient in begin(); the step ends in next() as on the CPU: on_nonfinite=
  // "raise" raises naming the index, "skip" (the default) fills the gradient with NaN. Either
  // way no state changes.
  PowerSGDPlan plan(st, 1);
  plan.set_on_nonfinite(OnNonFinite::kRaise);
  try {
    plan.begin({TensorView(d.p, {16, 12}, DType::kFloat32, Device::kCUDA)});
    while (plan.next()) {  // world 1: every allreduce is the identity
    }
    ADD_FAILURE() << "NaN accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("index 77"), std::string::npos) << e.what();
  }
  EXPECT_EQ(st.state_dict(), before);
  PowerSGDPlan skip(st, 1);
  Dev<float> d2(x);
  skip.begin({TensorView(d2.p, {16, 12}, DType::kFloat32, Device::kCUDA)});
  EXPECT_NO_THROW({
    while (skip.next()) {
    }
  });
  EXPECT_TRUE(skip.skipped());
  for (float v : d2.host()) ASSERT_TRUE(std::isnan(v));
  EXPECT_EQ(st.state_dict(), before);
}

}  // namespace
}  // namespace gradcomp::test
