// SPDX-License-Identifier: Apache-2.0
// Core pieces: fp16/bf16 rounding, Philox, tensor views, buffers, the wire format's index codings
// and header validation, state (de)serialisation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "core/state_io.hpp"
#include "gradcomp/gradcomp.hpp"
#include "gradcomp/detail/numeric.hpp"
#include "test_util.hpp"

using namespace gradcomp;

namespace {

// Independent bf16 reference: the nearer of the two neighbouring bf16 values, ties to even.
uint16_t bf16_reference(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = std::fabs(static_cast<double>(bf16_to_float(lo)) - f);
  // past the largest finite value, IEEE rounding treats +-Inf as +-2^128
  const double vhi = (hi & 0x7fffu) == 0x7f80u ? std::copysign(std::ldexp(1.0, 128), f)
                                               : static_cast<double>(bf16_to_float(hi));
  const double dhi = std::fabs(vhi - f);
  if ((u & 0xffffu) == 0) return lo;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

}  // namespace

TEST(Numeric, HalfMatchesCompilerFloat16) {
#ifndef __FLT16_MAX__  // the compiler has no _Float16 here (clang < 15 on x86-64): no reference
  GTEST_SKIP() << "this compiler has no _Float16 for this target";
#else
  std::mt19937 rng(1);
  std::vector<float> cases = {0.0f,
                              -0.0f,
                              1.0f,
                              -1.0f,
                              65504.0f,
                              65519.0f,
                              65520.0f,
                              1e-8f,
                              5.96e-8f,
                              2.98e-8f,
                              6.1e-5f,
                              6.09e-5f,
                              3.14159f,
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  std::uniform_real_distribution<float> e(-30.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) {
    const float v = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng), int(e(rng)));
    cases.push_back(i % 2 ? v : -v);
  }
  for (float f : cases) {
    const _Float16 ref = static_cast<_Float16>(f);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    ASSERT_EQ(float_to_half(f), rb) << "f=" << f;
    ASSERT_EQ(half_to_float(rb), static_cast<float>(ref)) << "bits=" << rb;
  }
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::nanf("")))));
#endif
}

TEST(Numeric, AllHalfBitPatternsRoundTrip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = half_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), b);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/// The hardware's fp16 -> fp32 conversion (F16C), an independent reference for half_to_float.
__attribute__((target("f16c"))) static uint32_t f16c_widen(uint16_t h) {
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(h));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_castps_si128(v)));
}
#endif

/// Every fp16 bit pattern widens to the bits the F16C instruction gives, NaNs included: they come
/// out quiet with sign and payload kept (0x7c2a, a signalling NaN, is 0x7fc54000), so a kernel's
/// vector path and its scalar twin agree whatever the compiler folds.
TEST(Numeric, HalfWidensLikeTheHardwareNaNsQuiet) {
  EXPECT_EQ(float_bits(half_to_float(0x7c2a)), 0x7fc54000u);
  EXPECT_EQ(float_bits(half_to_float(0xfc01)), 0xffc02000u);
  EXPECT_EQ(float_bits(half_to_float(0x7e00)), 0x7fc00000u);
  EXPECT_EQ(float_bits(half_to_float(0x7c00)), 0x7f800000u);  // Inf stays Inf
  EXPECT_EQ(float_bits(bf16_to_float(0x7f81)), 0x7fc10000u);  // bf16 signalling NaN
  EXPECT_EQ(float_bits(bf16_to_float(0xffc1)), 0xffc10000u);  // already quiet
  EXPECT_EQ(float_bits(bf16_to_float(0xff80)), 0xff800000u);  // -Inf
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint32_t u = b << 16;  // bf16 widening is exact except for the quiet bit of NaNs
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    ASSERT_EQ(float_bits(bf16_to_float(static_cast<uint16_t>(b))), nan ? (u | 0x400000u) : u)
        << std::hex << b;
  }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned a = 0, b = 0, c = 0, d = 0;  // F16C: CPUID leaf 1, ECX bit 29 (clang < 16 has no
  if (!__get_cpuid(1, &a, &b, &c, &d) || (c & bit_F16C) == 0)  // "f16c" for cpu_supports)
    GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t b = 0; b < 65536; ++b)
    ASSERT_EQ(float_bits(half_to_float(static_cast<uint16_t>(b))),
              f16c_widen(static_cast<uint16_t>(b)))
        << std::hex << b;
