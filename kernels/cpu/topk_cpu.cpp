// SPDX-License-Identifier: Apache-2.0
// CPU backend of the top-k family: radix select on the magnitude bits (histogram passes over
// 11-bit digits, then one gather pass), DGC sampled-threshold selection, and the element-wise
// DGC kernels. Multithreaded with OpenMP; each thread owns a contiguous chunk, so outputs are
// produced in ascending index order without sorting.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/pinned.hpp"
#include "kernels/topk_kernels.hpp"
#include "kernels/topk_math.h"

namespace gradcomp::kernels {

SelectWorkspace::~SelectWorkspace() { free_pinned_slot(pinned); }

namespace cpu {
namespace {

constexpr int kDigitBits[3] = {11, 11, 9};  // 31 magnitude bits: [30:20], [19:9], [8:0]
constexpr int kShiftAfter[3] = {20, 9, 0};  // bits below the digit after each level
constexpr int64_t kSampleBlock = 16;        // contiguous elements per sample position

/// Chunk [begin, end) of thread t of T over n elements.
inline void chunk(int64_t n, int t, int T, int64_t* b, int64_t* e) {
  *b = n * t / T;
  *e = n * (t + 1) / T;
}

inline int threads_for(int64_t n) {
  const int64_t per = 1 << 16;  // below ~64K elements per thread, threads cost more than they save
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), n / per)));
}

std::vector<uint32_t>& tls_scratch() {
  static thread_local std::vector<uint32_t> v;  // grow-only, reused across calls
  return v;
}

/// The r-th largest (1-based) of m keys (magnitude bits). One 2048-bin histogram pass on the top
/// 11 bits, then std::nth_element only among the members of the bucket that holds rank r: a few
/// times faster than nth_element over all keys when r << m. Reorders nothing in `keys`.
uint32_t kth_largest(const uint32_t* keys, int64_t m, int64_t r, std::vector<uint32_t>& scratch) {
  uint32_t hist[2048] = {};
  for (int64_t i = 0; i < m; ++i) ++hist[keys[i] >> 20];
  int64_t acc = 0;
  uint32_t d = 2048;
  while (d > 0) {
    --d;
    if (acc + hist[d] >= r) break;
    acc += hist[d];
  }
  scratch.clear();
  for (int64_t i = 0; i < m; ++i)
    if ((keys[i] >> 20) == d) scratch.push_back(keys[i]);
  const int64_t rr = r - acc;  // rank inside the bucket, 1-based
  std::nth_element(scratch.begin(), scratch.begin() + (rr - 1), scratch.end(),
                   std::greater<uint32_t>());
  return scratch[rr - 1];
}

/// Among the candidate indices `cand` (ascending), chooses exactly `need` by |x| (ties by lowest
/// index) and writes them ascending to out. Returns need.
int64_t exact_among(const float* x, const uint32_t* cand, int64_t m, int64_t need, uint32_t* out,
                    std::vector<uint32_t>& keys) {
  if (need <= 0) return 0;
  if (need >= m) {
    std::copy(cand, cand + m, out);
    return m;
  }
  keys.resize(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) keys[i] = abs_bits(x[cand[i]]);
  std::vector<uint32_t>& scratch = tls_scratch();
  const uint32_t thr = kth_largest(keys.data(), m, need, scratch);
  int64_t above = 0;
  for (int64_t i = 0; i < m; ++i) above += abs_bits(x[cand[i]]) > thr;
  int64_t ties = need - above, c = 0;
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t b = abs_bits(x[cand[i]]);
    if (b > thr || (b == thr && ties-- > 0)) out[c++] = cand[i];
  }
  return c;
}

void ensure_threads(SelectWorkspace& ws, int T) {
  if (static_cast<int>(ws.local_sel.size()) < T) {
    ws.local_sel.resize(T);
    ws.local_cand.resize(T);
  }
}

