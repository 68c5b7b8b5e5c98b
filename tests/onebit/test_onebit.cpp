// SPDX-License-Identifier: Apache-2.0
// The 1-bit family on the CPU: bits, scales, error feedback and decode against scalar references;
// payload format and exact compression ratio; bad input; state round trips.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "gradcomp/gradcomp.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "onebit/onebit_ref.hpp"
#include "test_util.hpp"

using namespace gradcomp;
using namespace gradcomp::test;

namespace {

struct Shape {
  int64_t R, C;
};

OneBitConfig make_cfg(OneBitScaling s, int64_t chunk = 0, bool ef = true) {
  OneBitConfig c;
  c.scaling = s;
  c.block_size = chunk;
  c.error_feedback = ef;
  c.tensor_id = 7;
  return c;
}

std::string label(const OneBitConfig& c, Shape s) {
  return std::string(enum_name(c.scaling)) + " chunk " + std::to_string(c.block_size) + " shape " +
         std::to_string(s.R) + "x" + std::to_string(s.C);
}

/// Runs `steps` encodes on random data and checks every step against the scalar reference:
/// bits exactly, scales to fp32 rounding, new error exactly (given the scales), decode exactly.
void check_against_reference(const OneBitConfig& cfg, Shape sh, int steps, DType dt) {
  const int64_t n = sh.R * sh.C;
  SCOPED_TRACE(label(cfg, sh) + " dtype " + dtype_name(dt));
  OneBitCompressor comp(cfg, sh.R, sh.C, dt);
  std::vector<float> e_ref(static_cast<size_t>(n), 0.0f);
  Payload p;
  for (int step = 0; step < steps; ++step) {
    std::vector<float> g = normal(n, 100 + step, 1.0f);
    for (int64_t i = 0; i < n; i += 5) g[i] += 0.7f;  // make column means asymmetric
    std::vector<uint16_t> g16(static_cast<size_t>(n));
    TensorView gv = TensorView(g.data(), {sh.R, sh.C}, DType::kFloat32, Device::kCPU);
    if (dt != DType::kFloat32) {
      for (int64_t i = 0; i < n; ++i) {
        g16[i] = dt == DType::kFloat16 ? float_to_half(g[i]) : float_to_bf16(g[i]);
        g[i] = dt == DType::kFloat16 ? half_to_float(g16[i]) : bf16_to_float(g16[i]);
      }
      gv = TensorView(g16.data(), {sh.R, sh.C}, dt, Device::kCPU);
    }
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[i] = cfg.error_feedback ? g[i] + e_ref[i] : g[i];
    comp.encode(gv, p);
    const View v = view_of(p.data());
    // header and exact sizes
    ASSERT_EQ(v.h.kind, uint8_t(PayloadKind::kOneBit));
    ASSERT_EQ(v.h.numel, uint64_t(n));
    ASSERT_EQ(v.h.tensor_id, 7u);
    ASSERT_EQ(v.h.flags, uint8_t(cfg.scaling));
    const auto want_bits = ref_bits(x);
    const auto want_scales = ref_scales(x, sh.R, sh.C, cfg);
    ASSERT_EQ(v.h.section_bytes[1], 4 * want_bits.size());
    ASSERT_EQ(v.h.section_bytes[2], 4 * want_scales.size());
    const uint64_t total =
        64 + (4 * want_bits.size() + 7) / 8 * 8 + (4 * want_scales.size() + 7) / 8 * 8;
    ASSERT_EQ(p.size(), total);
    ASSERT_EQ(comp.last_stats().payload_bytes, total);
    ASSERT_EQ(onebit_payload_bytes(cfg, sh.R, sh.C), total);
    EXPECT_DOUBLE_EQ(comp.last_stats().compression_ratio(),
                     double(n * dtype_size(dt)) / double(total));
    // bits exactly
    for (size_t w = 0; w < want_bits.size(); ++w)
      ASSERT_EQ(v.bits[w], want_bits[w]) << "word " << w << " step " << step;
    // scales to fp32 rounding (the implementation sums in fp32 lanes folded into double)
    for (size_t k = 0; k < want_scales.size(); ++k)
      ASSERT_NEAR(v.scales[k], want_scales[k], 2e-5 * (std::fabs(want_scales[k]) + 1e-6))
          << "scale " << k << " step " << step;
    // error feedback exactly, given the scales that were sent
    const float* e = comp.error();
    for (int64_t i = 0; i < n; ++i) {
      const float d = ref_decoded(v.bits, v.scales, i, n, sh.C, cfg);
      const float want = cfg.error_feedback ? x[i] - d : 0.0f;
      ASSERT_TRUE(same_bits(e[i], want)) << "error at " << i << ": " << e[i] << " vs " << want;
      e_ref[i] = e[i];
    }
    // decode: dense = base + 0.5 * decoded, bit for bit
    std::vector<float> dense = normal(n, 999, 1.0f), want = dense;
    for (int64_t i = 0; i < n; ++i)
      want[i] = dense[i] + 0.5f * ref_decoded(v.bits, v.scales, i, n, sh.C, cfg);
    comp.decode_add(p.data(), p.size(),
                    TensorView(dense.data(), {sh.R, sh.C}, DType::kFloat32, Device::kCPU), 0.5f);
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(dense[i], want[i])) << "decode at " << i;
  }
  EXPECT_EQ(comp.step(), steps);
}

