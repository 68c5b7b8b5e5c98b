// SPDX-License-Identifier: Apache-2.0
// Independent single-process references of the comm plans (plain scalar loops plus the
// compressors applied per rank) and the deterministic per-rank inputs the comm tests share.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "gradcomp/numeric.hpp"
#include "gradcomp/plans.hpp"
#include "test_util.hpp"

namespace gradcomp::test {

/// Rank r's gradient at step s: normal data whose scale and large-value region depend on the
/// rank, so that top-k payloads of different ranks have different lengths: rank r >= 1
/// amplifies [0, n / (8 r)), which packs its top-k indices closer (shorter delta coding) than
/// rank 0's, spread over the whole tensor.
inline std::vector<float> rank_input(int64_t n, int rank, int64_t step) {
  auto v = normal(n, 1000003ull * static_cast<uint64_t>(step) + 7919ull * rank + 17, 1.0f + rank);
  if (rank > 0)
    for (int64_t i = 0; i < n / (8 * rank); ++i) v[static_cast<size_t>(i)] *= 100.0f;
  return v;
}

inline std::vector<float> ref_dense(const std::vector<std::vector<float>>& in) {
  const size_t P = in.size(), n = in[0].size();
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    float acc = in[0][i];
    for (size_t r = 1; r < P; ++r) acc += in[r][i];
    out[i] = acc / static_cast<float>(P);
  }
  return out;
}

inline std::vector<float> ref_cast(const std::vector<std::vector<float>>& in, DType wire) {
  const size_t P = in.size(), n = in[0].size();
  const bool h = wire == DType::kFloat16;
  auto to = [&](float x) { return h ? float_to_half(x) : float_to_bf16(x); };
  auto from = [&](uint16_t x) { return h ? half_to_float(x) : bf16_to_float(x); };
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint16_t acc = to(in[0][i] / static_cast<float>(P));
    for (size_t r = 1; r < P; ++r) acc = to(from(acc) + from(to(in[r][i] / static_cast<float>(P))));
    out[i] = from(acc);
  }
  return out;
}

/// Sum in rank order of the per-rank dense decodes (each already scaled by 1/P).
inline std::vector<float> sum_decodes(const std::vector<std::vector<float>>& dec) {
  const size_t P = dec.size(), n = dec[0].size();
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    float acc = dec[0][i];
    for (size_t r = 1; r < P; ++r) acc += dec[r][i];
    out[i] = acc;
  }
  return out;
}

/// Top-k reference for one step: P compressors (persisting across steps), decode each payload
/// into its own zero vector with scale 1/P, rank-ordered sum.
struct TopKReference {
  TopKReference(const TopKConfig& cfg, int64_t n, int P) {
    for (int r = 0; r < P; ++r) comps.push_back(std::make_unique<TopKCompressor>(cfg, n));
  }
  std::vector<float> step(const std::vector<std::vector<float>>& in) {
    std::vector<std::vector<float>> dec;
    for (size_t r = 0; r < comps.size(); ++r) {
      std::vector<float> g = in[r];
      Payload p;
      comps[r]->encode(TensorView::cpu(g.data(), static_cast<int64_t>(g.size())), p);
      sizes.push_back(p.size());
      std::vector<float> d(g.size(), 0.0f);
      comps[r]->decode_add(p.data(), p.size(), TensorView::cpu(d.data(), static_cast<int64_t>(d.size())),
                           1.0f / static_cast<float>(comps.size()));
      dec.push_back(std::move(d));
    }
    if (in[0].empty()) return {};
    return sum_decodes(dec);
  }
  std::vector<std::unique_ptr<TopKCompressor>> comps;
  std::vector<size_t> sizes;
};

/// Random-k reference: values summed in rank order in fp32, scattered once scaled by 1/P.
struct RandomKReference {
  RandomKReference(const RandomKConfig& cfg, int64_t n, int P) : n_(n) {
    for (int r = 0; r < P; ++r) comps.push_back(std::make_unique<RandomKCompressor>(cfg, n));
  }
  std::vector<float> step(const std::vector<std::vector<float>>& in) {
    const size_t P = comps.size();
    std::vector<float> sum;
    std::vector<uint32_t> idx;
    for (size_t r = 0; r < P; ++r) {
      std::vector<float> g = in[r];
      const int64_t s = comps[r]->step();
      Payload p;
      comps[r]->encode(TensorView::cpu(g.data(), n_), p);
      const auto k = static_cast<size_t>(p.header.count);
      const auto* v = reinterpret_cast<const float*>(p.data() + p.header.section_offset(1));
      if (r == 0) {
        sum.assign(v, v + k);
        idx.resize(k + 1);
        comps[r]->indices_at(s, idx.data());
      } else {
        for (size_t j = 0; j < k; ++j) sum[j] += v[j];
      }
    }
    std::vector<float> out(static_cast<size_t>(n_), 0.0f);
    const float scale = 1.0f / static_cast<float>(P);
    for (size_t j = 0; j < sum.size(); ++j) out[idx[j]] = 0.0f + scale * sum[j];
    return out;
  }
  int64_t n_;
  std::vector<std::unique_ptr<RandomKCompressor>> comps;
};

inline bool same_bits(const std::vector<float>& a, const float* b) {
  return a.empty() || std::memcmp(a.data(), b, a.size() * sizeof(float)) == 0;
}

inline size_t first_diff(const std::vector<float>& a, const float* b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size();
}

}  // namespace gradcomp::test
