// SPDX-License-Identifier: Apache-2.0
// The multi-bit family on CUDA against its CPU twin: the compress (body and error bitwise) and
// the averaging decode (bitwise) for every bits x scale x scale dtype x rounding, and the
// two-phase plan on the device against the CPU plan (average and state bitwise, over steps, for
// fp32 and fp16 gradients). Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "device_driver.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/quant_kernels.hpp"
#include "plans/quant_plan.hpp"
#include "test_util.hpp"

using namespace gradcomp;
using namespace gradcomp::test;

/// A rank's gradient: normal(n, seed) as the bytes of dtype t (fp32, or rounded to fp16/bf16).
std::vector<uint8_t> gradient_bytes(int64_t n, DType t, uint64_t seed) {
  const auto v = normal(n, seed);
  std::vector<uint8_t> h(static_cast<size_t>(n) * dtype_size(t));
  for (int64_t i = 0; i < n; ++i) {
    if (t == DType::kFloat32) {
      std::memcpy(h.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t x = t == DType::kFloat16 ? float_to_half(v[i]) : float_to_bf16(v[i]);
      std::memcpy(h.data() + 2 * i, &x, 2);
    }
  }
  return h;
}

TEST(QuantCuda, CompressAndDecodeMatchTheCpuBitwise) {
  GC_REQUIRE_GPU();
  for (int bits : {2, 4, 8})
    for (bool asym : {false, true})
      for (bool half : {false, true})
        for (bool stochastic : {false, true})
          for (int64_t n : {int64_t{1}, int64_t{129}, int64_t{4137}, int64_t{300001}}) {
            SCOPED_TRACE(std::to_string(bits) + " bits asym " + std::to_string(asym) + " half " +
                         std::to_string(half) + " stochastic " + std::to_string(stochastic) +
                         " n " + std::to_string(n));
            kernels::QuantGeom geo;
            geo.n = n;
            geo.bits = bits;
            geo.block = 128;
            geo.asym = asym;
            geo.half = half;
            kernels::QuantRng rng;
            rng.stochastic = stochastic;
            rng.key = RngKey{5, 3, 7};
            rng.role = 2;
            const std::vector<float> g = heavy_tailed(n, 1), e = normal(n, 2, 0.1f);
            std::vector<float> e_cpu(n);
            std::vector<uint8_t> b_cpu(geo.body_bytes(), 0), b_gpu(geo.body_bytes());
            kernels::cpu::quant_compress(g.data(), DType::kFloat32, e.data(), e_cpu.data(), geo,
                                         rng, false, b_cpu.data());
            DevBuf dg(4 * n), de(4 * n), deo(4 * n), db(b_gpu.size());
            dg.upload(g.data(), 4 * n);
            de.upload(e.data(), 4 * n);
            db.upload(std::vector<uint8_t>(b_gpu.size(), 0).data(), b_gpu.size());
            kernels::cuda::quant_compress(dg.p, DType::kFloat32, de.as<float>(), deo.as<float>(),
                                          geo, rng, false, db.as<uint8_t>(), nullptr);
            std::vector<float> e_gpu(n);
            db.download(b_gpu.data(), b_gpu.size());
            deo.download(e_gpu.data(), 4 * n);
            ASSERT_EQ(b_cpu, b_gpu);
            ASSERT_EQ(0, std::memcmp(e_cpu.data(), e_gpu.data(), 4 * n));
            // the averaging decode of three payloads (the same one thrice is enough for the order)
            std::vector<float> d_cpu(n), d_gpu(n);
            const uint8_t* hp[3] = {b_cpu.data(), b_cpu.data(), b_cpu.data()};
            kernels::cpu::quant_decode_average(hp, 3, geo, 1.0f / 3, d_cpu.data());
            const uint8_t* dp[3] = {db.as<uint8_t>(), db.as<uint8_t>(), db.as<uint8_t>()};
            DevBuf dd(4 * n);
            kernels::QuantWorkspace ws(Device::kCUDA);
            kernels::cuda::quant_decode_average(dp, 3, geo, 1.0f / 3, dd.as<float>(), ws, nullptr);
            dd.download(d_gpu.data(), 4 * n);
            ASSERT_EQ(0, std::memcmp(d_cpu.data(), d_gpu.data(), 4 * n));
          }
}

// The compress has two forms on the device (a warp per block of 32 to 1024 elements, holding the
// block in registers, with float4 loads where fp32 and 16-byte aligned; a thread block per larger
// block) and the decode one thread per code word: every block size from 32 to 2048, fp32 / fp16 /
// bf16 gradients, aligned and misaligned (one element off: the scalar loads), with and without
// error feedback, nearest and stochastic, a partial last block and a partial last word, against
// the CPU twin bitwise.
TEST(QuantCuda, CompressFormsMatchTheCpuForEveryBlockSizeDtypeAndAlignment) {
  GC_REQUIRE_GPU();
  for (int64_t block : {32, 64, 128, 256, 512, 1024, 2048})
    for (int bits : {2, 4, 8})
      for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
        for (int off : {0, 1})
          for (bool ef : {true, false}) {
            const bool stochastic = (block + bits + off) % 2 == 0;  // half the cases each
            const bool asym = bits == 4 && ef;
            const int64_t n = 3 * block + 37;  // a partial block, and a partial word at 2 bits
            SCOPED_TRACE("block " + std::to_string(block) + " bits " + std::to_string(bits) + " " +
                         dtype_name(dt) + " offset " + std::to_string(off) + " ef " +
                         std::to_string(ef));
            kernels::QuantGeom geo;
            geo.n = n;
            geo.bits = bits;
            geo.block = block;
            geo.asym = asym;
            kernels::QuantRng rng;
            rng.stochastic = stochastic;
            rng.key = RngKey{9, 1, 4};
            rng.role = 1;
            rng.first = 4 * static_cast<uint64_t>(block);
            const size_t es = dtype_size(dt);
            const std::vector<uint8_t> g = gradient_bytes(n, dt, 7 + block);
            const std::vector<float> e = normal(n, 3, 0.1f);
            std::vector<float> e_cpu(n, -1.0f), e_gpu(n);
            std::vector<uint8_t> b_cpu(geo.body_bytes(), 0), b_gpu(geo.body_bytes());
            kernels::cpu::quant_compress(g.data(), dt, ef ? e.data() : nullptr,
                                         ef ? e_cpu.data() : nullptr, geo, rng, false,
                                         b_cpu.data());
            DevBuf dg((n + 1) * es), de(4 * (n + 1)), deo(4 * (n + 1)), db(b_gpu.size());
            dg.upload(g.data(), n * es, off * es);
            de.upload(e.data(), 4 * n, 4 * off);
            deo.upload(e_cpu.data(), 4 * n, 4 * off);  // (overwritten where it is written)
            db.upload(std::vector<uint8_t>(b_gpu.size(), 0).data(), b_gpu.size());
            kernels::cuda::quant_compress(
                dg.as<uint8_t>(off * es), dt, ef ? de.as<float>(4 * off) : nullptr,
                ef ? deo.as<float>(4 * off) : nullptr, geo, rng, false, db.as<uint8_t>(), nullptr);
            db.download(b_gpu.data(), b_gpu.size());
            ASSERT_EQ(b_cpu, b_gpu);
            if (ef) {
              std::vector<float> all(n + 1);
              deo.download(all.data(), 4 * (n + 1));
              ASSERT_EQ(0, std::memcmp(e_cpu.data(), all.data() + off, 4 * n));
            }
            std::vector<float> d_cpu(n), d_gpu(n);
            const uint8_t* hp[2] = {b_cpu.data(), b_cpu.data()};
            kernels::cpu::quant_decode_average(hp, 2, geo, 0.5f, d_cpu.data());
            const uint8_t* dp[2] = {db.as<uint8_t>(), db.as<uint8_t>()};
            DevBuf dd(4 * n);
            kernels::QuantWorkspace ws(Device::kCUDA);
            kernels::cuda::quant_decode_average(dp, 2, geo, 0.5f, dd.as<float>(), ws, nullptr);
            dd.download(d_gpu.data(), 4 * n);
            ASSERT_EQ(0, std::memcmp(d_cpu.data(), d_gpu.data(), 4 * n));
          }
}

TEST(QuantCuda, PlanMatchesTheCpuPlanBitwise) {
  GC_REQUIRE_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16})
    for (int bits : {2, 4, 8})
      for (bool rotate : {false, true}) {
        const int P = 3;
        const int64_t n = 100003;
        QuantConfig c;
        c.bits = bits;
        c.rotate = rotate;
        const int dev = gradcomp::cuda::current_device();
        std::vector<std::unique_ptr<QuantPlan>> cp, gp;
        for (int r = 0; r < P; ++r) {
          cp.push_back(std::make_unique<QuantPlan>(c, n, P, r, dt));
          gp.push_back(std::make_unique<QuantPlan>(c, n, P, r, dt, Device::kCUDA, dev));
        }
        const size_t es = dtype_size(dt);
        for (int step = 0; step < 3; ++step) {
          std::vector<std::vector<uint8_t>> h(P);
          std::vector<std::unique_ptr<DevBuf>> d;
          std::vector<QuantPlan*> gps;
          std::vector<Plan*> cps;
          for (int r = 0; r < P; ++r) {
            h[r] = gradient_bytes(n, dt, 10 * step + r);
            d.push_back(std::make_unique<DevBuf>(n * es));
            d[r]->upload(h[r].data(), n * es);
            gp[r]->begin(TensorView(d[r]->p, {n}, dt, Device::kCUDA, dev));
            cp[r]->begin(TensorView(h[r].data(), {n}, dt, Device::kCPU));
            gps.push_back(gp[r].get());
            cps.push_back(cp[r].get());
          }
          run_device_plans(gps);
          run_plans_in_process(cps);
          for (int r = 0; r < P; ++r) {
            std::vector<uint8_t> got(n * es);
            d[r]->download(got.data(), n * es);
            ASSERT_EQ(got, h[r]) << dtype_name(dt) << " bits " << bits << " rotate " << rotate
                                 << " step " << step << " rank " << r;
            ASSERT_EQ(gp[r]->state_dict(), cp[r]->state_dict());
          }
        }
      }
}

