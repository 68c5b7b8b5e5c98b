// SPDX-License-Identifier: Apache-2.0
// Layer shapes of the models the benchmarks use, written once.
#pragma once

#include <cstdint>
#include <vector>

namespace gradcomp::bench {

using Shapes = std::vector<std::vector<int64_t>>;

/// ResNet-50 (torchvision) parameter tensors in order: conv weights with BatchNorm weight and
/// bias, the bottleneck stages [3, 4, 6, 3] with downsample convs, fc 1000 x 2048 and its bias
/// (25,557,032 elements).
inline Shapes resnet50() {
  Shapes s;
  auto conv_bn = [&](int64_t out, int64_t in, int64_t k) {
    s.push_back({out, in, k, k});
    s.push_back({out});
    s.push_back({out});
  };
  conv_bn(64, 3, 7);
  int64_t in = 64;
  const int blocks[4] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const int64_t w = 64 << stage;
    for (int b = 0; b < blocks[stage]; ++b) {
      conv_bn(w, in, 1);
      conv_bn(w, w, 3);
      conv_bn(4 * w, w, 1);
      if (b == 0) conv_bn(4 * w, in, 1);  // downsample
      in = 4 * w;
    }
  }
  s.push_back({1000, 2048});
  s.push_back({1000});
  return s;
}

// BERT-base (uncased): embeddings, 12 encoder layers, pooler.
inline Shapes bert_base() {
  const int64_t h = 768, f = 3072;
  Shapes s = {{30522, h}, {512, h}, {2, h}, {h}, {h}};
  for (int l = 0; l < 12; ++l) {
    for (int k = 0; k < 4; ++k) {  // query, key, value, attention output
      s.push_back({h, h});
      s.push_back({h});
    }
    s.push_back({h});
    s.push_back({h});  // attention LayerNorm
    s.push_back({f, h});
    s.push_back({f});
    s.push_back({h, f});
    s.push_back({h});
    s.push_back({h});
    s.push_back({h});  // output LayerNorm
  }
  s.push_back({h, h});
  s.push_back({h});
  return s;
}

}  // namespace gradcomp::bench