const Shape kShapes[] = {{1, 1},  {1, 77}, {1000, 1}, {7, 13},     {1024, 1000},
                         {33, 3}, {0, 5},  {300, 37}, {1000003, 1}};

}  // namespace

TEST(OneBit, ColumnMeansMatchesReference) {
  for (Shape s : kShapes)
    check_against_reference(make_cfg(OneBitScaling::kColumnMeans), s, 3, DType::kFloat32);
}

TEST(OneBit, SignL1MatchesReference) {
  for (Shape s : kShapes)
    check_against_reference(make_cfg(OneBitScaling::kSignL1), s, 3, DType::kFloat32);
  for (int64_t chunk : {32, 64, 4096})
    for (Shape s : {Shape{1, 1}, Shape{7, 13}, Shape{100003, 1}})
      check_against_reference(make_cfg(OneBitScaling::kSignL1, chunk), s, 2, DType::kFloat32);
}

TEST(OneBit, SignL2MatchesReference) {
  for (Shape s : kShapes)
    check_against_reference(make_cfg(OneBitScaling::kSignL2), s, 3, DType::kFloat32);
  for (int64_t chunk : {32, 96, 1 << 17})
    for (Shape s : {Shape{1, 33}, Shape{1024, 1000}, Shape{300001, 1}})
      check_against_reference(make_cfg(OneBitScaling::kSignL2, chunk), s, 2, DType::kFloat32);
}

TEST(OneBit, HalfAndBFloat16Gradients) {
  for (DType dt : {DType::kFloat16, DType::kBFloat16})
    for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1, OneBitScaling::kSignL2})
      for (Shape s : {Shape{7, 13}, Shape{1000, 1}, Shape{64, 129}})
        check_against_reference(make_cfg(sc), s, 2, dt);
}

TEST(OneBit, WithoutErrorFeedbackErrorStaysZero) {
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL2})
    check_against_reference(make_cfg(sc, 0, false), {64, 100}, 3, DType::kFloat32);
}

TEST(OneBit, SignBitEdgeCases) {
  // -0 encodes as 1, tiny negatives as 0; the column means see them as such.
  std::vector<float> g = {-0.0f, 0.0f, -1e-30f, 1e-30f, 3.0f, -5.0f};
  OneBitCompressor comp(make_cfg(OneBitScaling::kColumnMeans), 6, 1);
  Payload p;
  comp.encode(TensorView::cpu(g.data(), 6), p);
  const View v = view_of(p.data());
  EXPECT_EQ(v.bits[0], 0b011011u);
  EXPECT_FLOAT_EQ(v.scales[0], (0.0f + 0.0f + 1e-30f + 3.0f) / 4);
  EXPECT_FLOAT_EQ(v.scales[1], (-1e-30f - 5.0f) / 2);
}

