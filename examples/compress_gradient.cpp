// SPDX-License-Identifier: Apache-2.0
// README example: compress a gradient with DGC top-k on one rank, decode and average on another.
#include <gradcomp/gradcomp.hpp>

#include <cstdio>
#include <vector>

int main() {
  const int64_t n = 1 << 20;
  std::vector<float> grad(n, 0.0f), avg(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) grad[i] = static_cast<float>((i * 7919) % 1000) - 500.0f;

  gradcomp::TopKConfig cfg;
  cfg.ratio = 0.001;    // send 0.1% of the elements; the rest waits in the residual
  cfg.momentum = 0.9;   // DGC momentum correction: use plain SGD (no momentum) as the optimizer
  cfg.clip_norm = 1e4;  // local gradient clipping before accumulation
  gradcomp::TopKCompressor comp(cfg, n);

  gradcomp::Payload payload;  // reused every step: no allocation in steady state
  comp.encode(gradcomp::TensorView::cpu(grad.data(), n), payload);
  // ... send payload.data(), payload.size() to the other ranks; each rank, for each payload:
  comp.decode_add(payload.data(), payload.size(), gradcomp::TensorView::cpu(avg.data(), n),
                  /*scale=*/1.0f / 1 /* world size */);

  std::printf("sent %lld of %lld values in %zu bytes: compression ratio %.1fx\n",
              static_cast<long long>(comp.last_stats().count), static_cast<long long>(n),
              payload.size(), comp.last_stats().compression_ratio());
  // sampled selection (the default) sends at most k = ceil(ratio n) values, fewer when the
  // sampled threshold lands above the k-th largest magnitude
  const int64_t c = comp.last_stats().count;
  return (c > 0 && c <= gradcomp::topk_count(cfg.ratio, n)) ? 0 : 1;
}