// FSDP2's shard plans on the device against the same plans on the CPU: every family with a shard
// form (the cast chunks, top-k exact and sampled, quant nearest and stochastic), reduce-scatter
// and allgather, fp32 and bf16 gradients, over steps (residuals and errors carry): the bucket
// each rank ends with and every plan's state bitwise equal.
TEST(QuantCuda, ShardPlansMatchTheCpuPlansBitwise) {
  GC_REQUIRE_GPU();
  struct Case {
    const char* name;
    PlanForm form;
    PlanOptions options;
  };
  const std::vector<Case> cases = {
      {"allreduce", PlanForm::kReduceScatter, {}},
      {"allreduce", PlanForm::kAllgather, {}},
      {"fp16", PlanForm::kReduceScatter, {}},
      {"bf16", PlanForm::kReduceScatter, {{"average", false}}},
      {"bf16", PlanForm::kAllgather, {}},
      {"topk", PlanForm::kReduceScatter, {{"ratio", 0.01}, {"method", std::string("exact")}}},
      {"topk", PlanForm::kReduceScatter, {{"ratio", 0.01}, {"method", std::string("sampled")}}},
      {"quant", PlanForm::kReduceScatter, {{"bits", int64_t{4}}}},
      {"quant",
       PlanForm::kReduceScatter,
       {{"bits", int64_t{2}}, {"rounding", std::string("stochastic")}}},
      {"quant", PlanForm::kAllgather, {}},
  };
  const int dev = gradcomp::cuda::current_device();
  for (const Case& k : cases)
    for (DType dt : {DType::kFloat32, DType::kBFloat16})
      for (int64_t c : {int64_t{1}, int64_t{4099}, int64_t{300001}}) {
        const int P = 3;
        const int64_t n = P * c;
        SCOPED_TRACE(std::string(k.name) + " " + std::string(enum_name(k.form)) + " " +
                     dtype_name(dt) + " chunk " + std::to_string(c));
        std::vector<std::unique_ptr<BucketPlan>> cp, gp;
        for (int r = 0; r < P; ++r) {
          BucketSpec b;
          b.numel = n;
          b.dtype = dt;
          b.world = P;
          b.rank = r;
          cp.push_back(make_shard_plan(k.name, b, k.form, k.options));
          b.device = Device::kCUDA;
          b.device_index = dev;
          gp.push_back(make_shard_plan(k.name, b, k.form, k.options));
        }
        const size_t es = dtype_size(dt);
        for (int step = 0; step < 3; ++step) {
          std::vector<std::vector<uint8_t>> h(P);
          std::vector<std::unique_ptr<DevBuf>> d;
          std::vector<BucketPlan*> gps;
          std::vector<Plan*> cps;
          for (int r = 0; r < P; ++r) {
            h[r] = gradient_bytes(n, dt, 100 * step + r);
            d.push_back(std::make_unique<DevBuf>(n * es));
            d[r]->upload(h[r].data(), n * es);
            gp[r]->begin(TensorView(d[r]->p, {n}, dt, Device::kCUDA, dev));
            cp[r]->begin(TensorView(h[r].data(), {n}, dt, Device::kCPU));
            gps.push_back(gp[r].get());
            cps.push_back(cp[r].get());
          }
          run_device_plans(gps);
          run_plans_in_process(cps);
          for (int r = 0; r < P; ++r) {
            std::vector<uint8_t> got(n * es);
            d[r]->download(got.data(), n * es);
            if (k.form == PlanForm::kReduceScatter) {  // only the own chunk is defined
              ASSERT_EQ(0, std::memcmp(got.data() + r * c * es, h[r].data() + r * c * es, c * es))
                  << "step " << step << " rank " << r;
            } else {
              ASSERT_EQ(got, h[r]) << "step " << step << " rank " << r;
            }
            ASSERT_FALSE(gp[r]->skipped());
            ASSERT_EQ(gp[r]->state_dict(), cp[r]->state_dict()) << "step " << step << " rank " << r;
          }
        }
      }
}
