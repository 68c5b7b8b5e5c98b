// SPDX-License-Identifier: Apache-2.0
// Microbenchmark of the fp16 / bf16 cast plans' local sum (CPU): what a rank does with the P
// half-precision buffers (gather route) or chunks (reduce-scatter route) it received: widen, sum
// in rank order in fp32, round once to the wire type, write the gradient. BM_cast_sum is the
// one-pass kernel the plans run (kernels::cpu::sum_widened); BM_cast_sum_composition is the
// four-pass composition it replaced (widen all P buffers to fp32, reduce_blocks, narrow, cast),
// kept here as the baseline of the same run. Arg 0: n (elements of one buffer), arg 1: P.
//
// Counters (bench/bench_common.hpp): bytes_per_second counts the bytes the one-pass kernel must
// move (read 2 P n, write 4 n: the same figure for both, so their bandwidths compare as their
// speeds); frac_of_copy = that bandwidth (fastest iteration) / the bandwidth of a plain memory
// copy of n floats measured by this binary in the same run.
//
// The fp8 family's two kernels on the same sizes (blocks of 256 values, e4m3): BM_fp8_encode
// (read the fp32 gradient, write a record per block: 4 n read, n + n / 64 written) and
// BM_fp8_sum, the gather route's local work (read the P ranks' records, sum in rank order, write
// the fp32 gradient: P (n + n / 64) read, 4 n written), each as a fraction of the copy bandwidth.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench_common.hpp"
#include "gradcomp/gradcomp.hpp"
#include "kernels/fp8_kernels.hpp"
#include "kernels/reduce_kernels.hpp"

using namespace gradcomp;
using gradcomp::bench::IterTimer;
using gradcomp::bench::LoopTimer;
using gradcomp::bench::set_counters;

namespace {

std::vector<uint16_t> half_buffers(int64_t n, int P) {
  const std::vector<float>& g = gradcomp::bench::normal_data(n);
  std::vector<uint16_t> all(static_cast<size_t>(n) * static_cast<size_t>(P));
  for (int p = 0; p < P; ++p)
    kernels::cpu::convert(g.data(), DType::kFloat32, all.data() + static_cast<size_t>(p) * n,
                          DType::kFloat16, n, static_cast<float>(P + p));
  return all;
}

/// Runs `step` once to touch its pages, then times it every iteration (`out`: what it writes,
/// kept from being optimized away), and sets the counters for `bytes` moved per call.
template <class Step>
void time_steps(benchmark::State& st, Step step, const void* out, double bytes, int64_t n) {
  step();
  LoopTimer timer;
  IterTimer it;
  for (auto _ : st) {
    it.start();
    step();
    benchmark::DoNotOptimize(out);
    it.stop();
  }
  set_counters(st, bytes, n, timer.seconds(), it, 0);
}

void BM_cast_sum(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int P = static_cast<int>(st.range(1));
  const auto un = static_cast<size_t>(n);
  const auto all = half_buffers(n, P);
  std::vector<float> grad(un);
  auto step = [&] {
    kernels::cpu::sum_widened(all.data(), DType::kFloat16, P, un, un, nullptr, grad.data(),
                              DType::kFloat32);
  };
  st.SetLabel("fp16 wire, fp32 gradient, P = " + std::to_string(P) + ", one pass");
  time_steps(st, step, grad.data(), 2.0 * P * n + 4.0 * n, n);
}

void BM_cast_sum_composition(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int P = static_cast<int>(st.range(1));
  const auto un = static_cast<size_t>(n);
  const auto all = half_buffers(n, P);
  std::vector<float> wide(un * P), grad(un);
  std::vector<uint16_t> w(un);
  auto step = [&] {
    kernels::cpu::convert(all.data(), DType::kFloat16, wide.data(), DType::kFloat32,
                          static_cast<int64_t>(un * P), 1.0f);
    kernels::cpu::reduce_blocks(wide.data(), P, un, un, ElemType::kF32, wide.data());
    kernels::cpu::convert(wide.data(), DType::kFloat32, w.data(), DType::kFloat16, n, 1.0f);
    kernels::cpu::convert(w.data(), DType::kFloat16, grad.data(), DType::kFloat32, n, 1.0f);
  };
  st.SetLabel("fp16 wire, fp32 gradient, P = " + std::to_string(P) + ", four passes (baseline)");
  time_steps(st, step, grad.data(), 2.0 * P * n + 4.0 * n, n);
}

constexpr int kFp8Block = 256;

std::vector<uint8_t> fp8_records(int64_t n, int P) {
  const std::vector<float>& g = gradcomp::bench::normal_data(n);
  const int64_t nb = (n + kFp8Block - 1) / kFp8Block;
  const size_t bytes = static_cast<size_t>(nb) * kernels::fp8_record_bytes(kFp8Block);
  std::vector<uint8_t> all(bytes * static_cast<size_t>(P));
  for (int p = 0; p < P; ++p)
    kernels::cpu::fp8_encode_blocks(g.data(), DType::kFloat32, n, nb, kFp8Block, false,
                                    all.data() + static_cast<size_t>(p) * bytes);
  return all;
}

void BM_fp8_encode(benchmark::State& st) {
  const int64_t n = st.range(0);
  const std::vector<float>& g = gradcomp::bench::normal_data(n);
  const int64_t nb = (n + kFp8Block - 1) / kFp8Block;
  std::vector<uint8_t> rec(static_cast<size_t>(nb) * kernels::fp8_record_bytes(kFp8Block));
  auto step = [&] {
    kernels::cpu::fp8_encode_blocks(g.data(), DType::kFloat32, n, nb, kFp8Block, false, rec.data());
  };
  st.SetLabel("fp8 e4m3 encode, blocks of 256, fp32 gradient");
  time_steps(st, step, rec.data(), 4.0 * n + static_cast<double>(rec.size()), n);
}

void BM_fp8_sum(benchmark::State& st) {
  const int64_t n = st.range(0);
  const int P = static_cast<int>(st.range(1));
  const auto all = fp8_records(n, P);
  const size_t bytes = all.size() / static_cast<size_t>(P);
  const int64_t nb = (n + kFp8Block - 1) / kFp8Block;
  std::vector<float> grad(static_cast<size_t>(n));
  auto step = [&] {
    kernels::cpu::fp8_sum_blocks(all.data(), P, bytes, nb, kFp8Block, false, float(P), nullptr,
                                 grad.data(), DType::kFloat32, n);
  };
  st.SetLabel("fp8 e4m3 records of P = " + std::to_string(P) + " ranks summed, fp32 gradient");
  time_steps(st, step, grad.data(), static_cast<double>(all.size()) + 4.0 * n, n);
}

}  // namespace

// 824,000: about the experiments' CNN (824k parameters), what the 4-rank gather route sums per
// step; 2^22 a larger model
BENCHMARK(BM_cast_sum_composition)
    ->ArgsProduct({{824000, 1 << 22}, {4}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_cast_sum)
    ->ArgsProduct({{824000, 1 << 22}, {4}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_fp8_encode)
    ->Args({824000})
    ->Args({1 << 22})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_fp8_sum)
    ->ArgsProduct({{824000, 1 << 22}, {4}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
