// SPDX-License-Identifier: Apache-2.0
// Top-k family on CUDA against the CPU twin (and an independent reference where one is cheap):
// exact and sampled selection, the DGC and random-k compressors over 20 steps, payloads made on
// one device and decoded on the other, corrupt payloads, and every element-wise kernel.
// Each test skips itself (GC_REQUIRE_GPU) when no GPU is present; it is always compiled.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/topk_kernels.hpp"
#include "kernels/topk_math.h"
#include "test_util.hpp"

using namespace gradcomp;
using test::heavy_tailed;
using test::normal;
using test::reference_topk;

namespace {

/// Device memory owned by a test (default stream).
class Dev {
 public:
  explicit Dev(size_t bytes) : p_(gradcomp::cuda::malloc_async(bytes > 0 ? bytes : 1, nullptr)) {}
  Dev(Dev&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() {
    if (p_ == nullptr) return;
    try {
      gradcomp::cuda::free_async(p_, nullptr);
    } catch (...) {
    }
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_;
};

template <class T>
Dev upload(const std::vector<T>& h) {
  Dev d(h.size() * sizeof(T));
  device_copy(d.as(), Device::kCUDA, h.data(), Device::kCPU, h.size() * sizeof(T), nullptr);
  return d;
}

template <class T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> h(n);
  device_copy(h.data(), Device::kCPU, p, Device::kCUDA, n * sizeof(T), nullptr);
  return h;
}

TensorView cuda_view(void* p, int64_t n, DType t = DType::kFloat32) {
  return TensorView(p, {n}, t, Device::kCUDA);
}
TensorView cpu_view(void* p, int64_t n, DType t = DType::kFloat32) {
  return TensorView(p, {n}, t, Device::kCPU);
}

/// fp32 values stored as the bytes of dtype t (fp16/bf16 rounded to nearest even).
std::vector<uint8_t> to_bytes(const std::vector<float>& x, DType t) {
  std::vector<uint8_t> b(x.size() * static_cast<size_t>(dtype_size(t)));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DType::kFloat32) {
      std::memcpy(b.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t h = t == DType::kFloat16 ? float_to_half(x[i]) : float_to_bf16(x[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

/// Data of kind d: 0 normal, 1 heavy-tailed, 2 constant, 3 many ties and last-bit differences
/// (forces all three radix levels).
std::vector<float> make_data(int d, int64_t n, uint64_t seed) {
  switch (d) {
    case 0:
      return normal(n, seed);
    case 1:
      return heavy_tailed(n, seed);
    case 2:
      return std::vector<float>(static_cast<size_t>(n), 0.5f);
    default: {
      std::vector<float> x(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t b = 0x3f800000u + static_cast<uint32_t>((i * 7919) % 97);
        std::memcpy(&x[i], &b, 4);
        if (i % 3 == 0) x[i] = -x[i];
        if (i % 11 == 0) x[i] = 0.0f;
      }
      return x;
    }
  }
}

std::vector<uint32_t> select_cpu(const std::vector<float>& x, int64_t k, const SelectOptions& opt,
                                 const RngKey& key) {
  std::vector<uint32_t> out(static_cast<size_t>(k) + 1);
  std::vector<float> copy = x;
  const int64_t c = topk_indices(cpu_view(copy.data(), static_cast<int64_t>(copy.size())), k, opt,
                                 key, out.data());
  out.resize(static_cast<size_t>(c));
  return out;
}

std::vector<uint32_t> select_gpu(const Dev& x, int64_t n, int64_t k, const SelectOptions& opt,
                                 const RngKey& key) {
  Dev out((static_cast<size_t>(k) + 1) * 4);
  const int64_t c = topk_indices(cuda_view(x.as(), n), k, opt, key, out.as<uint32_t>());
  EXPECT_GE(c, 0);
  EXPECT_LE(c, k);
  return download<uint32_t>(out.as(), static_cast<size_t>(c));
}

SelectOptions method(SelectMethod m) {
  SelectOptions o;
  o.method = m;
  return o;
}

/// Counts elements that differ by more than fp32 rounding; reports the first.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float tol = 1e-6f + 1e-5f * std::fabs(want[i]);
    if (!(std::fabs(got[i] - want[i]) <= tol)) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": first mismatch at " << first << ": gpu " << got[first] << " cpu "
                     << want[first];
}

const int64_t kSizes[] = {0, 1, 7, 1023, 4097, (1 << 20) + 3};

/// A sparse payload made by hand (for codings a compressor would not pick, and for corruption).
std::vector<uint8_t> make_sparse(uint64_t n, const std::vector<uint32_t>& idx,
                                 const std::vector<float>& vals, IndexCoding coding) {
  PayloadHeader h;
  h.kind = static_cast<uint8_t>(PayloadKind::kSparse);
  h.value_dtype = static_cast<uint8_t>(DType::kFloat32);
  h.index_coding = static_cast<uint8_t>(coding);
  h.numel = n;
  h.count = idx.size();
  switch (coding) {
    case IndexCoding::kRaw32:
      h.section_bytes[0] = 4 * idx.size();
      break;
    case IndexCoding::kBitmap:
      h.section_bytes[0] = (n + 7) / 8;
      break;
    default:
      h.section_bytes[0] = delta_varint_bytes(idx.data(), idx.size());
      break;
  }
  h.section_bytes[1] = 4 * vals.size();
  std::vector<uint8_t> b(h.total_bytes(), 0);
  std::memcpy(b.data(), &h, sizeof h);
  encode_indices(idx.data(), idx.size(), n, coding, b.data() + h.section_offset(0));
  std::memcpy(b.data() + h.section_offset(1), vals.data(), 4 * vals.size());
  return b;
}

/// Index list of a payload held in host memory (validated by the CPU decoder).
std::vector<uint32_t> payload_indices(const std::vector<uint8_t>& bytes) {
  const PayloadHeader h = parse_header(bytes.data(), bytes.size());
  std::vector<uint32_t> idx(h.count);
  decode_indices(bytes.data() + h.section_offset(0), h.section_bytes[0],
                 IndexCoding(h.index_coding), h.count, h.numel, idx.data());
  return idx;
}

std::vector<uint8_t> host_bytes(const Payload& p) {
  if (p.device() == Device::kCPU) return std::vector<uint8_t>(p.data(), p.data() + p.size());
  return download<uint8_t>(p.data(), p.size());
}

}  // namespace

// ------------------------------------------------------------------------------------------------
TEST(TopKCudaSelect, ExactEqualsCpuAndReference) {
  GC_REQUIRE_GPU();
  for (int64_t n : kSizes) {
    for (int d = 0; d < 4; ++d) {
      const std::vector<float> x = make_data(d, n, 100 + n);
      const Dev dx = upload(x);
      std::set<int64_t> ks = {0, 1, 3, n / 1000 + 1, n / 100 + 1, n / 2, n - 1, n};
      for (int64_t k : ks) {
        if (k < 0 || k > n) continue;
        const auto want = reference_topk(x, k);
        const auto cpu = select_cpu(x, k, method(SelectMethod::kExact), {});
        const auto gpu = select_gpu(dx, n, k, method(SelectMethod::kExact), {});
        ASSERT_EQ(cpu, want) << "cpu n=" << n << " k=" << k << " data=" << d;
        ASSERT_EQ(gpu, cpu) << "n=" << n << " k=" << k << " data=" << d;
      }
    }
  }
}

TEST(TopKCudaSelect, ExactIsRepeatableWithAReusedWorkspace) {
  GC_REQUIRE_GPU();
  const int64_t n = 300007, k = 3001;
  const std::vector<float> x = make_data(1, n, 5);
  const Dev dx = upload(x);
  kernels::SelectWorkspace ws(Device::kCUDA);
  Dev out(4 * k);
  const auto want = reference_topk(x, k);
  for (int rep = 0; rep < 3; ++rep) {  // workspace reused: nothing stale may leak in
    const int64_t c = kernels::cuda::select(dx.as<float>(), n, k, method(SelectMethod::kExact), {},
                                            out.as<uint32_t>(), ws, nullptr);
    ASSERT_EQ(c, k);
    ASSERT_EQ(download<uint32_t>(out.as(), k), want) << "repetition " << rep;
  }
  // a smaller call after a bigger one, same workspace
  const int64_t c = kernels::cuda::select(dx.as<float>(), 5000, 17, method(SelectMethod::kExact),
                                          {}, out.as<uint32_t>(), ws, nullptr);
  ASSERT_EQ(c, 17);
  const std::vector<float> head(x.begin(), x.begin() + 5000);
  EXPECT_EQ(download<uint32_t>(out.as(), 17), reference_topk(head, 17));
}

TEST(TopKCudaSelect, SampledWithinBoundsAndEqualsCpu) {
  GC_REQUIRE_GPU();
  SelectOptions def = method(SelectMethod::kSampled);
  SelectOptions tight = def;  // aims at exactly k: exercises accepting fewer and retrying
  tight.oversample = 1.0;
  tight.min_fraction = 0.95;
  tight.max_retries = 1;
  SelectOptions loose = def;
  loose.min_fraction = 0.5;
  loose.sample_rate = 0.002;
  for (int64_t n : {int64_t{1023}, int64_t{4097}, int64_t{100003}, int64_t{(1 << 20) + 3}}) {
    for (int d = 0; d < 4; ++d) {
      const std::vector<float> x = make_data(d, n, 7 + n);
      const Dev dx = upload(x);
      for (double frac : {0.001, 0.01, 0.05}) {
        const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(frac * n)));
        for (const SelectOptions& opt : {def, tight, loose}) {
          for (uint64_t step : {0, 1}) {
            const RngKey key{9, step, 4};
            const auto gpu = select_gpu(dx, n, k, opt, key);
            const auto c = static_cast<int64_t>(gpu.size());
            const auto lo = static_cast<int64_t>(std::ceil(opt.min_fraction * k));
            ASSERT_GE(c, lo) << "n=" << n << " k=" << k << " data=" << d;
            ASSERT_LE(c, k) << "n=" << n << " k=" << k << " data=" << d;
            // ascending, in range, and nothing left out is larger than anything selected
            std::vector<uint8_t> in(static_cast<size_t>(n), 0);
            uint32_t min_sel = 0xffffffffu, max_unsel = 0;
            for (int64_t j = 0; j < c; ++j) {
              ASSERT_LT(gpu[j], static_cast<uint32_t>(n));
              if (j > 0) ASSERT_GT(gpu[j], gpu[j - 1]);
              in[gpu[j]] = 1;
              min_sel = std::min(min_sel, abs_bits(x[gpu[j]]));
            }
            for (int64_t i = 0; i < n; ++i)
              if (!in[i]) max_unsel = std::max(max_unsel, abs_bits(x[i]));
            if (c > 0 && c < n) ASSERT_GE(min_sel, max_unsel) << "n=" << n << " k=" << k;
            // same sample, same threshold, same retry rule: the CPU twin picks the same set
            EXPECT_EQ(gpu, select_cpu(x, k, opt, key)) << "n=" << n << " k=" << k << " d=" << d;
          }
        }
      }
    }
  }
}

TEST(TopKCudaSelect, SelectOnAMisalignedViewEqualsCpu) {
  GC_REQUIRE_GPU();
  // the candidate pass and the ordered compaction read float4 only from a 16-byte aligned x; one
  // element in, they read element by element and must pick the same set
  const int64_t n = 100003;
  for (int d = 0; d < 4; ++d) {
    const std::vector<float> x = make_data(d, n + 1, 40 + d);
    const Dev dx = upload(x);
    const std::vector<float> tail(x.begin() + 1, x.end());
    for (int64_t k : {int64_t{101}, int64_t{1001}})
      for (SelectMethod sm : {SelectMethod::kSampled, SelectMethod::kExact}) {
        const RngKey key{3, 1, 2};
        const SelectOptions opt = method(sm);
        kernels::SelectWorkspace ws(Device::kCUDA);
        Dev out(4 * k);
        const int64_t c = kernels::cuda::select(dx.as<float>() + 1, n, k, opt, key,
                                                out.as<uint32_t>(), ws, nullptr);
        ASSERT_GE(c, 0);
        EXPECT_EQ(download<uint32_t>(out.as(), static_cast<size_t>(c)),
                  select_cpu(tail, k, opt, key))
            << "k=" << k << " data=" << d;
      }
  }
}

// The encode without error feedback reads the gradient itself (no residual pass): its payload
// on the device equals the CPU twin's, bitwise, for exact and sampled selection, fp32 and fp16
// values, an aligned and a misaligned (one element off) gradient, sizes 1 to 2^20 + 3.
TEST(TopKCudaDirect, ErrorFeedbackOffPayloadEqualsCpu) {
  GC_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}, int64_t{(1 << 20) + 3}})
    for (SelectMethod m : {SelectMethod::kExact, SelectMethod::kSampled})
      for (DType vt : {DType::kFloat32, DType::kFloat16})
        for (int off : {0, 1}) {
          SCOPED_TRACE("n " + std::to_string(n) + " method " + std::to_string(int(m)) + " " +
                       dtype_name(vt) + " offset " + std::to_string(off));
          TopKConfig cfg;
          cfg.ratio = 0.01;
          cfg.select.method = m;
          cfg.value_dtype = vt;
          cfg.error_feedback = false;
          cfg.seed = 7;
          std::vector<float> g = normal(n + 1, 77);
          TopKCompressor cpu(cfg, n);
          TopKCompressor gpu(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
          Payload pc(Device::kCPU), pg(Device::kCUDA);
          const Dev dg = upload(g);
          cpu.encode(TensorView::cpu(g.data() + off, n), pc);
          gpu.encode(cuda_view(dg.as<float>() + off, n, DType::kFloat32), pg);
          ASSERT_EQ(pg.header.count, pc.header.count);
          const auto bc = host_bytes(pc), bg = host_bytes(pg);
          ASSERT_EQ(payload_indices(bg), payload_indices(bc));
          std::vector<float> dense_c(static_cast<size_t>(n), 0.0f);
          cpu.decode_add(pc.data(), pc.size(), cpu_view(dense_c.data(), n), 1.0f);
          const Dev dd = upload(std::vector<float>(static_cast<size_t>(n), 0.0f));
          gpu.decode_add(pg.data(), pg.size(), cuda_view(dd.as(), n), 1.0f);
          const auto dense_g = download<float>(dd.as(), n);
          ASSERT_EQ(0, std::memcmp(dense_g.data(), dense_c.data(), 4 * static_cast<size_t>(n)));
        }
}

