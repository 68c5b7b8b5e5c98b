// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: OneBitCompressor::decode_add and decode_average on arbitrary bytes.
// Properties: decode_add rejects (InvalidArgument/CorruptPayload, output untouched) or accepts a
// parsable 1-bit payload of this tensor; decode_average of the input twice rejects exactly when
// decode_add does, also leaving the output untouched (all payloads are validated first).
#include <cstdint>
#include <vector>

#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"

using namespace gradcomp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static OneBitCompressor comp(fuzz::onebit_config(), fuzz::kOneBitRows, fuzz::kOneBitCols);
  const fuzz::Aligned in(data, size);
  const auto view = [](std::vector<float>& d) {
    return TensorView::cpu(d.data(), {fuzz::kOneBitRows, fuzz::kOneBitCols});
  };
  std::vector<float> one(fuzz::kNumel, fuzz::kCanary), two(fuzz::kNumel, fuzz::kCanary);
  bool accepted = true;
  try {
    comp.decode_add(in.data(), in.size, view(one), 0.5f);
  } catch (const InvalidArgument&) {
    fuzz::require(fuzz::changed(one) == 0, "a rejected payload changed the output");
    accepted = false;
  }
  const void* ptrs[2] = {in.data(), in.data()};
  const size_t sizes[2] = {in.size, in.size};
  try {
    comp.decode_average(ptrs, sizes, 2, view(two), 0.5f);
    fuzz::require(accepted, "decode_average accepted what decode_add rejected");
  } catch (const InvalidArgument&) {
    fuzz::require(!accepted, "decode_average rejected what decode_add accepted");
    fuzz::require(fuzz::changed(two) == 0, "a rejected payload changed the output");
  }
  if (accepted) {
    const PayloadHeader h = parse_header(in.data(), in.size);
    fuzz::require(h.kind == uint8_t(PayloadKind::kOneBit) && h.numel == uint64_t(fuzz::kNumel) &&
                      h.tensor_id == fuzz::kTensorId,
                  "a payload of another kind, size or tensor was decoded");
  }
  return 0;
}
