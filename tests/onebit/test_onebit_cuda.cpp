// SPDX-License-Identifier: Apache-2.0
// The 1-bit family on CUDA against its CPU twin: packed bits bitwise, scales to rounding, the
// error update exactly (given the scales sent), decodes bitwise in both directions, the averaging
// decode, the scalar (unaligned / fp16 / bf16) and vectorised (float4) quantize paths, bad input,
// and the two-phase plan run by a small device driver. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>

#include "device_driver.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/onebit_kernels.hpp"
#include "onebit/onebit_ref.hpp"
#include "plans/onebit_plan.hpp"
#include "test_util.hpp"

using namespace gradcomp;
using namespace gradcomp::test;

namespace {

std::vector<uint8_t> download_payload(const Payload& p) {
  std::vector<uint8_t> h(p.size());
  device_copy(h.data(), Device::kCPU, p.data(), Device::kCUDA, h.size(), nullptr);
  return h;
}

OneBitConfig make_cfg(OneBitScaling s, int64_t chunk = 0) {
  OneBitConfig c;
  c.scaling = s;
  c.block_size = chunk;
  c.tensor_id = 3;
  return c;
}

struct Shape {
  int64_t R, C;
};

/// One configuration: CPU and GPU compressors over `steps` steps. Before each step the CPU twin
/// loads the GPU state so that both see the same x = g + e: bits must then agree bitwise.
/// `offset` (elements) misaligns the gradient to force the scalar quantize path.
void compare_twins(const OneBitConfig& cfg, Shape sh, DType dt, int steps, int64_t offset = 0) {
  const int64_t n = sh.R * sh.C;
  SCOPED_TRACE(std::string(enum_name(cfg.scaling)) + " " + std::to_string(sh.R) + "x" +
               std::to_string(sh.C) + " " + dtype_name(dt) + " chunk " +
               std::to_string(cfg.block_size) + " offset " + std::to_string(offset));
  OneBitCompressor cpu(cfg, sh.R, sh.C, dt);
  OneBitCompressor gpu(cfg, sh.R, sh.C, dt, Device::kCUDA, gradcomp::cuda::current_device());
  const int es = dtype_size(dt);
  DevBuf dg((n + offset) * es);
  Payload pc, pg(Device::kCUDA);
  for (int step = 0; step < steps; ++step) {
    const auto st = gpu.state_dict();
    cpu.load_state_dict(st.data(), st.size());
    std::vector<float> e_prev(n);
    if (n) device_copy(e_prev.data(), Device::kCPU, gpu.error(), Device::kCUDA, 4 * n, nullptr);
    std::vector<float> g = normal(n, 300 + step);
    for (int64_t i = 0; i < n; i += 3) g[i] += 0.4f;
    std::vector<uint16_t> g16(n);
    const void* host_g = g.data();
    if (dt != DType::kFloat32) {
      for (int64_t i = 0; i < n; ++i) {
        g16[i] = dt == DType::kFloat16 ? float_to_half(g[i]) : float_to_bf16(g[i]);
        g[i] = dt == DType::kFloat16 ? half_to_float(g16[i]) : bf16_to_float(g16[i]);
      }
      host_g = g16.data();
    }
    dg.upload(host_g, n * es, offset * es);
    cpu.encode(TensorView(const_cast<void*>(host_g), {sh.R, sh.C}, dt, Device::kCPU), pc);
    gpu.encode(TensorView(dg.as<char>(offset * es), {sh.R, sh.C}, dt, Device::kCUDA,
                          gradcomp::cuda::current_device()),
               pg);
    const auto hg = download_payload(pg);
    ASSERT_EQ(hg.size(), pc.size());
    const View vc = view_of(pc.data()), vg = view_of(hg.data());
    ASSERT_EQ(0, std::memcmp(&vc.h, &vg.h, 64)) << "headers differ";
    const int64_t words = (n + 31) / 32, K = vc.h.section_bytes[2] / 4;
    for (int64_t w = 0; w < words; ++w) ASSERT_EQ(vc.bits[w], vg.bits[w]) << "word " << w;
    for (int64_t k = 0; k < K; ++k)
      ASSERT_NEAR(vc.scales[k], vg.scales[k], 2e-5 * (std::fabs(vc.scales[k]) + 1e-6)) << k;
    // GPU error update exactly x - decode(bits, GPU scales)
    std::vector<float> eg(n);
    if (n) device_copy(eg.data(), Device::kCPU, gpu.error(), Device::kCUDA, 4 * n, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i] + e_prev[i];
      const float want = x - ref_decoded(vg.bits, vg.scales, i, n, sh.C, cfg);
      ASSERT_TRUE(same_bits(eg[i], want)) << "error at " << i << ": " << eg[i] << " vs " << want;
    }
    // decodes agree bitwise across devices: GPU payload on both, CPU payload on both
    std::vector<float> base = normal(n, 5), a = base, b(n);
    DevBuf dd(4 * n);
    for (const std::vector<uint8_t>* pay :
         {&hg, static_cast<const std::vector<uint8_t>*>(nullptr)}) {
      const std::vector<uint8_t> bytes =
          pay ? *pay : std::vector<uint8_t>(pc.data(), pc.data() + pc.size());
      a = base;
      cpu.decode_add(bytes.data(), bytes.size(),
                     TensorView(a.data(), {sh.R, sh.C}, DType::kFloat32, Device::kCPU), 0.25f);
      DevBuf dp(bytes.size());
      dp.upload(bytes.data(), bytes.size());
      dd.upload(base.data(), 4 * n);
      gpu.decode_add(dp.p, bytes.size(),
                     TensorView(dd.p, {sh.R, sh.C}, DType::kFloat32, Device::kCUDA,
                                gradcomp::cuda::current_device()),
                     0.25f);
      dd.download(b.data(), 4 * n);
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), 4 * n)) << "decode differs";
    }
  }
}