// ------------------------------------------------------------------------------------------------
struct DgcCase {
  SelectMethod method;
  DType grad;
  DType values;
  bool nesterov;
  int64_t n;
};

class TopKCudaDgc : public ::testing::TestWithParam<DgcCase> {};

TEST_P(TopKCudaDgc, TwentyStepsMatchCpu) {
  GC_REQUIRE_GPU();
  const DgcCase p = GetParam();
  const int64_t n = p.n;
  TopKConfig cfg;
  cfg.ratio = 0.01;
  cfg.select.method = p.method;
  cfg.momentum = 0.9;
  cfg.nesterov = p.nesterov;
  cfg.clip_norm = 0.5 * std::sqrt(static_cast<double>(std::max<int64_t>(n, 1)));  // clips
  cfg.warmup_ratios = TopKConfig::dgc_warmup();
  cfg.warmup_steps = 3;
  cfg.value_dtype = p.values;
  cfg.seed = 42;
  cfg.tensor_id = 3;
  TopKCompressor cpu(cfg, n, p.grad);
  TopKCompressor gpu(cfg, n, p.grad, Device::kCUDA, 0, nullptr);
  Payload pc(Device::kCPU), pg(Device::kCUDA);
  for (int step = 0; step < 20; ++step) {
    std::vector<float> g = normal(n, 1000 + step);
    if (n > 10) g[static_cast<size_t>(step * 7 % n)] = 40.0f;  // a spike now and then
    std::vector<uint8_t> gb = to_bytes(g, p.grad);
    const Dev dg = upload(gb);
    cpu.encode(cpu_view(gb.data(), n, p.grad), pc);
    gpu.encode(cuda_view(dg.as(), n, p.grad), pg);
    ASSERT_EQ(pg.header.count, pc.header.count) << "step " << step;
    const auto bc = host_bytes(pc), bg = host_bytes(pg);
    ASSERT_EQ(payload_indices(bg), payload_indices(bc)) << "step " << step;
    // decode both on their own device
    std::vector<float> dense_c(static_cast<size_t>(n), 0.0f);
    cpu.decode_add(pc.data(), pc.size(), cpu_view(dense_c.data(), n), 0.5f);
    const Dev dd = upload(std::vector<float>(static_cast<size_t>(n), 0.0f));
    gpu.decode_add(pg.data(), pg.size(), cuda_view(dd.as(), n), 0.5f);
    expect_close(download<float>(dd.as(), n), dense_c, "decoded");
    expect_close(download<float>(gpu.residual(), n),
                 std::vector<float>(cpu.residual(), cpu.residual() + n), "residual");
    expect_close(download<float>(gpu.momentum_buffer(), n),
                 std::vector<float>(cpu.momentum_buffer(), cpu.momentum_buffer() + n), "momentum");
    if (testing::Test::HasFailure()) FAIL() << "at step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TopKCudaDgc,
    ::testing::Values(
        DgcCase{SelectMethod::kExact, DType::kFloat32, DType::kFloat32, false, 1},
        DgcCase{SelectMethod::kExact, DType::kFloat32, DType::kFloat32, false, 7},
        DgcCase{SelectMethod::kExact, DType::kFloat32, DType::kFloat32, false, 100003},
        DgcCase{SelectMethod::kSampled, DType::kFloat32, DType::kFloat32, false, 100003},
        DgcCase{SelectMethod::kExact, DType::kFloat16, DType::kFloat16, true, 4097},
        DgcCase{SelectMethod::kSampled, DType::kBFloat16, DType::kBFloat16, false, (1 << 20) + 3},
        DgcCase{SelectMethod::kSampled, DType::kFloat16, DType::kFloat32, true, 1023}));

TEST(TopKCudaCoded, TwentyStepsGiveTheCpuBits) {
  // value_bits: the k values coded by the multi-bit codec, whose twins give the same codes and
  // scales; the same indices, the same coded section, the same decode and residual as the CPU,
  // with error feedback and without it (the direct path), over 20 steps
  GC_REQUIRE_GPU();
  for (int bits : {2, 4})
    for (int64_t block : {32, 128})
      for (bool ef : {true, false})
        for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
          SCOPED_TRACE(::testing::Message()
                       << "bits " << bits << " block " << block << " ef " << ef << " n " << n);
          TopKConfig cfg;
          cfg.ratio = 0.03;
          cfg.select.method = SelectMethod::kExact;
          cfg.value_bits = bits;
          cfg.value_block = block;
          cfg.error_feedback = ef;
          TopKCompressor cpu(cfg, n);
          TopKCompressor gpu(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
          Payload pc(Device::kCPU), pg(Device::kCUDA);
          for (int step = 0; step < 20; ++step) {
            std::vector<float> g = heavy_tailed(n, 2000 + step);
            const Dev dg = upload(g);
            cpu.encode(TensorView::cpu(g.data(), n), pc);
            gpu.encode(cuda_view(dg.as<float>(), n, DType::kFloat32), pg);
            ASSERT_EQ(pg.header.count, pc.header.count) << "step " << step;
            const auto bc = host_bytes(pc), bg = host_bytes(pg);
            ASSERT_EQ(payload_indices(bg), payload_indices(bc)) << "step " << step;
            ASSERT_EQ(pg.header.section_bytes[2], pc.header.section_bytes[2]);
            ASSERT_EQ(
                0, std::memcmp(bg.data() + pg.header.section_offset(2),
                               bc.data() + pc.header.section_offset(2), pc.header.section_bytes[2]))
                << "coded values differ at step " << step;
            std::vector<float> dense_c(static_cast<size_t>(n), 0.0f);
            cpu.decode_add(pc.data(), pc.size(), cpu_view(dense_c.data(), n), 0.5f);
            const Dev dd = upload(std::vector<float>(static_cast<size_t>(n), 0.0f));
            gpu.decode_add(pg.data(), pg.size(), cuda_view(dd.as(), n), 0.5f);
            const auto dense_g = download<float>(dd.as(), n);
            ASSERT_EQ(0, std::memcmp(dense_g.data(), dense_c.data(), 4 * static_cast<size_t>(n)))
                << "decode differs at step " << step;
            const auto rg = download<float>(gpu.residual(), n);
            ASSERT_EQ(0, std::memcmp(rg.data(), cpu.residual(), 4 * static_cast<size_t>(n)))
                << "residual differs at step " << step;
          }
        }
}

TEST(RandomKCuda, TwentyStepsMatchCpu) {
  GC_REQUIRE_GPU();
  for (DType gt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
      RandomKConfig cfg;
      cfg.ratio = 0.01;
      cfg.value_dtype = gt;
      cfg.seed = 5;
      cfg.tensor_id = 2;
      RandomKCompressor cpu(cfg, n, gt);
      RandomKCompressor gpu(cfg, n, gt, Device::kCUDA, 0, nullptr);
      Payload pc(Device::kCPU), pg(Device::kCUDA);
      for (int step = 0; step < 20; ++step) {
        std::vector<uint8_t> gb = to_bytes(heavy_tailed(n, 50 + step), gt);
        const Dev dg = upload(gb);
        cpu.encode(cpu_view(gb.data(), n, gt), pc);
        gpu.encode(cuda_view(dg.as(), n, gt), pg);
        ASSERT_EQ(host_bytes(pg), host_bytes(pc)) << "n=" << n << " step " << step;
        expect_close(download<float>(gpu.residual(), n),
                     std::vector<float>(cpu.residual(), cpu.residual() + n), "residual");
        std::vector<float> dense_c(static_cast<size_t>(n), 1.0f);
        cpu.decode_add(pc.data(), pc.size(), cpu_view(dense_c.data(), n), 0.25f);
        const Dev dd = upload(std::vector<float>(static_cast<size_t>(n), 1.0f));
        gpu.decode_add(pg.data(), pg.size(), cuda_view(dd.as(), n), 0.25f);
        expect_close(download<float>(dd.as(), n), dense_c, "decoded");
        const int64_t k = topk_count(cfg.ratio, n);
        std::vector<uint32_t> ic(static_cast<size_t>(k));
        Dev ig(4 * static_cast<size_t>(k));
        cpu.indices_at(step, ic.data());
        gpu.indices_at(step, ig.as<uint32_t>());
        ASSERT_EQ(download<uint32_t>(ig.as(), k), ic);
        if (testing::Test::HasFailure()) FAIL() << "n=" << n << " step " << step;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
TEST(TopKCudaWire, CpuPayloadsDecodeOnGpuAndViceVersa) {
  GC_REQUIRE_GPU();
  const int64_t n = 100003;
  TopKConfig cfg;
  cfg.select.method = SelectMethod::kExact;
  const std::vector<float> x = normal(n, 3);
  // compressor-made payloads at densities that pick bitmap (20%) and delta/raw (1%)
  for (double ratio : {0.2, 0.01}) {
    cfg.ratio = ratio;
    TopKCompressor cpu(cfg, n), gpu(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
    std::vector<float> xc = x;
    const Dev dx = upload(x);
    Payload pc(Device::kCPU), pg(Device::kCUDA);
    cpu.encode(cpu_view(xc.data(), n), pc);
    gpu.encode(cuda_view(dx.as(), n), pg);
    for (const Payload* p : {&pc, &pg}) {
      const std::vector<uint8_t> bytes = host_bytes(*p);
      std::vector<float> want(static_cast<size_t>(n), 0.0f);
      cpu.decode_add(bytes.data(), bytes.size(), cpu_view(want.data(), n));
      const Dev db = upload(bytes);
      const Dev dd = upload(std::vector<float>(static_cast<size_t>(n), 0.0f));
      gpu.decode_add(db.as(), bytes.size(), cuda_view(dd.as(), n));
      expect_close(download<float>(dd.as(), n), want, "decode across devices");
      // and the decoded values are the sent ones: x at the indices
      for (uint32_t i : payload_indices(bytes)) ASSERT_EQ(want[i], x[i]);
    }
  }
  // every coding by hand, including raw (which a CPU encoder rarely picks)
  std::vector<uint32_t> idx;
  std::vector<float> vals;
  for (int64_t i = 0; i < n; i += 37) {
    idx.push_back(static_cast<uint32_t>(i));
    vals.push_back(static_cast<float>(i % 13) - 6.0f);
  }
  idx.push_back(static_cast<uint32_t>(n - 1));
  vals.push_back(2.5f);
  TopKCompressor gpu(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
  for (IndexCoding c : {IndexCoding::kRaw32, IndexCoding::kBitmap, IndexCoding::kDeltaVarint}) {
    const std::vector<uint8_t> bytes = make_sparse(n, idx, vals, c);
    std::vector<float> want(static_cast<size_t>(n), 1.0f);
    for (size_t j = 0; j < idx.size(); ++j) want[idx[j]] += 2.0f * vals[j];
    const Dev db = upload(bytes);
    const Dev dd = upload(std::vector<float>(static_cast<size_t>(n), 1.0f));
    gpu.decode_add(db.as(), bytes.size(), cuda_view(dd.as(), n), 2.0f);
    expect_close(download<float>(dd.as(), n), want, "hand-made payload");
  }
}

TEST(TopKCudaWire, CorruptPayloadsAreRejectedAndOutputUntouched) {
  GC_REQUIRE_GPU();
  const int64_t n = 100003;  // n % 8 == 3: the last bitmap byte has 5 bits past the end
  TopKConfig cfg;
  TopKCompressor gpu(cfg, n, DType::kFloat32, Device::kCUDA, 0, nullptr);
  std::vector<uint32_t> idx = {0, 5, 17, 4000, 99999, static_cast<uint32_t>(n - 1)};
  std::vector<float> vals = {1, 2, 3, 4, 5, 6};
  const std::vector<float> init = normal(n, 77);
  auto expect_rejected = [&](const std::vector<uint8_t>& bytes, size_t nbytes, const char* what) {
    const Dev db = upload(bytes);
    const Dev dd = upload(init);
    EXPECT_THROW(gpu.decode_add(db.as(), nbytes, cuda_view(dd.as(), n)), CorruptPayload) << what;
    EXPECT_EQ(download<float>(dd.as(), n), init) << what << ": output changed";
  };
  {  // raw: out of range, not ascending, duplicate
    auto bad = idx;
    bad[3] = static_cast<uint32_t>(n);
    auto b = make_sparse(n, bad, vals, IndexCoding::kRaw32);
    expect_rejected(b, b.size(), "raw index == n");
    bad = idx;
    std::swap(bad[1], bad[2]);
    b = make_sparse(n, bad, vals, IndexCoding::kRaw32);
    expect_rejected(b, b.size(), "raw not ascending");
    bad = idx;
    bad[2] = bad[1];
    b = make_sparse(n, bad, vals, IndexCoding::kRaw32);
    expect_rejected(b, b.size(), "raw duplicate");
  }
  {  // bitmap: a bit past n, one bit too many, one too few
    const auto good = make_sparse(n, idx, vals, IndexCoding::kBitmap);
    const PayloadHeader h = parse_header(good.data(), good.size());
    const size_t last = h.section_offset(0) + (n + 7) / 8 - 1;
    auto b = good;
    b[h.section_offset(0) + 0] &= 0xfe;  // drop index 0 ...
    b[last] |= 0x80;                     // ... and set bit 8 * (nb - 1) + 7 >= n instead
    expect_rejected(b, b.size(), "bitmap bit past n (count unchanged)");
    b = good;
    b[h.section_offset(0) + 1] |= 0x01;  // index 8 extra
    expect_rejected(b, b.size(), "bitmap extra bit");
    b = good;
    b[h.section_offset(0) + 2] &= static_cast<uint8_t>(~(1u << 1));  // index 17 gone
    expect_rejected(b, b.size(), "bitmap missing bit");
  }
  {  // delta-varint past the end
    auto bad = idx;
    bad.back() = static_cast<uint32_t>(n + 5);
    const auto b = make_sparse(n, bad, vals, IndexCoding::kDeltaVarint);
    expect_rejected(b, b.size(), "delta past n");
  }
  {  // header: magic, truncation, kind
    const auto good = make_sparse(n, idx, vals, IndexCoding::kRaw32);
    auto b = good;
    b[0] ^= 0xff;
    expect_rejected(b, b.size(), "bad magic");
    expect_rejected(good, good.size() - 1, "truncated");
    b = good;
    b[8] = static_cast<uint8_t>(PayloadKind::kRandomK);
    expect_rejected(b, b.size(), "wrong kind");
  }
}

// ------------------------------------------------------------------------------------------------
// The element-wise kernels against their CPU twins.

TEST(TopKCudaKernels, FirstNonfiniteAndSumSquares) {
  GC_REQUIRE_GPU();
  kernels::SelectWorkspace ws(Device::kCUDA);
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1023}, int64_t{(1 << 20) + 3}}) {
      std::vector<float> x = normal(n, 21 + n);
      auto b = to_bytes(x, t);
      Dev d = upload(b);
      EXPECT_EQ(kernels::cuda::first_nonfinite(d.as(), t, n, ws, nullptr), -1);
      const double want = kernels::cpu::sum_squares(b.data(), t, n);
      const double got = kernels::cuda::sum_squares(d.as(), t, n, ws, nullptr);
      EXPECT_NEAR(got, want, 1e-12 * want) << "n=" << n;
      // plant NaN and Inf; the first one counts
      for (int64_t pos : {n - 1, n / 2, int64_t{0}}) {
        std::vector<float> y = x;
        y[static_cast<size_t>(pos)] = std::numeric_limits<float>::quiet_NaN();
        if (pos + 3 < n) y[static_cast<size_t>(pos + 3)] = std::numeric_limits<float>::infinity();
        auto yb = to_bytes(y, t);
        Dev dy = upload(yb);
        EXPECT_EQ(kernels::cpu::first_nonfinite(yb.data(), t, n), pos);
        EXPECT_EQ(kernels::cuda::first_nonfinite(dy.as(), t, n, ws, nullptr), pos) << "n=" << n;
      }
    }
  }
  EXPECT_EQ(kernels::cuda::first_nonfinite(nullptr, DType::kFloat32, 0, ws, nullptr), -1);
  EXPECT_EQ(kernels::cuda::sum_squares(nullptr, DType::kFloat32, 0, ws, nullptr), 0.0);
}

TEST(TopKCudaKernels, DgcAccumulateAlignedAndUnaligned) {
  GC_REQUIRE_GPU();
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1023}, int64_t{100003}}) {
      for (int shift : {0, 1}) {  // shift 1: the gradient starts one element past an alignment
        for (int mode = 0; mode < 3; ++mode) {  // residual only, momentum, Nesterov
          std::vector<float> g = normal(n + shift, 31 + n);
          auto gb = to_bytes(g, t);
          std::vector<float> u = normal(n, 32), v = normal(n, 33);
          const Dev dg = upload(gb), du = upload(u), dv = upload(v);
          const size_t off = static_cast<size_t>(shift) * dtype_size(t);
          const float m = mode == 0 ? 0.0f : 0.9f;
          float* uh = mode == 0 ? nullptr : u.data();
          float* ud = mode == 0 ? nullptr : du.as<float>();
          kernels::cpu::dgc_accumulate(gb.data() + off, t, n, 0.7f, m, mode == 2, uh, v.data(),
                                       nullptr, nullptr);
          kernels::cuda::dgc_accumulate(dg.as<uint8_t>() + off, t, n, 0.7f, m, mode == 2, ud,
                                        dv.as<float>(), nullptr, nullptr, nullptr);
          expect_close(download<float>(dv.as(), n), v, "v");
          if (mode != 0) expect_close(download<float>(du.as(), n), u, "u");
          ASSERT_FALSE(testing::Test::HasFailure())
              << "dtype " << dtype_name(t) << " n=" << n << " shift " << shift << " mode " << mode;
        }
      }
    }
  }
}

