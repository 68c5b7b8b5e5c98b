// SPDX-License-Identifier: Apache-2.0
// Compresses a gradient with top-k through the installed headers and library and checks that the
// decode returns exactly the sent values.
#include <gradcomp/gradcomp.hpp>

#include <cstdio>
#include <vector>

int main() {
  const int64_t n = 10000;
  std::vector<float> g(n), out(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>((i * 37) % 101) - 50.0f;
  gradcomp::TopKConfig cfg;
  cfg.ratio = 0.01;
  cfg.select.method = gradcomp::SelectMethod::kExact;
  gradcomp::TopKCompressor comp(cfg, n);
  gradcomp::Payload p;
  comp.encode(gradcomp::TensorView::cpu(g.data(), n), p);
  comp.decode_add(p.data(), p.size(), gradcomp::TensorView::cpu(out.data(), n));
  int64_t sent = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] == 0.0f) continue;
    if (out[i] != g[i]) return 1;
    ++sent;
  }
  if (sent != comp.last_stats().count || sent != gradcomp::topk_count(0.01, n)) return 2;
  std::printf("gradcomp consumer: ok (%lld of %lld values in %zu bytes)\n",
              static_cast<long long>(sent), static_cast<long long>(n), p.size());
  return 0;
}