TEST(OneBit, ColumnMeansOfAllPositiveColumnUseZeroForEmptySet) {
  std::vector<float> g = {1, -1, 2, -3, 3, -5};  // 3 x 2: column 0 positive, column 1 negative
  OneBitCompressor comp(make_cfg(OneBitScaling::kColumnMeans), 3, 2);
  Payload p;
  comp.encode(TensorView::cpu(g.data(), {3, 2}), p);
  const View v = view_of(p.data());
  EXPECT_EQ(v.bits[0], 0b010101u);
  EXPECT_EQ(v.scales[0], 2.0f);   // hi, column 0
  EXPECT_EQ(v.scales[1], 0.0f);   // hi, column 1 (empty)
  EXPECT_EQ(v.scales[2], 0.0f);   // lo, column 0 (empty)
  EXPECT_EQ(v.scales[3], -3.0f);  // lo, column 1
  for (int i = 0; i < 6; ++i) EXPECT_EQ(comp.error()[i], g[i] - (i % 2 ? -3.0f : 2.0f));
}

TEST(OneBit, ErrorFeedbackInvariantOver100Steps) {
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1, OneBitScaling::kSignL2})
    for (Shape s : {Shape{33, 31}, Shape{5000, 1}, Shape{1, 100}}) {
      const int64_t n = s.R * s.C;
      SCOPED_TRACE(label(make_cfg(sc), s));
      OneBitCompressor comp(make_cfg(sc, sc == OneBitScaling::kColumnMeans ? 0 : 64), s.R, s.C);
      std::vector<double> sum_in(n, 0.0), sum_out(n, 0.0);
      std::vector<float> dec(n);
      Payload p;
      double scale_of_data = 0;
      for (int t = 0; t < 100; ++t) {
        std::vector<float> g = heavy_tailed(n, 1000 + t);
        for (int64_t i = 0; i < n; ++i) {
          sum_in[i] += g[i];
          scale_of_data = std::max(scale_of_data, std::fabs(double(g[i])));
        }
        comp.encode(TensorView(g.data(), {s.R, s.C}, DType::kFloat32, Device::kCPU), p);
        std::fill(dec.begin(), dec.end(), 0.0f);
        comp.decode_add(p.data(), p.size(),
                        TensorView(dec.data(), {s.R, s.C}, DType::kFloat32, Device::kCPU));
        for (int64_t i = 0; i < n; ++i) sum_out[i] += dec[i];
      }
      const float* e = comp.error();
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(sum_in[i], sum_out[i] + e[i], 1e-4 * (scale_of_data + 1.0)) << "element " << i;
    }
}

TEST(OneBit, DecodeAverageMatchesReference) {
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL2})
    for (Shape s : {Shape{1, 1}, Shape{7, 13}, Shape{1000, 1}, Shape{256, 300}}) {
      const int64_t n = s.R * s.C;
      const int P = 5;
      std::vector<Payload> ps(P);
      std::vector<const void*> ptr(P);
      std::vector<size_t> sz(P);
      for (int q = 0; q < P; ++q) {
        OneBitCompressor c(make_cfg(sc), s.R, s.C);
        std::vector<float> g = normal(n, 50 + q);
        c.encode(TensorView(g.data(), {s.R, s.C}, DType::kFloat32, Device::kCPU), ps[q]);
        ptr[q] = ps[q].data();
        sz[q] = ps[q].size();
      }
      OneBitCompressor dec(make_cfg(sc), s.R, s.C);
      std::vector<float> out = normal(n, 9), want = out;
      const float scale = 1.0f / P;
      for (int64_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (int q = 0; q < P; ++q) {
          const View v = view_of(ps[q].data());
          acc += ref_decoded(v.bits, v.scales, i, n, s.C, make_cfg(sc));
        }
        want[i] = out[i] + scale * acc;
      }
      dec.decode_average(ptr.data(), sz.data(), P,
                         TensorView(out.data(), {s.R, s.C}, DType::kFloat32, Device::kCPU), scale);
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(out[i], want[i])) << i;
    }
}

TEST(OneBit, DecodeIsSelfDescribing) {
  // a sign-mode payload decodes through a column-means compressor of the same size and back
  const int64_t n = 777;
  std::vector<float> g = normal(n, 3);
  OneBitCompressor a(make_cfg(OneBitScaling::kSignL1, 64), n, 1);
  OneBitCompressor b(make_cfg(OneBitScaling::kColumnMeans), 7, 111);
  Payload p;
  a.encode(TensorView::cpu(g.data(), n), p);
  std::vector<float> x(n, 0.0f), y(n, 0.0f);
  a.decode_add(p.data(), p.size(), TensorView::cpu(x.data(), n));
  b.decode_add(p.data(), p.size(), TensorView::cpu(y.data(), {7, 111}));
  EXPECT_EQ(0, std::memcmp(x.data(), y.data(), 4 * n));
}