TEST(TopKCudaKernels, RandomKRangeMapEqualsCpuTwin) {
  GC_REQUIRE_GPU();
  // the sampled ranges of a layout with segments sent whole: starts in the concatenation, then
  // in the tensor (random-k's dense_below)
  const std::vector<uint32_t> one = {0, 5}, three = {0, 20000, 37001, 5, 20008, 57109};
  for (const auto* ranges : {&one, &three}) {
    const int64_t nr = static_cast<int64_t>(ranges->size() / 2);
    const int64_t n = nr == 1 ? 1000 : 40000;
    for (int64_t k : {int64_t{1}, n / 100, n}) {
      const RngKey key{5, static_cast<uint64_t>(k), 2};
      std::vector<uint32_t> idx(static_cast<size_t>(k));
      kernels::cpu::randomk_indices(n, k, key, idx.data(), ranges->data(), nr);
      const Dev dr = upload(*ranges);
      Dev didx(4 * static_cast<size_t>(k));
      kernels::cuda::randomk_indices(n, k, key, didx.as<uint32_t>(), dr.as<uint32_t>(), nr,
                                     nullptr);
      ASSERT_EQ(download<uint32_t>(didx.as(), k), idx) << "ranges " << nr << " k=" << k;
    }
  }
}

TEST(TopKCudaKernels, GatherClearScatterAddRandomK) {
  GC_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    for (int64_t k : {int64_t{1}, n / 3 + 1, n}) {
      std::vector<uint32_t> idx(static_cast<size_t>(k));
      const RngKey key{11, static_cast<uint64_t>(n), 1};
      kernels::cpu::randomk_indices(n, k, key, idx.data(), nullptr, 0);
      Dev didx(4 * static_cast<size_t>(k));
      kernels::cuda::randomk_indices(n, k, key, didx.as<uint32_t>(), nullptr, 0, nullptr);
      ASSERT_EQ(download<uint32_t>(didx.as(), k), idx) << "random-k n=" << n << " k=" << k;
      for (DType vt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
        std::vector<float> v = normal(n, 41), u = normal(n, 42);
        const Dev dv = upload(v), du = upload(u);
        const size_t vbytes = static_cast<size_t>(k) * dtype_size(vt);
        std::vector<uint8_t> vals(vbytes);
        Dev dvals(vbytes);
        kernels::cpu::gather_and_clear(v.data(), u.data(), idx.data(), k, vals.data(), vt, nullptr);
        kernels::cuda::gather_and_clear(dv.as<float>(), du.as<float>(), didx.as<uint32_t>(), k,
                                        dvals.as(), vt, nullptr, nullptr);
        ASSERT_EQ(download<uint8_t>(dvals.as(), vbytes), vals);
        ASSERT_EQ(download<float>(dv.as(), n), v);
        ASSERT_EQ(download<float>(du.as(), n), u);
        std::vector<float> dense = normal(n, 43);
        const Dev dd = upload(dense);
        kernels::cpu::scatter_add(idx.data(), vals.data(), vt, k, -0.5f, dense.data());
        kernels::cuda::scatter_add(didx.as<uint32_t>(), dvals.as(), vt, k, -0.5f, dd.as<float>(),
                                   nullptr);
        expect_close(download<float>(dd.as(), n), dense, "scatter_add");
      }
    }
  }
}

