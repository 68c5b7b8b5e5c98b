// SPDX-License-Identifier: Apache-2.0
// Error messages are built without streams (detail::cat formats numbers with std::to_chars): the
// text must be what `std::ostream <<` prints with its default format, the reference here, for
// every kind of value the messages hold.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>

#include "gradcomp/error.hpp"
#include "gradcomp/tensor.hpp"

namespace gradcomp {
namespace {

template <class T>
std::string streamed(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

template <class T>
void expect_as_streamed(const T& v) {
  EXPECT_EQ(detail::cat(v), streamed(v));
}

TEST(Messages, NumbersPrintAsTheStreamPrintsThem) {
  for (int64_t v : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{77}, int64_t{1} << 40,
                    std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()})
    expect_as_streamed(v);
  for (uint64_t v : {uint64_t{0}, std::numeric_limits<uint64_t>::max()}) expect_as_streamed(v);
  for (int v : {0, -5, 2147483647}) expect_as_streamed(v);
  expect_as_streamed(size_t{12345});
  expect_as_streamed(uint32_t{4000000000u});
  expect_as_streamed(int16_t{-300});
  for (double v :
       {0.0, -0.0, 0.1, 1.0 / 3.0, 1e-8, 1e8, 123456.0, 1234567.0, 65504.0, 1.5e300, -2.5, 4.9e-324,
        std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()})
    expect_as_streamed(v);
  for (float v : {0.3f, 1e-20f, 3.4e38f, -7.25f}) expect_as_streamed(v);
  EXPECT_EQ(detail::cat(std::nan("")), streamed(std::nan("")));
}

TEST(Messages, TextBoolsAndCharsPrintAsTheStreamPrintsThem) {
  expect_as_streamed(true);
  expect_as_streamed(false);
  expect_as_streamed('x');
  expect_as_streamed(static_cast<unsigned char>('A'));
  expect_as_streamed(static_cast<signed char>('z'));
  expect_as_streamed(std::string("a string"));
  expect_as_streamed(std::string_view("a view"));
  const char* p = "a pointer";
  EXPECT_EQ(detail::cat(p), "a pointer");
  EXPECT_EQ(detail::cat("rank ", 3, " at step ", int64_t{-1}, ": ", 0.5, " ", true, '!'),
            "rank 3 at step -1: 0.5 1!");
  EXPECT_EQ(detail::cat(), "");
}

TEST(Messages, HexPrintsAsTheStreamAfterStdHex) {
  for (uint32_t v : {0u, 1u, 0xdeadbeefu, 0xffffffffu}) {
    std::ostringstream os;
    os << std::hex << v;
    EXPECT_EQ(detail::cat(detail::hex(v)), os.str());
  }
  std::ostringstream os;
  os << std::hex << uint64_t{0x0123456789abcdefull};
  EXPECT_EQ(detail::cat("0x", detail::hex(uint64_t{0x0123456789abcdefull}), " ", 10),
            "0x" + os.str() + " 10");
}

TEST(Messages, TensorsDescribeTheirShape) {
  float x[6] = {};
  EXPECT_EQ(TensorView(x, {2, 3}, DType::kFloat32, Device::kCPU).describe(),
            "float32[2, 3] on cpu");
  EXPECT_EQ(TensorView(x, {6}, DType::kBFloat16, Device::kCPU).describe(), "bfloat16[6] on cpu");
  try {
    GC_CHECK_ARG(false, "index ", int64_t{2659}, " of ", 1.5e6);
    ADD_FAILURE() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "index 2659 of 1.5e+06");
  }
}

}  // namespace
}  // namespace gradcomp