TEST(OneBit, EmptyTensor) {
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1}) {
    OneBitCompressor c(make_cfg(sc), 0, 0);
    Payload p;
    c.encode(TensorView::cpu(static_cast<float*>(nullptr), int64_t{0}), p);
    EXPECT_EQ(p.size(), 64u);
    EXPECT_EQ(c.last_stats().payload_bytes, 64u);
    c.decode_add(p.data(), p.size(), TensorView::cpu(static_cast<float*>(nullptr), int64_t{0}));
    EXPECT_EQ(c.step(), 1);
  }
}

TEST(OneBit, CompressionRatioIsNear32ForLargeTensors) {
  OneBitConfig cfg = make_cfg(OneBitScaling::kSignL2);
  const uint64_t b = onebit_payload_bytes(cfg, 1 << 20, 1);
  EXPECT_EQ(b, 64u + (1u << 20) / 8 + 8);
  const double ratio = double(4 << 20) / double(b);
  EXPECT_GT(ratio, 31.9);
  EXPECT_LT(ratio, 32.0);
  // 1-bit SGD on 1024 x 1000: 2 * 1000 column values ride along
  EXPECT_EQ(onebit_payload_bytes(make_cfg(OneBitScaling::kColumnMeans), 1024, 1000),
            64u + 1024u * 1000u / 8 + 8000u);
}

// ---- bad input ---------------------------------------------------------------------------------

namespace {
std::vector<uint8_t> state_after_two_steps(OneBitCompressor& c, int64_t R, int64_t C) {
  Payload p;
  for (int t = 0; t < 2; ++t) {
    std::vector<float> g = normal(R * C, 77 + t);
    c.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), p);
  }
  return c.state_dict();
}

template <class E, class F>
void expect_throw_with(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning '" << needle << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(OneBitBadInput, ConfigIsValidated) {
  EXPECT_THROW(make_cfg(OneBitScaling::kSignL1, 33).validate(), InvalidArgument);
  EXPECT_THROW(make_cfg(OneBitScaling::kSignL1, -32).validate(), InvalidArgument);
  EXPECT_THROW(make_cfg(OneBitScaling::kColumnMeans, 64).validate(), InvalidArgument);
  OneBitConfig bad = make_cfg(OneBitScaling::kSignL1);
  bad.scaling = static_cast<OneBitScaling>(9);
  EXPECT_THROW(OneBitCompressor(bad, 4, 4), InvalidArgument);
  EXPECT_THROW(OneBitCompressor(make_cfg(OneBitScaling::kSignL1), -1, 4), InvalidArgument);
  EXPECT_THROW(OneBitCompressor(make_cfg(OneBitScaling::kSignL1), 4, 4, static_cast<DType>(7)),
               InvalidArgument);
}

TEST(OneBitBadInput, GradientRejectedAndStateUnchanged) {
  const int64_t R = 37, C = 29, n = R * C;
  OneBitCompressor c(make_cfg(OneBitScaling::kColumnMeans), R, C);
  const auto before = state_after_two_steps(c, R, C);
  Payload p;
  std::vector<float> g = normal(n, 5);
  // wrong element count
  std::vector<float> big(n + 1);
  expect_throw_with<InvalidArgument>([&] { c.encode(TensorView::cpu(big.data(), n + 1), p); },
                                     "elements");
  // wrong shape for column means
  expect_throw_with<InvalidArgument>(
      [&] {
        c.encode(TensorView(g.data(), {C, R}, DType::kFloat32, Device::kCPU), p);
      },
      "29 x 37");
  // dtype
  TensorView bad = TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU);
  bad.dtype = static_cast<DType>(7);
  expect_throw_with<InvalidArgument>([&] { c.encode(bad, p); }, "dtype");
  // device
  TensorView dev = TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU);
  dev.device = Device::kCUDA;
  expect_throw_with<InvalidArgument>([&] { c.encode(dev, p); }, "cuda");
  // null data
  expect_throw_with<InvalidArgument>(
      [&] {
        c.encode(TensorView(nullptr, {R, C}, DType::kFloat32, Device::kCPU), p);
      },
      "null");
  // NaN and Inf, named by index
  for (float badv :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    std::vector<float> h = g;
    h[500] = badv;
    expect_throw_with<InvalidArgument>(
        [&] {
          c.encode(TensorView(h.data(), {R, C}, DType::kFloat32, Device::kCPU), p);
        },
        "index 500");
  }
  EXPECT_EQ(c.state_dict(), before);
  EXPECT_EQ(c.step(), 2);
}