// The random-k plan's fp16 shares (v / P saturated to share_limit, the residual keeping
// v - P * share): the CUDA twin writes the same values and residuals, bit for bit, from values
// beyond what P shares may carry down to ones that round to 0.
TEST(TopKCudaKernels, GatherClearWithSharesMatchesTheCpu) {
  GC_REQUIRE_GPU();
  const int64_t n = 4099;
  for (int P : {2, 3, 7}) {
    const kernels::ValueShare share{static_cast<float>(P),
                                    kernels::share_limit(DType::kFloat16, P)};
    std::vector<float> v = normal(n, 51), u = normal(n, 52);
    for (int64_t i = 0; i < n; ++i) v[i] *= std::ldexp(1.0f, static_cast<int>(i % 48) - 28);
    std::vector<uint32_t> idx;
    for (int64_t i = 0; i < n; i += 2) idx.push_back(static_cast<uint32_t>(i));
    const auto k = static_cast<int64_t>(idx.size());
    const Dev dv = upload(v), du = upload(u), didx = upload(idx);
    std::vector<uint8_t> vals(2 * static_cast<size_t>(k));
    Dev dvals(vals.size());
    kernels::cpu::gather_and_clear(v.data(), u.data(), idx.data(), k, vals.data(), DType::kFloat16,
                                   &share);
    kernels::cuda::gather_and_clear(dv.as<float>(), du.as<float>(), didx.as<uint32_t>(), k,
                                    dvals.as(), DType::kFloat16, &share, nullptr);
    ASSERT_EQ(download<uint8_t>(dvals.as(), vals.size()), vals) << "P=" << P;
    ASSERT_EQ(download<float>(dv.as(), n), v) << "P=" << P;
    ASSERT_EQ(download<float>(du.as(), n), u) << "P=" << P;
  }
}