/// Concatenates per-thread lists in thread order (keeps ascending order). Returns the count.
int64_t concat(std::vector<std::vector<uint32_t>>& lists, int T, uint32_t* out) {
  int64_t c = 0;
  for (int t = 0; t < T; ++t) {
    std::copy(lists[t].begin(), lists[t].end(), out + c);
    c += static_cast<int64_t>(lists[t].size());
  }
  return c;
}

/// Calls visit(i) for the indices of [b, e) in ascending order, skipping every block of 32 whose
/// largest magnitude bits are below `lowest` (none of its elements can qualify). The block's
/// largest magnitude comes first (a vectorised max over the bits) and the scalar path only for
/// the rare blocks that hold a candidate: this keeps a pass near the speed of a plain read (a max
/// reduction vectorises; an OR of compares did not). The radix select and compact_ge share it.
template <class Visit>
inline void visit_blocks_reaching(const float* x, int64_t b, int64_t e, uint32_t lowest,
                                  Visit&& visit) {
  constexpr int kBlock = 32;
  int64_t i = b;
  for (; i + kBlock <= e; i += kBlock) {
    uint32_t bits[kBlock];
    std::memcpy(bits, x + i, sizeof bits);
    uint32_t mx = 0;
    for (int j = 0; j < kBlock; ++j) mx = std::max(mx, bits[j] & 0x7fffffffu);
    if (__builtin_expect(mx >= lowest, 0))
      for (int j = 0; j < kBlock; ++j) visit(i + j);
  }
  for (; i < e; ++i) visit(i);
}

int64_t exact_select(const float* x, int64_t n, int64_t k, uint32_t* out, SelectWorkspace& ws) {
  const int T = threads_for(n);
  ensure_threads(ws, T);
  uint32_t prefix = 0;  // known high bits of the k-th largest magnitude
  int shift = 31;       // bits below the known prefix
  int64_t need = k;     // elements still to take from the bucket `prefix`
  int64_t in_bucket = n;
  const int64_t cap = std::max<int64_t>(4 * k, int64_t{1} << 16);
  std::vector<uint32_t> hist(2048);
  for (int level = 0; level < 3 && in_bucket > cap; ++level) {
    const int dbits = kDigitBits[level];
    const int nshift = kShiftAfter[level];
    const uint32_t nb = 1u << dbits;
    std::fill(hist.begin(), hist.begin() + nb, 0u);
#pragma omp parallel num_threads(T)
    {
      uint32_t local[2048] = {};
      int64_t b, e;
      chunk(n, omp_get_thread_num(), T, &b, &e);
      if (level == 0) {
        for (int64_t i = b; i < e; ++i) ++local[abs_bits(x[i]) >> nshift];
      } else {
        for (int64_t i = b; i < e; ++i) {
          const uint32_t a = abs_bits(x[i]);
          if ((a >> shift) == prefix) ++local[(a >> nshift) & (nb - 1)];
        }
      }
#pragma omp critical
      for (uint32_t d = 0; d < nb; ++d) hist[d] += local[d];
    }
    // walk digits from the top until `need` is reached
    int64_t acc = 0;
    uint32_t d = nb;
    while (d > 0) {
      --d;
      if (acc + hist[d] >= need) break;
      acc += hist[d];
    }
    need -= acc;
    in_bucket = hist[d];
    prefix = (prefix << dbits) | d;
    shift = nshift;
  }
  // Gather pass: everything above the bucket is selected; the bucket's members are candidates.
#pragma omp parallel num_threads(T)
  {
    const int t = omp_get_thread_num();
    auto& sel = ws.local_sel[t];
    auto& cand = ws.local_cand[t];
    sel.clear();
    cand.clear();
    int64_t b, e;
    chunk(n, t, T, &b, &e);
    if (shift == 31) {  // no histogram pass was needed: all elements are candidates
      for (int64_t i = b; i < e; ++i) cand.push_back(static_cast<uint32_t>(i));
    } else {
      auto visit = [&](int64_t i) {
        const uint32_t hi = abs_bits(x[i]) >> shift;
        if (hi >= prefix) {
          if (hi > prefix)
            sel.push_back(static_cast<uint32_t>(i));
          else if (shift > 0 || static_cast<int64_t>(cand.size()) < need)
            cand.push_back(static_cast<uint32_t>(i));  // with shift 0 all are ties: keep `need`
        }
      };
      // a vectorised block maximum skips the blocks with nothing to keep, as in compact_ge
      const uint32_t lowest = prefix << shift;  // smallest magnitude bits in the bucket
      visit_blocks_reaching(x, b, e, lowest, visit);
    }
  }
  // sel and candidates are each ascending; merge the chosen candidates into the output
  uint32_t* tmp_sel = ws.a.get<uint32_t>(static_cast<size_t>(k));
  const int64_t nsel = concat(ws.local_sel, T, tmp_sel);
  int64_t ncand = 0;
  for (int t = 0; t < T; ++t) ncand += static_cast<int64_t>(ws.local_cand[t].size());
  uint32_t* cand_all = ws.b.get<uint32_t>(static_cast<size_t>(ncand) + 1);
  concat(ws.local_cand, T, cand_all);
  uint32_t* chosen = ws.c.get<uint32_t>(static_cast<size_t>(k) + 1);
  const int64_t nch = exact_among(x, cand_all, ncand, k - nsel, chosen, ws.host_bits);
  GC_CHECK(nsel + nch == k, "radix select produced ", nsel + nch, " of ", k);
  std::merge(tmp_sel, tmp_sel + nsel, chosen, chosen + nch, out);
  return k;
}