const Shape kShapes[] = {{1, 1},  {1, 77}, {1000, 1}, {7, 13},     {1024, 1000},
                         {33, 3}, {0, 4},  {300, 37}, {1000003, 1}};

}  // namespace

TEST(OneBitCuda, ColumnMeansMatchesCpu) {
  GC_REQUIRE_GPU();
  for (Shape s : kShapes)
    compare_twins(make_cfg(OneBitScaling::kColumnMeans), s, DType::kFloat32, 3);
}

TEST(OneBitCuda, SignModesMatchCpu) {
  GC_REQUIRE_GPU();
  for (auto sc : {OneBitScaling::kSignL1, OneBitScaling::kSignL2}) {
    for (Shape s : kShapes) compare_twins(make_cfg(sc), s, DType::kFloat32, 3);
    // 128 .. 1024 in steps of 128: the fused one-warp-per-chunk pass (and the partial last chunk
    // through the two kernels); 32 and 96: the warp scale kernel with the separate quantize
    for (int64_t chunk : {32, 96, 128, 384, 1024, 8192, 1 << 16})
      for (Shape s : {Shape{7, 13}, Shape{100003, 1}, Shape{1024, 1000}})
        compare_twins(make_cfg(sc, chunk), s, DType::kFloat32, 2);
  }
}

TEST(OneBitCuda, ScalarPathHalfBFloat16AndMisaligned) {
  GC_REQUIRE_GPU();
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL2}) {
    for (DType dt : {DType::kFloat16, DType::kBFloat16})
      for (Shape s : {Shape{7, 13}, Shape{4097, 1}, Shape{64, 129}})
        compare_twins(make_cfg(sc), s, dt, 2);
    for (Shape s : {Shape{5000, 1}, Shape{64, 100}})
      compare_twins(make_cfg(sc), s, DType::kFloat32, 2, /*offset=*/1);
  }
}

TEST(OneBitCuda, DecodeAverageMatchesCpu) {
  GC_REQUIRE_GPU();
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1}) {
    const int64_t R = 300, C = 129, n = R * C;
    const int P = 4;
    std::vector<std::vector<uint8_t>> host(P);
    std::vector<std::unique_ptr<DevBuf>> dev;
    std::vector<const void*> hp(P), dp(P);
    std::vector<size_t> sz(P);
    for (int q = 0; q < P; ++q) {
      OneBitCompressor c(make_cfg(sc), R, C);
      std::vector<float> g = normal(n, 40 + q);
      Payload p;
      c.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), p);
      host[q].assign(p.data(), p.data() + p.size());
      dev.push_back(std::make_unique<DevBuf>(p.size()));
      dev[q]->upload(p.data(), p.size());
      hp[q] = host[q].data();
      dp[q] = dev[q]->p;
      sz[q] = p.size();
    }
    OneBitCompressor cpu(make_cfg(sc), R, C);
    OneBitCompressor gpu(make_cfg(sc), R, C, DType::kFloat32, Device::kCUDA,
                         gradcomp::cuda::current_device());
    std::vector<float> a = normal(n, 1), b(n);
    DevBuf dd(4 * n);
    dd.upload(a.data(), 4 * n);
    cpu.decode_average(hp.data(), sz.data(), P,
                       TensorView(a.data(), {R, C}, DType::kFloat32, Device::kCPU), 1.0f / P);
    gpu.decode_average(
        dp.data(), sz.data(), P,
        TensorView(dd.p, {R, C}, DType::kFloat32, Device::kCUDA, gradcomp::cuda::current_device()),
        1.0f / P);
    dd.download(b.data(), 4 * n);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), 4 * n));
  }
}