TEST(TopKCudaKernels, BitmapCodecsAndIndexCheck) {
  GC_REQUIRE_GPU();
  kernels::SelectWorkspace ws(Device::kCUDA);
  for (int64_t n :
       {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{100003}, int64_t{(1 << 20) + 3}}) {
    for (int density : {1, 3, 100}) {  // percent
      std::vector<uint32_t> idx;
      for (int64_t i = 0; i < n; ++i)
        if (static_cast<uint64_t>(i) * 2654435761u % 100 < static_cast<uint64_t>(density) ||
            i == n - 1)
          idx.push_back(static_cast<uint32_t>(i));
      const int64_t k = static_cast<int64_t>(idx.size());
      const size_t nb = static_cast<size_t>((n + 7) / 8);
      std::vector<uint8_t> want(nb);
      encode_indices(idx.data(), idx.size(), n, IndexCoding::kBitmap, want.data());
      const Dev didx = upload(idx);
      Dev bm(nb);
      kernels::cuda::indices_to_bitmap(didx.as<uint32_t>(), k, n, bm.as<uint8_t>(), nullptr);
      ASSERT_EQ(download<uint8_t>(bm.as(), nb), want) << "n=" << n << " density " << density;
      Dev back(4 * static_cast<size_t>(k) + 4);
      ASSERT_EQ(kernels::cuda::bitmap_to_indices(bm.as<uint8_t>(), n, back.as<uint32_t>(), k, ws,
                                                 nullptr),
                k);
      ASSERT_EQ(download<uint32_t>(back.as(), k), idx);
      // a smaller capacity: the count is still reported, only `cap` indices written
      if (k > 2) {
        Dev small(4 * 2 + 4);
        const std::vector<uint32_t> sentinel = {0xdeadbeefu, 0xdeadbeefu, 0xdeadbeefu};
        device_copy(small.as(), Device::kCUDA, sentinel.data(), Device::kCPU, 12, nullptr);
        EXPECT_EQ(kernels::cuda::bitmap_to_indices(bm.as<uint8_t>(), n, small.as<uint32_t>(), 2, ws,
                                                   nullptr),
                  k);
        const auto got = download<uint32_t>(small.as(), 3);
        EXPECT_EQ(got[0], idx[0]);
        EXPECT_EQ(got[1], idx[1]);
        EXPECT_EQ(got[2], 0xdeadbeefu);
      }
      EXPECT_EQ(kernels::cuda::check_indices(didx.as<uint32_t>(), k, n, ws, nullptr), -1);
    }
  }
  // a bit past n in the last byte
  {
    const int64_t n = 13;
    std::vector<uint8_t> b = {0x01, 0x20};  // indices 0 and 13 (13 >= n)
    const Dev db = upload(b);
    Dev out(16);
    EXPECT_EQ(
        kernels::cuda::bitmap_to_indices(db.as<uint8_t>(), n, out.as<uint32_t>(), 2, ws, nullptr),
        -1);
  }
  // index checks: first bad position
  const int64_t n = 1000;
  auto check = [&](std::vector<uint32_t> v) {
    const Dev d = upload(v);
    return kernels::cuda::check_indices(d.as<uint32_t>(), static_cast<int64_t>(v.size()), n, ws,
                                        nullptr);
  };
  EXPECT_EQ(check({0, 1, 2, 999}), -1);
  EXPECT_EQ(check({0, 1, 2, 1000}), 3);
  EXPECT_EQ(check({5, 4, 6, 1000}), 1);
  EXPECT_EQ(check({5, 5}), 1);
  EXPECT_EQ(check({1000, 5}), 0);
  std::vector<uint32_t> many(100000);
  std::iota(many.begin(), many.end(), 0u);
  many[77777] = 77775;
  many[88888] = 5;
  EXPECT_EQ(kernels::cuda::check_indices(upload(many).as<uint32_t>(), 100000, 200000, ws, nullptr),
            77777);
}