/// One compaction pass: indices with |x| >= thr, per thread, keeping at most `cap` in total
/// (each thread stops storing past cap but keeps counting). Returns the total count.
int64_t compact_ge(const float* x, int64_t n, uint32_t thr, int64_t cap, int T,
                   SelectWorkspace& ws) {
  int64_t total = 0;
#pragma omp parallel num_threads(T) reduction(+ : total)
  {
    const int t = omp_get_thread_num();
    auto& sel = ws.local_sel[t];
    sel.clear();
    int64_t b, e, cnt = 0;
    chunk(n, t, T, &b, &e);
    auto visit = [&](int64_t i) {
      if (abs_bits(x[i]) >= thr) {
        if (cnt < cap) sel.push_back(static_cast<uint32_t>(i));
        ++cnt;
      }
    };
    visit_blocks_reaching(x, b, e, thr, visit);
    total = cnt;
  }
  return total;
}

int64_t sampled_select(const float* x, int64_t n, int64_t k, const SelectOptions& opt,
                       const RngKey& key, uint32_t* out, SelectWorkspace& ws) {
  const int64_t s = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(opt.sample_rate * n)));
  // Too small a tensor (or sample) for a threshold estimate to pay off: be exact.
  if (n < 4096 || s < 64 || 2 * s > n) return exact_select(x, n, k, out, ws);
  // The sample is kSampleBlock-element runs (one cache line each) at a constant stride from a
  // random offset: the same number of samples for 1/16 of the cache lines of single elements.
  const int64_t blocks = (s + kSampleBlock - 1) / kSampleBlock;
  const int64_t stride = n / blocks;  // >= 2 * kSampleBlock since 2 s <= n
  const int64_t offset =
      static_cast<int64_t>(key.below(0, static_cast<uint64_t>(stride - kSampleBlock + 1)));
  auto& sample = ws.host_bits;
  sample.resize(static_cast<size_t>(blocks * kSampleBlock));
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t q = 0; q < kSampleBlock; ++q)
      sample[j * kSampleBlock + q] = abs_bits(x[offset + j * stride + q]);
  const int64_t s_used = blocks * kSampleBlock;
  // the rank in the sample that should give oversample * k candidates in the tensor
  double want = opt.oversample * static_cast<double>(k);
  const int T = threads_for(n);
  ensure_threads(ws, T);
  const int64_t min_ok = static_cast<int64_t>(std::ceil(opt.min_fraction * static_cast<double>(k)));
  const int64_t cap = std::max<int64_t>(2 * k, static_cast<int64_t>(opt.oversample * 2 * k)) + 64;
  for (int attempt = 0; attempt <= opt.max_retries; ++attempt) {
    int64_t r = static_cast<int64_t>(
        std::ceil(want * static_cast<double>(s_used) / static_cast<double>(n)));
    if (r > s_used) break;  // the sample cannot place a threshold that low: be exact
    r = std::max<int64_t>(r, 1);
    const uint32_t thr = kth_largest(sample.data(), s_used, r, tls_scratch());
    const int64_t count = compact_ge(x, n, thr, cap, T, ws);
    if (count > cap) break;  // heavy ties (e.g. constant input): exact selection handles them
    uint32_t* cand = ws.b.get<uint32_t>(static_cast<size_t>(count) + 1);
    concat(ws.local_sel, T, cand);
    if (count >= k) {
      // the sample is reused for the next attempt only if this one fails; nothing else to undo
      return exact_among(x, cand, count, k, out, ws.host_bits);
    }
    if (count >= min_ok) {
      std::copy(cand, cand + count, out);
      return count;
    }
    // too few: aim lower, in proportion to the shortfall
    want *= 1.5 * static_cast<double>(k) / static_cast<double>(std::max<int64_t>(count, 1));
  }
  return exact_select(x, n, k, out, ws);
}