TEST(OneBitBadInput, NonFiniteInSignModesAndHalf) {
  for (auto sc : {OneBitScaling::kSignL1, OneBitScaling::kSignL2}) {
    const int64_t n = 100000;
    OneBitCompressor c(make_cfg(sc, 1024), n, 1, DType::kFloat16);
    std::vector<uint16_t> g(n, float_to_half(0.5f));
    Payload p;
    c.encode(TensorView(g.data(), {n}, DType::kFloat16, Device::kCPU), p);
    const auto before = c.state_dict();
    g[77777] = 0x7c00;  // +Inf
    expect_throw_with<InvalidArgument>(
        [&] { c.encode(TensorView(g.data(), {n}, DType::kFloat16, Device::kCPU), p); },
        "index 77777");
    EXPECT_EQ(c.state_dict(), before);
  }
}

TEST(OneBitBadInput, CheckFiniteOffLetsNaNThrough) {
  OneBitConfig cfg = make_cfg(OneBitScaling::kSignL1);
  cfg.check_finite = false;
  OneBitCompressor c(cfg, 64, 1);
  std::vector<float> g(64, 1.0f);
  g[3] = std::numeric_limits<float>::quiet_NaN();
  Payload p;
  EXPECT_NO_THROW(c.encode(TensorView::cpu(g.data(), 64), p));
  EXPECT_EQ(c.step(), 1);
}

TEST(OneBitBadInput, CorruptPayloadRejectedAndOutputUnchanged) {
  const int64_t R = 40, C = 50, n = R * C;
  OneBitCompressor c(make_cfg(OneBitScaling::kColumnMeans), R, C);
  std::vector<float> g = normal(n, 1);
  Payload p;
  c.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), p);
  const std::vector<uint8_t> good(p.data(), p.data() + p.size());
  std::vector<float> dense = normal(n, 2);
  const std::vector<float> orig = dense;
  const TensorView dv(dense.data(), {R, C}, DType::kFloat32, Device::kCPU);
  auto mutate = [&](auto&& f) {
    std::vector<uint8_t> b = good;
    PayloadHeader h;
    std::memcpy(&h, b.data(), 64);
    f(h, b);
    std::memcpy(b.data(), &h, 64);
    return b;
  };
  struct Case {
    const char* what;
    std::vector<uint8_t> bytes;
    size_t nbytes;
  };
  std::vector<Case> cases;
  auto add = [&](const char* what, std::vector<uint8_t> b) {
    const size_t nb = b.size();
    cases.push_back({what, std::move(b), nb});
  };
  add("magic", mutate([](PayloadHeader& h, auto&) { h.magic ^= 1; }));
  add("kind", mutate([](PayloadHeader& h, auto&) { h.kind = uint8_t(PayloadKind::kSparse); }));
  add("numel", mutate([](PayloadHeader& h, auto&) {
        h.numel -= 50;
        h.count -= 50;
      }));
  add("count", mutate([](PayloadHeader& h, auto&) { h.count -= 1; }));
  add("dtype", mutate([](PayloadHeader& h, auto&) { h.value_dtype = 1; }));
  add("scaling", mutate([](PayloadHeader& h, auto&) { h.flags = 5; }));
  add("columns", mutate([](PayloadHeader& h, auto&) { h.aux = 3; }));
  add("indices", mutate([](PayloadHeader& h, auto&) { h.index_coding = 1; }));
  // bits section shortened while the total still adds up (scales section grows to match)
  add("bits", mutate([](PayloadHeader& h, auto&) {
        h.section_bytes[1] -= 8;
        h.section_bytes[2] += 8;
      }));
  {  // truncated: last 8 bytes cut off
    std::vector<uint8_t> b = good;
    b.resize(b.size() - 8);
    add("truncated", std::move(b));
  }
  {  // header only
    std::vector<uint8_t> b(good.begin(), good.begin() + 40);
    add("short", std::move(b));
  }
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    EXPECT_THROW(c.decode_add(k.bytes.data(), k.nbytes, dv), CorruptPayload);
    EXPECT_EQ(0, std::memcmp(dense.data(), orig.data(), 4 * n));
  }
  // wrong output size / dtype
  std::vector<float> small(n - 1);
  EXPECT_THROW(c.decode_add(good.data(), good.size(), TensorView::cpu(small.data(), n - 1)),
               InvalidArgument);
  // decode_average validates every payload before writing
  std::vector<uint8_t> bad = cases[0].bytes;
  const void* ptrs[2] = {good.data(), bad.data()};
  const size_t sizes[2] = {good.size(), bad.size()};
  EXPECT_THROW(c.decode_average(ptrs, sizes, 2, dv, 0.5f), CorruptPayload);
  EXPECT_EQ(0, std::memcmp(dense.data(), orig.data(), 4 * n));
  EXPECT_THROW(c.decode_average(ptrs, sizes, 0, dv, 0.5f), InvalidArgument);
  // payloads with different groupings cannot be averaged in one pass
  OneBitCompressor s(make_cfg(OneBitScaling::kSignL1), R, C);
  Payload ps;
  s.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), ps);
  const void* mix[2] = {good.data(), ps.data()};
  const size_t msz[2] = {good.size(), ps.size()};
  EXPECT_THROW(c.decode_average(mix, msz, 2, dv, 0.5f), CorruptPayload);
  EXPECT_EQ(0, std::memcmp(dense.data(), orig.data(), 4 * n));
}