TEST(OneBitCuda, BadInputRejectedAndStateUnchanged) {
  GC_REQUIRE_GPU();
  const int64_t n = 100000;
  for (int64_t chunk : {0, 128}) {  // the two-kernel compress and the fused one
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    OneBitCompressor gpu(make_cfg(OneBitScaling::kSignL2, chunk), n, 1, DType::kFloat32,
                         Device::kCUDA, gradcomp::cuda::current_device());
    std::vector<float> g = normal(n, 2);
    DevBuf dg(4 * n);
    dg.upload(g.data(), 4 * n);
    const TensorView gv(dg.p, {n}, DType::kFloat32, Device::kCUDA,
                        gradcomp::cuda::current_device());
    Payload p(Device::kCUDA);
    gpu.encode(gv, p);
    const auto before = gpu.state_dict();
    g[54321] = std::numeric_limits<float>::quiet_NaN();
    g[60000] = std::numeric_limits<float>::infinity();
    dg.upload(g.data(), 4 * n);
    try {
      gpu.encode(gv, p);
      ADD_FAILURE() << "NaN accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("index 54321"), std::string::npos) << e.what();
    }
    EXPECT_EQ(gpu.state_dict(), before);
    EXPECT_EQ(gpu.step(), 1);
    // a CPU gradient is refused by a CUDA compressor
    EXPECT_THROW(gpu.encode(TensorView::cpu(g.data(), n), p), InvalidArgument);
    // corrupt payload on the device: rejected, output unchanged
    OneBitCompressor ok(make_cfg(OneBitScaling::kSignL2), n, 1);
    g[54321] = g[60000] = 0.0f;
    Payload pc;
    ok.encode(TensorView::cpu(g.data(), n), pc);
    std::vector<uint8_t> bytes(pc.data(), pc.data() + pc.size());
    bytes[0] ^= 0xff;  // magic
    DevBuf dp(bytes.size());
    dp.upload(bytes.data(), bytes.size());
    std::vector<float> out = normal(n, 3), back(n);
    DevBuf dd(4 * n);
    dd.upload(out.data(), 4 * n);
    const TensorView dv(dd.p, {n}, DType::kFloat32, Device::kCUDA,
                        gradcomp::cuda::current_device());
    EXPECT_THROW(gpu.decode_add(dp.p, bytes.size(), dv), CorruptPayload);
    EXPECT_THROW(gpu.decode_add(dp.p, bytes.size() - 8, dv), CorruptPayload);
    dd.download(back.data(), 4 * n);
    EXPECT_EQ(0, std::memcmp(out.data(), back.data(), 4 * n));
  }
}

TEST(OneBitCuda, LazyStateMatchesMaterializedStateAndRejectsInPlace) {
  GC_REQUIRE_GPU();
  // A keeps its error lazily across steps; B materializes it (error()) after every step. Both
  // must send the same bytes; then A rejects an Inf (checked before the in-place write) and both
  // continue identically.
  const int dev = gradcomp::cuda::current_device();
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1, OneBitScaling::kSignL2})
    for (int64_t chunk : {0, 128, 512})
      for (Shape s : {Shape{300, 37}, Shape{64, 2048}, Shape{100003, 1}}) {
        if (chunk && sc == OneBitScaling::kColumnMeans) continue;  // chunks are the sign modes'
        const int64_t n = s.R * s.C;
        SCOPED_TRACE(std::string(enum_name(sc)) + " " + std::to_string(s.R) + "x" +
                     std::to_string(s.C) + " chunk " + std::to_string(chunk));
        OneBitCompressor a(make_cfg(sc, chunk), s.R, s.C, DType::kFloat32, Device::kCUDA, dev);
        OneBitCompressor b(make_cfg(sc, chunk), s.R, s.C, DType::kFloat32, Device::kCUDA, dev);
        DevBuf dg(4 * n);
        const TensorView gv(dg.p, {s.R, s.C}, DType::kFloat32, Device::kCUDA, dev);
        Payload pa(Device::kCUDA), pb(Device::kCUDA);
        for (int t = 0; t < 5; ++t) {
          std::vector<float> g = heavy_tailed(n, 20 + t);
          if (t == 3) {
            g[n - 2] = std::numeric_limits<float>::infinity();
            dg.upload(g.data(), 4 * n);
            EXPECT_THROW(a.encode(gv, pa), InvalidArgument);
            EXPECT_EQ(a.step(), 3);
            g[n - 2] = 0.5f;
          }
          dg.upload(g.data(), 4 * n);
          a.encode(gv, pa);
          b.encode(gv, pb);
          ASSERT_EQ(download_payload(pa), download_payload(pb)) << "step " << t;
          (void)b.error();
        }
        EXPECT_EQ(a.state_dict(), b.state_dict());
      }
}

