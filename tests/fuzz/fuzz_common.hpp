// SPDX-License-Identifier: Apache-2.0
// What the libFuzzer targets (tests/fuzz/fuzz_*.cpp) and their seed generator (make_fuzz_seeds.cpp)
// share: the fixed configuration of every decoder under test, so that the committed seeds are
// valid payloads for the targets, and the checks a target makes beyond "no crash".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gradcomp/error.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/topk.hpp"
#include "plans/quant_plan.hpp"

namespace gradcomp::fuzz {

/// Elements of the tensor every decoder target decodes into; tensor id of its compressor.
inline constexpr int64_t kNumel = 1000;
inline constexpr uint32_t kTensorId = 7;

/// Top-k: decoding depends on numel and tensor_id only (count, coding and dtype come from the
/// header), so seeds may come from compressors of other densities and value dtypes.
inline TopKConfig topk_config(double ratio = 0.01, DType values = DType::kFloat32) {
  TopKConfig c;
  c.ratio = ratio;
  c.value_dtype = values;
  c.select.method = SelectMethod::kExact;
  c.tensor_id = kTensorId;
  return c;
}

/// Top-k with coded values (value_bits 2 in blocks of 32, so that a payload spans several blocks).
inline TopKConfig topk_coded_config(double ratio = 0.01) {
  TopKConfig c = topk_config(ratio);
  c.value_bits = 2;
  c.value_block = 32;
  return c;
}

/// Random-k: the count a payload must carry depends on the step in its header through the
/// warm-up schedule, which the target therefore has (two warm-up stages of 2 steps, then 1%).
inline RandomKConfig randomk_config(DType values = DType::kFloat32) {
  RandomKConfig c;
  c.ratio = 0.01;
  c.warmup_ratios = {0.25, 0.05};
  c.warmup_steps = 2;
  c.value_dtype = values;
  c.tensor_id = kTensorId;
  return c;
}

/// 1-bit: decoding is self-describing (mode and grouping from the header); the target's
/// compressor is 40 x 25 column means, seeds come from every mode.
inline constexpr int64_t kOneBitRows = 40, kOneBitCols = 25;
inline OneBitConfig onebit_config(OneBitScaling s = OneBitScaling::kColumnMeans,
                                  int64_t chunk = 0) {
  OneBitConfig c;
  c.scaling = s;
  c.block_size = chunk;
  c.tensor_id = kTensorId;
  return c;
}

/// Multi-bit: rank 0 of a 2-rank plan over kNumel elements (4 bits, 32-element blocks, rotated,
/// fp16 scales) receives its peer's two chunks from the fuzzer: the worker chunk of the
/// all-to-all and the averaged chunk of the allgather (input = both, block_bytes() each).
inline QuantConfig quant_config() {
  QuantConfig c;
  c.bits = 4;
  c.block_size = 32;
  c.scale_dtype = DType::kFloat16;
  c.tensor_id = kTensorId;
  return c;
}

/// One step of rank 0 of the multi-bit target's plan, its peer's chunks taken from `in` (two
/// chunks of block_bytes(), zero-padded); the averaged gradient lands in g. InvalidArgument when
/// the plan refuses a chunk.
inline void quant_step_with_peer(QuantPlan& plan, const uint8_t* in, size_t size,
                                 std::vector<float>& g);

/// A deterministic gradient of n finite values with a spread of magnitudes and both signs.
inline std::vector<float> gradient(int64_t n, uint32_t seed) {
  std::vector<float> g(static_cast<size_t>(n));
  uint32_t x = seed * 2654435761u + 1u;
  for (auto& v : g) {
    x = x * 1664525u + 1013904223u;
    const float u = static_cast<float>(static_cast<int32_t>(x >> 8) - (1 << 23)) / float(1 << 23);
    v = u * u * u * 4.0f;  // cubed: many small values, a few large ones
  }
  return g;
}

/// A violated property of a target: printed, then abort() (libFuzzer records the input as a
/// crash).
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  std::abort();
}
inline void require(bool ok, const char* what) {
  if (!ok) fail(what);
}

/// The input copied to 8-byte aligned storage, as payloads are on the wire (1-bit decoding
/// requires it).
struct Aligned {
  Aligned(const uint8_t* d, size_t n) : words((n + 7) / 8 + 1), size(n) {
    if (n) std::memcpy(words.data(), d, n);
  }
  const uint8_t* data() const { return reinterpret_cast<const uint8_t*>(words.data()); }
  std::vector<uint64_t> words;
  size_t size;
};

/// The dense output's initial contents: a value no decode leaves in place by accident, so a
/// changed element is seen.
inline constexpr float kCanary = 0.375f;

/// Elements of `dense` that are no longer bitwise kCanary.
inline int64_t changed(const std::vector<float>& dense) {
  int64_t c = 0;
  for (float v : dense) c += std::memcmp(&v, &kCanary, sizeof v) != 0;
  return c;
}

/// The property both sparse decoders (top-k, random-k) must keep on arbitrary bytes: decode_add
/// rejects them (InvalidArgument/CorruptPayload) with the output untouched, or accepts a payload
/// whose header parses (else parse_header throws: a crash), of `kind` and this tensor, that
/// changes at most `count` output elements.
template <class Compressor>
int sparse_decode_add(Compressor& comp, PayloadKind kind, const uint8_t* data, size_t size) {
  const Aligned in(data, size);
  std::vector<float> dense(kNumel, kCanary);
  try {
    comp.decode_add(in.data(), in.size, TensorView::cpu(dense.data(), kNumel), 1.0f);
  } catch (const InvalidArgument&) {
    require(changed(dense) == 0, "a rejected payload changed the output");
    return 0;
  }
  const PayloadHeader h = parse_header(in.data(), in.size);
  require(h.kind == uint8_t(kind) && h.tensor_id == kTensorId,
          "a payload of another kind or tensor was decoded");
  require(changed(dense) <= static_cast<int64_t>(h.count),
          "more output elements changed than the payload holds");
  return 0;
}

inline void quant_step_with_peer(QuantPlan& plan, const uint8_t* in, size_t size,
                                 std::vector<float>& g) {
  const size_t B = plan.block_bytes();
  std::vector<uint8_t> peer(2 * B, 0);
  std::memcpy(peer.data(), in, std::min(size, peer.size()));
  g = gradient(plan.numel(), 1);
  plan.begin(TensorView::cpu(g.data(), plan.numel()));
  auto c = plan.next();  // all-to-all: own chunk 0 stays, the peer's chunk 0 is the input
  require(c && c->kind == CollectiveKind::kAllToAll && c->count == B, "not an all-to-all");
  auto* recv = static_cast<uint8_t*>(c->recv);
  std::memcpy(recv, c->send, B);
  std::memcpy(recv + B, peer.data(), B);
  c = plan.next();  // allgather: own averaged chunk, then the peer's (the input)
  require(c && c->kind == CollectiveKind::kAllgather && c->count == B, "not an allgather");
  recv = static_cast<uint8_t*>(c->recv);
  std::memcpy(recv, c->send, B);
  std::memcpy(recv + B, peer.data() + B, B);
  require(!plan.next().has_value(), "the step did not end after the allgather");
}

}  // namespace gradcomp::fuzz