TEST(OneBitState, RoundTripContinuesIdentically) {
  const int64_t R = 64, C = 65;
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL2}) {
    OneBitCompressor a(make_cfg(sc), R, C);
    const auto st = state_after_two_steps(a, R, C);
    OneBitCompressor b(make_cfg(sc), R, C);
    b.load_state_dict(st.data(), st.size());
    EXPECT_EQ(b.step(), 2);
    std::vector<float> g = normal(R * C, 11);
    Payload pa, pb;
    a.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), pa);
    b.encode(TensorView(g.data(), {R, C}, DType::kFloat32, Device::kCPU), pb);
    ASSERT_EQ(pa.size(), pb.size());
    EXPECT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size()));
    EXPECT_EQ(0, std::memcmp(a.error(), b.error(), 4 * R * C));
  }
}

TEST(OneBitState, MismatchRejectedAndStateUnchanged) {
  OneBitCompressor a(make_cfg(OneBitScaling::kColumnMeans), 8, 9);
  const auto st = state_after_two_steps(a, 8, 9);
  OneBitCompressor b(make_cfg(OneBitScaling::kColumnMeans), 9, 8);
  const auto b0 = state_after_two_steps(b, 9, 8);
  EXPECT_THROW(b.load_state_dict(st.data(), st.size()), InvalidArgument);
  OneBitCompressor c(make_cfg(OneBitScaling::kSignL1), 8, 9);
  EXPECT_THROW(c.load_state_dict(st.data(), st.size()), InvalidArgument);
  EXPECT_THROW(b.load_state_dict(st.data(), st.size() - 4), InvalidArgument);
  std::vector<uint8_t> longer = b0;
  longer.push_back(0);
  EXPECT_THROW(b.load_state_dict(longer.data(), longer.size()), InvalidArgument);
  EXPECT_EQ(b.state_dict(), b0);
}

// ---- the one-pass compress and its lazy error-feedback state ----------------------------------

namespace {

std::vector<uint8_t> bytes_of(const Payload& p) { return {p.data(), p.data() + p.size()}; }

TensorView cpu_view(std::vector<float>& g, Shape s) {
  return TensorView(g.data(), {s.R, s.C}, DType::kFloat32, Device::kCPU);
}

const Shape kLazyShapes[] = {{1, 1},     {7, 13},    {300, 37},   {33, 31},   {100003, 1},
                             {64, 2048}, {40, 1056}, {256, 1000}, {3000, 32}, {77, 1}};

}  // namespace