#else
  GTEST_SKIP() << "no F16C reference on this target";
#endif
}

TEST(Numeric, Bf16MatchesNearestEvenReference) {
  std::mt19937 rng(2);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    if ((u & 0x7f800000u) == 0x7f800000u) continue;  // skip NaN/Inf here
    float f;
    std::memcpy(&f, &u, 4);
    ASSERT_EQ(float_to_bf16(f), bf16_reference(f)) << std::hex << u;
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
}

TEST(Rng, PhiloxKnownAnswers) {
  // Known-answer vectors of Philox4x32-10 (Salmon et al., Random123 distribution).
  Philox4 z = philox4x32_10(Philox4{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(z.v[0], 0x6627e8d5u);
  EXPECT_EQ(z.v[1], 0xe169c58du);
  EXPECT_EQ(z.v[2], 0xbc57ac4cu);
  EXPECT_EQ(z.v[3], 0x9b00dbd8u);
  Philox4 f = philox4x32_10(Philox4{{~0u, ~0u, ~0u, ~0u}}, ~0u, ~0u);
  EXPECT_EQ(f.v[0], 0x408f276du);
  EXPECT_EQ(f.v[1], 0x41c83b0eu);
  EXPECT_EQ(f.v[2], 0xa20bc7c6u);
  EXPECT_EQ(f.v[3], 0x6d5451fdu);
  Philox4 p = philox4x32_10(Philox4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                            0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(p.v[0], 0xd16cfe09u);
  EXPECT_EQ(p.v[1], 0x94fdccebu);
  EXPECT_EQ(p.v[2], 0x5001e420u);
  EXPECT_EQ(p.v[3], 0x24126ea1u);
}

TEST(Rng, KeyedStreamsDifferAndUniformIsInRange) {
  RngKey a{1, 0, 0}, b{1, 1, 0}, c{1, 0, 1}, d{2, 0, 0};
  int same = 0;
  double sum = 0;
  for (uint64_t i = 0; i < 10000; ++i) {
    same += a.word(i) == b.word(i) || a.word(i) == c.word(i) || a.word(i) == d.word(i);
    const float u = a.uniform(i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
    ASSERT_LT(a.below(i, 7), 7u);
  }
  EXPECT_LT(same, 3);
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
}

TEST(Tensor, ShapeAndDescribe) {
  std::vector<float> x(12);
  TensorView v(x.data(), {3, 4}, DType::kFloat32, Device::kCPU);
  EXPECT_EQ(v.numel, 12);
  EXPECT_EQ(v.rows(), 3);
  EXPECT_EQ(v.cols(), 4);
  EXPECT_EQ(v.describe(), "float32[3, 4] on cpu");
  EXPECT_THROW(TensorView(x.data(), {-1, 4}, DType::kFloat32, Device::kCPU), InvalidArgument);
  EXPECT_THROW(TensorView(nullptr, {3}, DType::kFloat32, Device::kCPU), InvalidArgument);
  EXPECT_THROW(TensorView(x.data(), {3}, static_cast<DType>(7), Device::kCPU), InvalidArgument);
}

TEST(Buffer, GrowsOnlyWhenNeededAndKeepsContents) {
  Buffer b;
  int* p = b.get<int>(10);
  for (int i = 0; i < 10; ++i) p[i] = i;
  const size_t cap = b.capacity();
  EXPECT_EQ(b.get<int>(5), p);  // no reallocation when smaller
  EXPECT_EQ(b.capacity(), cap);
  int* q = b.get<int>(1000, /*keep=*/true);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(q[i], i);
  Buffer moved = std::move(b);
  EXPECT_EQ(moved.data(), q);
  EXPECT_EQ(b.data(), nullptr);
}

TEST(Runtime, CudaEntryPointsFailClearlyWithoutCuda) {
  if (built_with_cuda()) GTEST_SKIP() << "built with CUDA";
  EXPECT_EQ(cuda_device_count(), 0);
  try {
    cuda::malloc_async(16, nullptr);
    FAIL() << "expected NotBuiltWithCuda";
  } catch (const NotBuiltWithCuda& e) {
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos);
  }
}

TEST(Runtime, NcclEntryPointsNameWhatTheBuildLacks) {
  // a CUDA build whose configure step found no NCCL must not blame CUDA
  auto message = [](bool cuda_built) {
    try {
      throw_not_built_with_nccl("NcclCommunicator", cuda_built);
    } catch (const NotBuiltWithCuda& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  const std::string with_cuda = message(true), without = message(false);
  EXPECT_NE(with_cuda.find("built with CUDA but without NCCL"), std::string::npos) << with_cuda;
  EXPECT_EQ(with_cuda.find("built without CUDA"), std::string::npos) << with_cuda;
  EXPECT_NE(without.find("built without CUDA"), std::string::npos) << without;
  EXPECT_NE(without.find("NcclCommunicator (NCCL)"), std::string::npos) << without;
}

class IndexCodingTest : public ::testing::TestWithParam<int> {};

TEST_P(IndexCodingTest, RoundTripsEveryCoding) {
  std::mt19937 rng(GetParam());
  for (uint64_t numel : {1ull, 7ull, 1023ull, 100000ull}) {
    for (double density : {0.0, 0.001, 0.1, 0.9, 1.0}) {
      std::vector<uint32_t> idx;
      for (uint64_t i = 0; i < numel; ++i)
        if (std::uniform_real_distribution<double>(0, 1)(rng) < density) idx.push_back(uint32_t(i));
      for (auto coding : {IndexCoding::kRaw32, IndexCoding::kDeltaVarint, IndexCoding::kBitmap}) {
        uint64_t bytes = coding == IndexCoding::kRaw32 ? 4 * idx.size()
                         : coding == IndexCoding::kBitmap
                             ? (numel + 7) / 8
                             : delta_varint_bytes(idx.data(), idx.size());
        std::vector<uint8_t> buf(bytes + 1);
        encode_indices(idx.data(), idx.size(), numel, coding, buf.data());
        std::vector<uint32_t> back(idx.size() + 1);
        decode_indices(buf.data(), bytes, coding, idx.size(), numel, back.data());
        back.resize(idx.size());
        ASSERT_EQ(back, idx) << "coding " << int(coding) << " numel " << numel;
      }
      uint64_t sec = 0;
      const IndexCoding best =
          choose_index_coding(numel, idx.size(), delta_varint_bytes(idx.data(), idx.size()), &sec);
      EXPECT_LE(sec, std::max<uint64_t>(4 * idx.size(), 0)) << int(best);
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Seeds, IndexCodingTest, ::testing::Values(1, 2, 3));

TEST(Wire, IndexDecodeRejectsOutOfRangeAndUnordered) {
  std::vector<uint32_t> out(4);
  const uint32_t bad_range[2] = {1, 10};
  EXPECT_THROW(decode_indices(reinterpret_cast<const uint8_t*>(bad_range), 8, IndexCoding::kRaw32,
                              2, 10, out.data()),
               CorruptPayload);
  const uint32_t unordered[2] = {5, 3};
  EXPECT_THROW(decode_indices(reinterpret_cast<const uint8_t*>(unordered), 8, IndexCoding::kRaw32,
                              2, 10, out.data()),
               CorruptPayload);
  const uint8_t varint_trunc[1] = {0x85};  // continuation bit set, then nothing
  EXPECT_THROW(decode_indices(varint_trunc, 1, IndexCoding::kDeltaVarint, 1, 1000, out.data()),
               CorruptPayload);
  // found by fuzz_wire: a header claiming numel > 2^32 let a delta-coded index pass the range
  // check and wrap around in the 32-bit output (here 2^32 + 1 after 5: "descending")
  const uint8_t wraps[6] = {0x05, 0xFB, 0xFF, 0xFF, 0xFF, 0x0F};  // 5, then gap 2^32 - 5
  EXPECT_THROW(
      decode_indices(wraps, 6, IndexCoding::kDeltaVarint, 2, uint64_t{1} << 40, out.data()),
      CorruptPayload);
  const uint8_t fits[2] = {0x05, 0x02};  // 5, 8: fine under the same large numel
  decode_indices(fits, 2, IndexCoding::kDeltaVarint, 2, uint64_t{1} << 40, out.data());
  EXPECT_EQ(out[0], 5u);
  EXPECT_EQ(out[1], 8u);
  const uint8_t bitmap[2] = {0x03, 0x80};  // bits 0, 1, 15: 15 >= numel 10
  EXPECT_THROW(decode_indices(bitmap, 2, IndexCoding::kBitmap, 3, 10, out.data()), CorruptPayload);
  const uint8_t bitmap_ok[2] = {0x03, 0x02};  // bits 0, 1, 9: but header says 2
  EXPECT_THROW(decode_indices(bitmap_ok, 2, IndexCoding::kBitmap, 2, 10, out.data()),
               CorruptPayload);
}

TEST(Wire, HeaderValidationNamesTheField) {
  PayloadHeader h;
  h.kind = 1;
  h.numel = 10;
  h.count = 2;
  h.section_bytes[0] = 8;
  h.section_bytes[1] = 8;
  std::vector<uint8_t> buf(h.total_bytes());
  std::memcpy(buf.data(), &h, 64);
  EXPECT_NO_THROW(parse_header(buf.data(), buf.size()));
  auto expect_msg = [&](std::vector<uint8_t> b, size_t n, const char* what) {
    try {
      parse_header(b.data(), n);
      FAIL() << "expected CorruptPayload for " << what;
    } catch (const CorruptPayload& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_msg(buf, 10, "fewer than the 64-byte header");
  expect_msg(buf, buf.size() - 1, "truncated");
  auto b2 = buf;
  b2[0] ^= 1;
  expect_msg(b2, b2.size(), "magic");
  b2 = buf;
  b2[4] = 9;
  expect_msg(b2, b2.size(), "version");
  b2 = buf;
  b2[8] = 77;
  expect_msg(b2, b2.size(), "kind");
  b2 = buf;
  b2[9] = 9;
  expect_msg(b2, b2.size(), "dtype");
  b2 = buf;
  PayloadHeader h2 = h;
  h2.count = 11;
  std::memcpy(b2.data(), &h2, 64);
  expect_msg(b2, b2.size(), "exceeds element count");
}

TEST(StateIo, RoundTripAndMismatch) {
  detail::StateWriter w("demo");
  w.put<int64_t>(42);
  const float arr[3] = {1, 2, 3};
  w.put_array(arr, Device::kCPU, sizeof arr, nullptr);
  auto bytes = w.take();
  detail::StateReader r(bytes.data(), bytes.size(), "demo");
  r.expect<int64_t>("n", 42);
  const uint8_t* p = r.array("arr", sizeof arr);
  EXPECT_EQ(std::memcmp(p, arr, sizeof arr), 0);
  r.finish();
  EXPECT_THROW(detail::StateReader(bytes.data(), bytes.size(), "other"), InvalidArgument);
  detail::StateReader r2(bytes.data(), bytes.size(), "demo");
  EXPECT_THROW(r2.expect<int64_t>("n", 41), InvalidArgument);
  // a truncated state fails its checksum; a short one with a valid checksum fails at the field
  EXPECT_THROW(detail::StateReader(bytes.data(), bytes.size() - 2, "demo"), InvalidArgument);
  detail::StateWriter ws("demo");
  ws.put<int64_t>(42);
  ws.put<uint64_t>(sizeof arr);
  const auto short_bytes = ws.take();
  detail::StateReader r3(short_bytes.data(), short_bytes.size(), "demo");
  r3.get<int64_t>("n");
  EXPECT_THROW(r3.array("arr", sizeof arr), InvalidArgument);
}