/// The raw-bit non-finite test per storage type: x is NaN or +-Inf iff (bits & mask) > max_finite
/// (the largest finite magnitude's bits), a compare the compiler vectorizes.
template <class Load>
struct NonFiniteBits;
template <>
struct NonFiniteBits<F32Load> {
  using T = uint32_t;
  using S = int32_t;  // masked bits are below 2^31: a signed compare is exact (SSE2 has one)
  static constexpr T mask = 0x7fffffffu, max_finite = 0x7f7fffffu;
};
template <>
struct NonFiniteBits<F16Load> {
  using T = uint16_t;
  using S = int16_t;
  static constexpr T mask = 0x7fff, max_finite = 0x7bff;
};
template <>
struct NonFiniteBits<BF16Load> {
  using T = uint16_t;
  using S = int16_t;
  static constexpr T mask = 0x7fff, max_finite = 0x7f7f;
};

template <class Load>
int64_t first_nonfinite_t(const void* g, int64_t n) {
  using B = NonFiniteBits<Load>;
  using T = typename B::T;
  using S = typename B::S;
  const T* x = static_cast<const T*>(g);
  // Blocks of kBlock elements are OR-reduced without a branch (vectorized); only a block that
  // holds a non-finite value is searched element by element for the first one.
  constexpr int64_t kBlock = 2048;
  const int T_ = threads_for(n);
  int64_t best = n;
#pragma omp parallel num_threads(T_) reduction(min : best)
  {
    int64_t b, e;
    chunk(n, omp_get_thread_num(), T_, &b, &e);
    for (int64_t i = b; i < e; i += kBlock) {
      const int64_t stop = std::min(e, i + kBlock);
      int any = 0;
      for (int64_t j = i; j < stop; ++j)
        any |= static_cast<S>(x[j] & B::mask) > static_cast<S>(B::max_finite);
      if (any == 0) continue;
      for (int64_t j = i; j < stop; ++j)
        if (static_cast<S>(x[j] & B::mask) > static_cast<S>(B::max_finite)) {
          best = j;
          break;
        }
      break;
    }
  }
  return best == n ? -1 : best;
}

template <class Load>
double sum_squares_t(const void* g, int64_t n) {
  const int T = threads_for(n);
  double acc = 0.0;
#pragma omp parallel for num_threads(T) reduction(+ : acc) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double v = Load::load(g, i);
    acc += v * v;
  }
  return acc;
}

