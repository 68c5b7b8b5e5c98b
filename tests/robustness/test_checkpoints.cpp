// SPDX-License-Identifier: Apache-2.0
// Checked checkpoints: the CRC-32C against its published check values, and, for every state kind,
// every single-byte corruption, truncation and extension of a saved state rejected with
// InvalidArgument and the loading object unchanged; NaN/Inf values in a well-formed state refused.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "core/crc32c.hpp"
#include "core/state_io.hpp"
#include "state_subjects.hpp"

namespace gradcomp {
namespace {

using detail::crc32c;
using detail::crc32c_portable;

uint32_t crc_of(const std::vector<uint8_t>& v) { return crc32c(v.data(), v.size()); }

TEST(Crc32c, PublishedCheckValues) {
  const char* check = "123456789";  // the CRC catalogue's check input
  EXPECT_EQ(crc32c(check, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(check, 9), 0xE3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  // RFC 3720 (iSCSI) appendix B.4: 32 bytes of 0x00, of 0xFF, ascending 0..31, descending 31..0
  std::vector<uint8_t> v(32, 0);
  EXPECT_EQ(crc_of(v), 0x8A9136AAu);
  std::fill(v.begin(), v.end(), 0xFF);
  EXPECT_EQ(crc_of(v), 0x62A8AB43u);
  std::iota(v.begin(), v.end(), 0);
  EXPECT_EQ(crc_of(v), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) v[i] = static_cast<uint8_t>(31 - i);
  EXPECT_EQ(crc_of(v), 0x113FDB5Cu);
  // RFC 3720 B.4: an iSCSI read command PDU
  const std::vector<uint8_t> pdu = {0x01, 0xC0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00,
                                    0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00,
                                    0x00, 0x18, 0x28, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                    0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
  EXPECT_EQ(crc_of(pdu), 0xD9963A56u);
}

TEST(Crc32c, FastPathEqualsPortableAndExtends) {
  std::vector<uint8_t> buf(1100);
  uint32_t x = 1;
  for (auto& b : buf) b = static_cast<uint8_t>((x = x * 1103515245u + 12345u) >> 16);
  for (size_t off = 0; off < 9; ++off)  // unaligned starts
    for (size_t n = 0; n + off <= buf.size(); n += (n < 70 ? 1 : 97)) {
      const uint32_t want = crc32c_portable(buf.data() + off, n);
      ASSERT_EQ(crc32c(buf.data() + off, n), want) << "off " << off << " n " << n;
      for (size_t cut : {size_t{0}, n / 3, n}) {  // crc of a then b continues crc of a
        ASSERT_EQ(crc32c(buf.data() + off + cut, n - cut, crc32c(buf.data() + off, cut)), want);
        ASSERT_EQ(crc32c_portable(buf.data() + off + cut, n - cut,
                                  crc32c_portable(buf.data() + off, cut)),
                  want);
      }
    }
}

TEST(StateIo, FiniteArrayNamesFieldAndElement) {
  const float vals[3] = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  detail::StateWriter w("demo");
  w.put_array(vals, Device::kCPU, sizeof vals, nullptr);
  const auto bytes = w.take();
  detail::StateReader ok(bytes.data(), bytes.size(), "demo");
  EXPECT_NE(ok.array("arr", sizeof vals), nullptr);  // plain arrays take any bits
  detail::StateReader r(bytes.data(), bytes.size(), "demo");
  try {
    r.finite_array("residual", sizeof vals);
    ADD_FAILURE() << "Inf accepted";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'residual'"), std::string::npos) << m;
    EXPECT_NE(m.find("element 1"), std::string::npos) << m;
  }
}

TEST(StateIo, OldVersionAndBadChecksumSayWhy) {
  detail::StateWriter w("demo");
  w.put<int64_t>(5);
  auto bytes = w.take();
  auto expect_msg = [](const std::vector<uint8_t>& b, const char* want) {
    try {
      detail::StateReader r(b.data(), b.size(), "demo");
      ADD_FAILURE() << "accepted; wanted an error with '" << want << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  auto b = bytes;
  b[12 + 4 + 2] ^= 0x20;  // a byte of the field after magic, version, kind
  expect_msg(b, "checksum mismatch");
  {  // both checksums in hexadecimal
    const uint32_t stored = [&] {
      uint32_t v;
      std::memcpy(&v, bytes.data() + bytes.size() - 4, 4);
      return v;
    }();
    std::ostringstream os;
    os << "(stored 0x" << std::hex << stored << ", computed 0x";
    expect_msg(b, os.str().c_str());
  }
  b = bytes;
  const uint32_t v1 = 1;
  std::memcpy(b.data() + 4, &v1, 4);
  expect_msg(b, "older gradcomp");
  expect_msg(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 9), "truncated");
}

class EveryStateKind : public ::testing::TestWithParam<std::string> {};

// A state saved after three steps, and an object of the same configuration holding a different
// state (two other steps) to load it into.
struct Fixture {
  std::vector<uint8_t> saved, before;
  std::unique_ptr<test::StateSubject> target;
  explicit Fixture(const std::string& kind) {
    auto src = test::make_state_subject(kind);
    for (uint32_t s = 1; s <= 3; ++s) src->step(s);
    saved = src->save();
    target = test::make_state_subject(kind);
    for (uint32_t s = 11; s <= 12; ++s) target->step(s);
    before = target->save();
  }
  // Loads `bytes`; returns "" when it was rejected with InvalidArgument and left the state as it
  // was, else what went wrong.
  std::string rejected_cleanly(const std::vector<uint8_t>& bytes) {
    std::string what;
    try {
      target->load(bytes.data(), bytes.size());
      what = "accepted";
    } catch (const InvalidArgument&) {
    } catch (const std::exception& e) {
      what = std::string("threw something other than InvalidArgument: ") + e.what();
    }
    if (what.empty() && target->save() != before) what = "rejected but the state changed";
    return what;
  }
};

TEST_P(EveryStateKind, EveryByteFlipTruncationAndExtensionRejected) {
  Fixture f(GetParam());
  ASSERT_NE(f.saved, f.before);
  SCOPED_TRACE(GetParam() + ": state of " + std::to_string(f.saved.size()) + " bytes");
  int failures = 0;
  auto check = [&](const std::vector<uint8_t>& bytes, const std::string& how) {
    const std::string what = f.rejected_cleanly(bytes);
    if (!what.empty() && ++failures <= 10) ADD_FAILURE() << how << ": " << what;
  };
  for (size_t i = 0; i < f.saved.size(); ++i)
    for (int mask : {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF, 0x5A}) {
      auto b = f.saved;
      b[i] ^= static_cast<uint8_t>(mask);
      check(b, "byte " + std::to_string(i) + " ^ " + std::to_string(mask));
    }
  for (size_t n = 0; n < f.saved.size(); ++n)
    check(std::vector<uint8_t>(f.saved.begin(), f.saved.begin() + n),
          "truncated to " + std::to_string(n));
  for (uint8_t extra : {0x00, 0xFF}) {
    auto b = f.saved;
    b.push_back(extra);
    check(b, "one byte appended");
  }
  EXPECT_EQ(failures, 0);
  // the intact state still loads, exactly
  f.target->load(f.saved.data(), f.saved.size());
  EXPECT_EQ(f.target->save(), f.saved);
}

TEST_P(EveryStateKind, NonFiniteValuesRefusedWithStateUnchanged) {
  // Saved by an object with check_finite off after a NaN gradient: well formed, valid checksum,
  // NaN in the residual / momentum / error / Q.
  auto src = test::make_state_subject(GetParam(), /*check_finite=*/false);
  src->step(1);
  src->step(2, /*poison=*/true);
  const auto poisoned = src->save();
  Fixture f(GetParam());
  try {
    f.target->load(poisoned.data(), poisoned.size());
    ADD_FAILURE() << GetParam() << ": a state holding NaN was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f.target->save(), f.before);
}

TEST_P(EveryStateKind, StepThatCannotAdvanceRefused) {
  // A well-formed state (valid checksum) whose step counter is INT64_MAX would overflow at the
  // next step (found by fuzz_state_onebit under UBSan). Every int64 field holding 3 (the saved
  // step among them) is set to INT64_MAX in turn; each such state must be refused cleanly, the
  // step field's with "out of range".
  Fixture f(GetParam());
  int step_fields = 0;
  for (size_t i = 0; i + sizeof(int64_t) + sizeof(uint32_t) <= f.saved.size(); ++i) {
    int64_t v;
    std::memcpy(&v, f.saved.data() + i, sizeof v);
    if (v != 3) continue;
    auto b = f.saved;
    const int64_t big = std::numeric_limits<int64_t>::max();
    std::memcpy(b.data() + i, &big, sizeof big);
    const uint32_t crc = detail::crc32c(b.data(), b.size() - sizeof(uint32_t));
    std::memcpy(b.data() + b.size() - sizeof(uint32_t), &crc, sizeof crc);
    try {
      f.target->load(b.data(), b.size());
      ADD_FAILURE() << GetParam() << ": int64 at byte " << i << " = INT64_MAX was accepted";
    } catch (const InvalidArgument& e) {
      step_fields += std::string(e.what()).find("out of range") != std::string::npos;
    }
    EXPECT_EQ(f.target->save(), f.before) << "byte " << i;
  }
  EXPECT_GE(step_fields, 1) << GetParam() << ": no step field refused as out of range";
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, EveryStateKind, ::testing::ValuesIn(test::state_kinds()),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s)
                             if (c == '-') c = '_';
                           return s;
                         });

}  // namespace
}  // namespace gradcomp