TEST(OneBitCuda, HadamardRotationMatchesCpuBitwise) {
  GC_REQUIRE_GPU();
  for (int64_t S : {2, 32, 128, 1024, 8192})
    for (int64_t nb : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{2000}, (int64_t{1} << 20) + 5}) {
      // the last count exceeds the kernel's grid (2^20 thread blocks): blocks are reused
      if (S * nb > (int64_t{1} << 26)) continue;
      SCOPED_TRACE("S " + std::to_string(S) + " blocks " + std::to_string(nb));
      const int64_t n = S * nb;
      for (bool inverse : {false, true}) {
        std::vector<float> h = normal(n, 5, 3.0f), got(n);
        DevBuf d(4 * n);
        d.upload(h.data(), 4 * n);
        kernels::cuda::hadamard_rotate(d.as<float>(), nb, S, 7, inverse, nullptr);
        kernels::cpu::hadamard_rotate(h.data(), nb, S, 7, inverse);
        d.download(got.data(), 4 * n);
        ASSERT_EQ(0, std::memcmp(h.data(), got.data(), 4 * n)) << "inverse " << inverse;
      }
    }
}

TEST(OneBitCuda, PlanRanksAgreeBitwiseAndMatchCpuPlan) {
  GC_REQUIRE_GPU();
  for (bool rotate : {false, true}) {
    SCOPED_TRACE(rotate ? "rotated" : "not rotated");
    OneBitConfig cfg = make_cfg(OneBitScaling::kSignL2, rotate ? 128 : 0);
    cfg.rotate = rotate;
    cfg.momentum = rotate ? 0.9 : 0.0;
    for (int P : {1, 3, 8})
      for (int64_t n : {int64_t{33}, int64_t{100003}}) {
        SCOPED_TRACE("P " + std::to_string(P) + " n " + std::to_string(n));
        std::vector<std::unique_ptr<OneBitAllreducePlan>> gp, cp;
        std::vector<std::unique_ptr<DevBuf>> dg, dout;
        std::vector<std::vector<float>> g(P), out(P, std::vector<float>(n));
        for (int r = 0; r < P; ++r) {
          gp.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r, Device::kCUDA,
                                                             gradcomp::cuda::current_device()));
          cp.push_back(std::make_unique<OneBitAllreducePlan>(cfg, n, P, r));
          g[r] = normal(n, 70 + r);
          dg.push_back(std::make_unique<DevBuf>(4 * n));
          dg[r]->upload(g[r].data(), 4 * n);
          dout.push_back(std::make_unique<DevBuf>(4 * n));
        }
        for (int step = 0; step < 3; ++step) {
          std::vector<OneBitAllreducePlan*> gps;
          std::vector<Plan*> cps;
          for (int r = 0; r < P; ++r) {
            const int dev = gradcomp::cuda::current_device();
            gp[r]->begin(TensorView(dg[r]->p, {n}, DType::kFloat32, Device::kCUDA, dev),
                         TensorView(dout[r]->p, {n}, DType::kFloat32, Device::kCUDA, dev));
            cp[r]->begin(TensorView::cpu(g[r].data(), n), TensorView::cpu(out[r].data(), n));
            gps.push_back(gp[r].get());
            cps.push_back(cp[r].get());
          }
          run_device_plans(gps);
          run_plans_in_process(cps);
          std::vector<float> r0(n), rr(n);
          dout[0]->download(r0.data(), 4 * n);
          for (int r = 1; r < P; ++r) {
            dout[r]->download(rr.data(), 4 * n);
            ASSERT_EQ(0, std::memcmp(r0.data(), rr.data(), 4 * n)) << "rank " << r;
          }
          if (rotate) {  // compare in the rotated domain, where one value is one sign and a scale
            kernels::cpu::hadamard_rotate(r0.data(), n / 128, 128, 0, false);
            kernels::cpu::hadamard_rotate(out[0].data(), n / 128, 128, 0, false);
          }
          int64_t flips = 0;
          for (int64_t i = 0; i < n; ++i) {
            if (std::signbit(r0[i]) != std::signbit(out[0][i])) {
              ++flips;
              continue;
            }
            ASSERT_NEAR(r0[i], out[0][i], 1e-3 * std::fabs(out[0][i]) + 1e-6) << i;
          }
          EXPECT_LE(flips, n / 500 + 1);
        }
      }
  }
}