TEST(OneBitLazy, LazyStateGivesTheSamePayloadsAndErrorAsMaterializedState) {
  // A keeps its error lazily (x and the previous scales) across steps; B is asked for its error
  // after every step, which materializes it, so B's next step starts from e itself. Both must
  // send the same bytes and end with the same error, with check_finite on (two buffers) and off
  // (in place).
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1, OneBitScaling::kSignL2})
    for (bool check : {true, false})
      for (Shape s : kLazyShapes) {
        OneBitConfig cfg = make_cfg(sc, sc == OneBitScaling::kSignL2 ? 96 : 0);
        cfg.check_finite = check;
        SCOPED_TRACE(label(cfg, s) + (check ? " check" : " in place"));
        OneBitCompressor a(cfg, s.R, s.C), b(cfg, s.R, s.C);
        Payload pa, pb;
        for (int t = 0; t < 4; ++t) {
          std::vector<float> g = heavy_tailed(s.R * s.C, 40 + t);
          a.encode(cpu_view(g, s), pa);
          b.encode(cpu_view(g, s), pb);
          ASSERT_EQ(bytes_of(pa), bytes_of(pb)) << "step " << t;
          (void)b.error();
        }
        ASSERT_EQ(0, std::memcmp(a.error(), b.error(), 4 * s.R * s.C));
      }
}

TEST(OneBitLazy, RejectionOfALazyStateLeavesItUnchanged) {
  // The NaN sits near the end, so the CPU pass has swept (and, with one buffer, would have
  // overwritten) almost the whole state before it is seen.
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1, OneBitScaling::kSignL2})
    for (Shape s : {Shape{2000, 300}, Shape{300001, 1}}) {
      const int64_t n = s.R * s.C;
      SCOPED_TRACE(label(make_cfg(sc), s));
      OneBitCompressor a(make_cfg(sc), s.R, s.C), b(make_cfg(sc), s.R, s.C);
      Payload pa, pb;
      for (int t = 0; t < 2; ++t) {
        std::vector<float> g = normal(n, 60 + t);
        a.encode(cpu_view(g, s), pa);
        b.encode(cpu_view(g, s), pb);
      }
      std::vector<float> bad = normal(n, 70);
      bad[n - 3] = std::numeric_limits<float>::infinity();
      expect_throw_with<InvalidArgument>([&] { a.encode(cpu_view(bad, s), pa); },
                                         "index " + std::to_string(n - 3));
      EXPECT_EQ(a.step(), 2);
      std::vector<float> g = normal(n, 80);
      a.encode(cpu_view(g, s), pa);
      b.encode(cpu_view(g, s), pb);
      ASSERT_EQ(bytes_of(pa), bytes_of(pb));
      ASSERT_EQ(a.state_dict(), b.state_dict());
    }
}

TEST(OneBitLazy, PayloadsDoNotDependOnTheThreadCount) {
  const int saved = omp_get_max_threads();
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL1})
    for (Shape s : {Shape{600, 1000}, Shape{512, 2048}, Shape{700001, 1}}) {
      SCOPED_TRACE(label(make_cfg(sc), s));
      std::vector<std::vector<uint8_t>> sent[2];
      for (int threads : {1, 3}) {
        omp_set_num_threads(threads);
        OneBitCompressor c(make_cfg(sc), s.R, s.C);
        Payload p;
        for (int t = 0; t < 2; ++t) {
          std::vector<float> g = normal(s.R * s.C, 90 + t);
          c.encode(cpu_view(g, s), p);
          sent[threads == 3].push_back(bytes_of(p));
        }
      }
      omp_set_num_threads(saved);
      ASSERT_EQ(sent[0], sent[1]);
    }
}

TEST(OneBitLazy, StateRoundTripOfALazyStateContinuesIdentically) {
  for (auto sc : {OneBitScaling::kColumnMeans, OneBitScaling::kSignL2}) {
    const Shape s{50, 70};
    OneBitCompressor a(make_cfg(sc), s.R, s.C), b(make_cfg(sc), s.R, s.C);
    Payload pa, pb;
    std::vector<float> g = normal(s.R * s.C, 1);
    a.encode(cpu_view(g, s), pa);
    const auto st = a.state_dict();  // taken from a lazy state
    b.load_state_dict(st.data(), st.size());
    for (int t = 0; t < 3; ++t) {
      g = normal(s.R * s.C, 2 + t);
      a.encode(cpu_view(g, s), pa);
      b.encode(cpu_view(g, s), pb);
      ASSERT_EQ(bytes_of(pa), bytes_of(pb)) << "step " << t;
    }
  }
}
