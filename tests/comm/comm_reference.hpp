// SPDX-License-Identifier: Apache-2.0
// Independent single-process references of the comm plans (plain scalar loops plus the
// compressors applied per rank) and the deterministic per-rank inputs the comm tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/topk.hpp"
#include "plans/gradient_plan.hpp"
#include "plans/onebit_plan.hpp"
#include "plans/powersgd_plan.hpp"
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

/// Rounding to and from a 16-bit wire type (fp16 or bf16).
struct WireRound {
  bool half;
  explicit WireRound(DType wire) : half(wire == DType::kFloat16) {}
  uint16_t to(float x) const { return half ? float_to_half(x) : float_to_bf16(x); }
  float from(uint16_t x) const { return half ? half_to_float(x) : bf16_to_float(x); }
  float round(float x) const { return from(to(x)); }
};

inline std::vector<float> ref_cast(const std::vector<std::vector<float>>& in, DType wire) {
  const size_t P = in.size(), n = in[0].size();
  const WireRound w(wire);
  auto to = [&](float x) { return w.to(x); };
  auto from = [&](uint16_t x) { return w.from(x); };
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint16_t acc = to(in[0][i] / static_cast<float>(P));
    for (size_t r = 1; r < P; ++r) acc = to(from(acc) + from(to(in[r][i] / static_cast<float>(P))));
    out[i] = from(acc);
  }
  return out;
}

/// The reduce-scatter cast route: each rank's value cast to the wire type after dividing by P,
/// the P values widened to fp32 and summed in rank order, the sum rounded once.
inline std::vector<float> ref_cast_rs(const std::vector<std::vector<float>>& in, DType wire) {
  const size_t P = in.size(), n = in[0].size();
  const WireRound w(wire);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    float acc = w.round(in[0][i] / static_cast<float>(P));
    for (size_t r = 1; r < P; ++r) acc += w.round(in[r][i] / static_cast<float>(P));
    out[i] = w.round(acc);
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
      comps[r]->decode_add(p.data(), p.size(),
                           TensorView::cpu(d.data(), static_cast<int64_t>(d.size())),
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

// ---------------------------------------------------------------------------------------------
// Plans of every family behind one begin(gradient), so that the comm tests drive them alike.

/// One rank's plan for a bucket of numel() fp32 elements on `device`: begin(g) binds this step's
/// gradient g (on the plan's device); once the plan finished, result(g) points at the averaged
/// gradient (g itself for in-place plans, the plan's output buffer for the 1-bit plan).
struct RankPlan {
  virtual ~RankPlan() = default;
  virtual BucketPlan& plan() = 0;
  virtual void begin(float* g) = 0;
  virtual const float* result(const float* g) const { return g; }
  int64_t numel() { return plan().numel(); }
};

/// Any bucket plan (averages in place).
struct GradientRankPlan : RankPlan {
  explicit GradientRankPlan(std::unique_ptr<GradientPlan> p, Device dev = Device::kCPU)
      : p_(std::move(p)), dev_(dev) {}
  BucketPlan& plan() override { return *p_; }
  void begin(float* g) override { p_->begin(TensorView(g, {p_->numel()}, DType::kFloat32, dev_)); }
  std::unique_ptr<GradientPlan> p_;
  Device dev_;
};

/// The 1-bit two-phase plan (writes the average into its own output buffer).
struct OneBitRankPlan : RankPlan {
  OneBitRankPlan(const OneBitConfig& cfg, int64_t n, int world, int rank, Device dev = Device::kCPU)
      : p_(cfg, n, world, rank, dev), out_(dev), dev_(dev), n_(n) {
    out_.get<float>(static_cast<size_t>(std::max<int64_t>(n, 1)));
  }
  BucketPlan& plan() override { return p_; }
  void begin(float* g) override {
    p_.begin(TensorView(g, {n_}, DType::kFloat32, dev_),
             TensorView(out_.data(), {n_}, DType::kFloat32, dev_));
  }
  const float* result(const float*) const override {
    return static_cast<const float*>(out_.data());
  }
  OneBitAllreducePlan p_;
  Buffer out_;
  Device dev_;
  int64_t n_;
};

/// PowerSGD over a bucket of tensors laid out back to back in one fp32 buffer (in place).
struct PowerSGDRankPlan : RankPlan {
  PowerSGDRankPlan(const PowerSGDConfig& cfg, const std::vector<std::vector<int64_t>>& shapes,
                   int world, Device dev = Device::kCPU)
      : shapes_(shapes), st_(cfg, shapes, DType::kFloat32, dev), p_(st_, world), dev_(dev) {}
  BucketPlan& plan() override { return p_; }
  void begin(float* g) override {
    std::vector<TensorView> views;
    int64_t off = 0;
    for (const auto& s : shapes_) {
      views.emplace_back(g + off, s.data(), static_cast<int>(s.size()), DType::kFloat32, dev_);
      off += views.back().numel;
    }
    p_.begin(views);
  }
  std::vector<std::vector<int64_t>> shapes_;
  PowerSGDState st_;
  PowerSGDPlan p_;
  Device dev_;
};

inline int64_t bucket_numel(const std::vector<std::vector<int64_t>>& shapes) {
  int64_t total = 0;
  for (const auto& s : shapes) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    total += n;
  }
  return total;
}

/// PowerSGD test buckets: empty, one element, too small to compress, and mixed buckets (conv
/// weights, biases, a group of equal matrices, a matrix that fails the rate test).
inline std::vector<std::vector<std::vector<int64_t>>> powersgd_layouts() {
  return {
      {{0}},
      {{1}},
      {{1, 1}, {4}},
      {{32, 24}, {232}},
      {{64, 3, 7, 7}, {64}, {64}, {48, 64}, {48, 64}, {256, 64, 1, 1}, {256}, {6, 5}, {1000, 40}},
  };
}

/// Scalar reference of the first step of the 1-bit plan (no error carried in): per server chunk
/// of 32 W elements, worker signs scaled by the chunk's L2 scale sqrt(mean x^2), averaged over
/// ranks, then the server's signs scaled by the average's L2 scale.
inline std::vector<float> ref_onebit_first_step(const std::vector<std::vector<float>>& g) {
  const int64_t P = static_cast<int64_t>(g.size()), n = static_cast<int64_t>(g[0].size());
  const int64_t W = ((n + 31) / 32 + P - 1) / P, CE = 32 * W;
  auto l2 = [](const std::vector<double>& x, int64_t b, int64_t e) {
    double a = 0;
    for (int64_t i = b; i < e; ++i) a += x[i] * x[i];
    return std::sqrt(a / static_cast<double>(e - b));
  };
  std::vector<double> avg(static_cast<size_t>(n), 0.0), out(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; b += CE) {
    const int64_t e = std::min(n, b + CE);
    for (int64_t p = 0; p < P; ++p) {
      std::vector<double> x(g[p].begin(), g[p].end());
      const double sc = l2(x, b, e);
      for (int64_t i = b; i < e; ++i) avg[i] += (x[i] >= 0 ? sc : -sc) / static_cast<double>(P);
    }
    const double sc = l2(avg, b, e);
    for (int64_t i = b; i < e; ++i) out[i] = avg[i] >= 0 ? sc : -sc;
  }
  return std::vector<float>(out.begin(), out.end());
}

inline bool same_bits(const std::vector<float>& a, const float* b) {
  return a.empty() || std::memcmp(a.data(), b, a.size() * sizeof(float)) == 0;
}

inline size_t first_diff(const std::vector<float>& a, const float* b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
  return a.size();
}

}  // namespace gradcomp::test