template <class Load>
void dgc_accumulate_t(const void* g, int64_t n, float coef, float m, bool nesterov, float* u,
                      float* v, const float* us, const float* vs) {
  const int T = threads_for(n);
  if (u == nullptr) {
#pragma omp parallel for num_threads(T) schedule(static)
    for (int64_t i = 0; i < n; ++i) v[i] = dgc_residual(vs[i], coef * Load::load(g, i));
    return;
  }
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float uu = us[i], vv = vs[i];
    dgc_update(coef * Load::load(g, i), m, nesterov, uu, vv);
    u[i] = uu;
    v[i] = vv;
  }
}

/// Stores v (value_to_send, or with a share's divisor and limit value_share) as value j in the
/// value dtype; returns what a receiver decodes from it.
inline float store_value(void* values, DType vt, int64_t j, float v,
                         const ValueShare* share = nullptr) {
  const float x = share ? value_share(v, share->divisor, share->limit) : value_to_send(v, vt);
  switch (vt) {
    case DType::kFloat32:
      static_cast<float*>(values)[j] = x;
      return x;
    case DType::kFloat16: {
      const uint16_t h = float_to_half(x);
      static_cast<uint16_t*>(values)[j] = h;
      return half_to_float(h);
    }
    case DType::kBFloat16: {
      const uint16_t h = float_to_bf16(x);
      static_cast<uint16_t*>(values)[j] = h;
      return bf16_to_float(h);
    }
  }
  return x;
}

}  // namespace

int64_t select(const float* x, int64_t n, int64_t k, const SelectOptions& opt, const RngKey& key,
               uint32_t* out, SelectWorkspace& ws) {
  if (k <= 0 || n == 0) return 0;
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(i);
    return n;
  }
  if (opt.method == SelectMethod::kExact) return exact_select(x, n, k, out, ws);
  return sampled_select(x, n, k, opt, key, out, ws);
}

int64_t first_nonfinite(const void* g, DType t, int64_t n) {
  int64_t r = -1;
  with_loader(t, [&](auto L) { r = first_nonfinite_t<decltype(L)>(g, n); });
  return r;
}

double sum_squares(const void* g, DType t, int64_t n) {
  double r = 0;
  with_loader(t, [&](auto L) { r = sum_squares_t<decltype(L)>(g, n); });
  return r;
}

void dgc_accumulate(const void* g, DType t, int64_t n, float coef, float momentum, bool nesterov,
                    float* u, float* v, const float* u_src, const float* v_src) {
  const float* us = u_src ? u_src : u;
  const float* vs = v_src ? v_src : v;
  with_loader(t, [&](auto L) {
    dgc_accumulate_t<decltype(L)>(g, n, coef, momentum, nesterov, u, v, us, vs);
  });
}

void gather_and_clear(float* v, float* u, const uint32_t* idx, int64_t k, void* values, DType vt,
                      const ValueShare* share) {
  const float divisor = share ? share->divisor : 1.0f;
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t i = idx[j];
    v[i] = residual_after_send(v[i], store_value(values, vt, j, v[i], share), divisor);
    if (u) u[i] = 0.0f;
  }
}

void gather(const float* v, const uint32_t* idx, int64_t k, void* values, DType vt) {
  for (int64_t j = 0; j < k; ++j) store_value(values, vt, j, plus_zero(v[idx[j]]));
}

void randomk_indices(int64_t n, int64_t k, const RngKey& key, uint32_t* out, const uint32_t* ranges,
                     int64_t nr) {
  const int T = threads_for(k * 16);
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t j = 0; j < k; ++j)
    out[j] = randomk_position(static_cast<uint64_t>(j), static_cast<uint64_t>(k),
                              static_cast<uint64_t>(n), key, ranges, nr);
}

void scatter_add(const uint32_t* idx, const void* values, DType vt, int64_t k, float scale,
                 float* dense) {
  with_loader(vt, [&](auto L) {
    using Load = decltype(L);
    for (int64_t j = 0; j < k; ++j) dense[idx[j]] += scale * Load::load(values, j);
  });
}

}  // namespace cpu
}  // namespace gradcomp::kernels
