// SPDX-License-Identifier: Apache-2.0
// PowerSGD on the CPU: OpenMP element-wise passes, BLAS GEMMs (a loop over the members of a batch
// group), the fused modified Gram-Schmidt and LAPACKE Householder QR.
#include <cblas.h>
#include <lapacke.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/powersgd_kernels.hpp"
#include "kernels/powersgd_math.h"

namespace gradcomp::kernels::cpu {

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per thread below which a pass stays serial
constexpr int kMaxThreads = 64;
// OpenBLAS runs a GEMM with m * n * k <= 65536 * GEMM_MULTITHREAD_THRESHOLD (4 by default) on the
// calling thread. The fused tiles stay under that, so inside an OpenMP loop every sgemm is serial
// and OpenBLAS's own thread pool is never woken to compete with the OpenMP threads for the cores.
constexpr int64_t kBlasSerialMnk = 65536 * 4;
// A tile is at most this many floats (256 KiB): it stays in L2 between the GEMM and the
// element-wise work on it.
constexpr int64_t kTileFloats = 1 << 16;

int threads_for(int64_t work) {
  const int64_t t = std::min<int64_t>(omp_get_max_threads(), std::max<int64_t>(1, work / kGrain));
  return static_cast<int>(std::min<int64_t>(t, kMaxThreads));
}

// One fused MGS pass over rows [b, e) of A: finish column j-1 (if j > 0), accumulate sums of j.
template <int R, bool Full, bool Update, bool First>
void mgs_rows(float* A, int64_t b, int64_t e, int r, int j, const float* scale, const float* coef,
              float (&acc)[2 * R]) {
  for (int64_t i = b; i < e; ++i) {
    float* row = A + i * r;
    float v[R];
    PSGD_UNROLL
    for (int k = 0; k < R; ++k) v[k] = (Full || k < r) ? row[k] : 0.0f;
    if (Update) {
      psgd_mgs_update_row<R>(v, j - 1, scale, coef);
      PSGD_UNROLL
      for (int k = 0; k < R; ++k)
        if (Full || k < r) row[k] = v[k];
    }
    if (j < r) psgd_mgs_accumulate_row<R, First>(v, j, acc);
  }
}

template <int R>
void mgs_pass_rows(float* A, int64_t b, int64_t e, int r, int j, const float* scale,
                   const float* coef, float (&acc)[2 * R]) {
  for (int k = 0; k < 2 * R; ++k) acc[k] = 0.0f;
  const bool full = r == R;
  if (j == 0) {
    if (full)
      mgs_rows<R, true, false, true>(A, b, e, r, j, scale, coef, acc);
    else
      mgs_rows<R, false, false, true>(A, b, e, r, j, scale, coef, acc);
  } else {
    if (full)
      mgs_rows<R, true, true, false>(A, b, e, r, j, scale, coef, acc);
    else
      mgs_rows<R, false, true, false>(A, b, e, r, j, scale, coef, acc);
  }
}

}  // namespace

void prescale(float* A, int64_t len, float eps) {
  float mx = 0.0f;
  for (int64_t i = 0; i < len; ++i) mx = std::max(mx, std::fabs(A[i]));
  const int k = psgd_prescale_exponent(mx, eps);
  if (k != 0)
    for (int64_t i = 0; i < len; ++i) A[i] = std::ldexp(A[i], k);
}

void prescale_blocks(float* X, int64_t batch, int64_t len, float eps) {
  if (eps > 0.0f) return;
  for (int64_t b = 0; b < batch; ++b) prescale(X + b * len, len, eps);
}

namespace {

template <int R>
void mgs_serial(float* A, int64_t n, int r, float eps) {
  prescale(A, n * r, eps);
  float orig[R] = {}, scale[R] = {}, coef[R] = {}, acc[2 * R];
  for (int j = 0; j <= r; ++j) {
    mgs_pass_rows<R>(A, 0, n, r, j, scale, coef, acc);
    if (j == 0)
      for (int k = 0; k < r; ++k) orig[k] = acc[R + k];
    if (j < r) psgd_mgs_coefficients<R>(acc, orig, r, j, eps, scale, coef);
  }
}

template <int R>
void mgs_parallel(float* A, int64_t n, int r, float eps, int T) {
  prescale(A, n * r, eps);
  float partial[kMaxThreads][2 * R];
  float orig[R] = {}, scale[R] = {}, coef[R] = {};
#pragma omp parallel num_threads(T)
  {
    const int t = omp_get_thread_num();
    const int64_t b = n * t / T, e = n * (t + 1) / T;
    for (int j = 0; j <= r; ++j) {
      mgs_pass_rows<R>(A, b, e, r, j, scale, coef, partial[t]);
#pragma omp barrier
#pragma omp single
      {
        float s[2 * R] = {};
        for (int u = 0; u < T; ++u)  // fixed order: deterministic for a given thread count
          for (int k = 0; k < 2 * R; ++k) s[k] += partial[u][k];
        if (j == 0)
          for (int k = 0; k < r; ++k) orig[k] = s[R + k];
        if (j < r) psgd_mgs_coefficients<R>(s, orig, r, j, eps, scale, coef);
      }  // implicit barrier
    }
  }
}

template <int R>
void mgs_batch(float* P, int64_t batch, int64_t n, int r, float eps) {
  const int T = threads_for(n * r);
  if (T > 1 && batch < T) {
    for (int64_t b = 0; b < batch; ++b) mgs_parallel<R>(P + b * n * r, n, r, eps, T);
    return;
  }
  const int TB = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), batch));
#pragma omp parallel for num_threads(TB) schedule(static) if (TB > 1 && batch * n * r > kGrain)
  for (int64_t b = 0; b < batch; ++b) mgs_serial<R>(P + b * n * r, n, r, eps);
}

// PyTorch's column-by-column Gram-Schmidt: norm, scale, then a dot and an axpy per later column,
// each a separate strided pass (the benchmark baseline). Zero columns stay zero.
void mgs_unfused(float* A, int64_t n, int r, float eps) {
  prescale(A, n * r, eps);
  for (int i = 0; i < r; ++i) {
    float* col = A + i;
    const float nrm = cblas_snrm2(static_cast<int>(n), col, r);
    cblas_sscal(static_cast<int>(n), nrm > 0.0f ? 1.0f / (nrm + eps) : 0.0f, col, r);
    for (int k = i + 1; k < r; ++k) {
      const float d = cblas_sdot(static_cast<int>(n), col, r, A + k, r);
      cblas_saxpy(static_cast<int>(n), -d, col, r, A + k, r);
    }
  }
}

void householder(float* P, int64_t batch, int64_t n, int r, PsgdContext& ctx) {
  const lapack_int N = static_cast<lapack_int>(n), K = r;
  float query = 0.0f, query2 = 0.0f;
  std::vector<float>& w = ctx.host_work;
  if (w.size() < 1) w.resize(1);
  GC_CHECK(LAPACKE_sgeqrf_work(LAPACK_COL_MAJOR, N, K, w.data(), N, w.data(), &query, -1) == 0);
  GC_CHECK(LAPACKE_sorgqr_work(LAPACK_COL_MAJOR, N, K, K, w.data(), N, w.data(), &query2, -1) == 0);
  const size_t lwork = static_cast<size_t>(std::max(query, query2)) + 1;
  const size_t need = static_cast<size_t>(n) * r + r + lwork;
  if (w.size() < need) w.resize(need);
  float* a = w.data();
  float* tau = a + n * r;
  float* work = tau + r;
  for (int64_t b = 0; b < batch; ++b) {
    float* A = P + b * n * r;
    for (int64_t i = 0; i < n; ++i)
      for (int k = 0; k < r; ++k) a[k * n + i] = A[i * r + k];
    lapack_int info = LAPACKE_sgeqrf_work(LAPACK_COL_MAJOR, N, K, a, N, tau, work,
                                          static_cast<lapack_int>(lwork));
    if (info != 0) throw BackendError(detail::cat("LAPACKE_sgeqrf failed with info ", info));
    info = LAPACKE_sorgqr_work(LAPACK_COL_MAJOR, N, K, K, a, N, tau, work,
                               static_cast<lapack_int>(lwork));
    if (info != 0) throw BackendError(detail::cat("LAPACKE_sorgqr failed with info ", info));
    for (int64_t i = 0; i < n; ++i)
      for (int k = 0; k < r; ++k) A[i * r + k] = a[k * n + i];
  }
}

// Rows of M per tile: the tile's GEMM (rows x m x r) stays serial in OpenBLAS and in cache.
int64_t tile_rows(int64_t n, int64_t m, int r) {
  const int64_t per_tile = std::min<int64_t>(kTileFloats, kBlasSerialMnk / std::max(1, r));
  return std::clamp<int64_t>(per_tile / std::max<int64_t>(1, m), 1, std::max<int64_t>(1, n));
}

// Largest tile (floats) over the groups.
int64_t max_tile_floats(const std::vector<PsgdGroup>& groups) {
  int64_t tile_max = 0;
  for (const auto& g : groups)
    if (g.n > 0 && g.m > 0) tile_max = std::max(tile_max, tile_rows(g.n, g.m, g.r) * g.m);
  return tile_max;
}

float* tile_scratch(PsgdContext& ctx, size_t floats) {
  if (ctx.host_tiles.size() < floats) ctx.host_tiles.resize(floats);  // grows once, then reused
  return ctx.host_tiles.data();
}

}  // namespace

void load(const void* g, DType t, int64_t n, float* dst, bool add) {
  with_loader(t, [&](auto L) {
    using Ld = decltype(L);
    if (add) {
#pragma omp parallel for num_threads(threads_for(n)) schedule(static)
      for (int64_t i = 0; i < n; ++i) dst[i] += Ld::load(g, i);
    } else {
#pragma omp parallel for num_threads(threads_for(n)) schedule(static)
      for (int64_t i = 0; i < n; ++i) dst[i] = Ld::load(g, i);
    }
  });
}

void divide(float* x, int64_t n, float world) {
  if (world == 1.0f) return;  // x / 1 == x exactly
#pragma omp parallel for num_threads(threads_for(n)) schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = psgd_mean(x[i], world);
}

void store_mean(const float* src, int64_t n, float world, void* g, DType t) {
#pragma omp parallel for num_threads(threads_for(n)) schedule(static)
  for (int64_t i = 0; i < n; ++i) psgd_store(g, i, t, psgd_mean(src[i], world));
}

void store_result(const float* r, void* g, DType t, int64_t n, float* m_err) {
  const bool same = static_cast<const void*>(r) == g;
  if (t == DType::kFloat32) {
    float* gf = static_cast<float*>(g);
    if (m_err) {
#pragma omp parallel for num_threads(threads_for(n)) schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        const float v = r[i];
        if (!same) gf[i] = v;
        m_err[i] -= v;
      }
    } else if (!same) {
      std::memcpy(gf, r, static_cast<size_t>(n) * sizeof(float));
    }
    return;
  }
#pragma omp parallel for num_threads(threads_for(n)) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    psgd_store(g, i, t, r[i]);
    if (m_err) m_err[i] -= psgd_load(g, i, t);  // the error keeps the rounding of the store too
  }
}

void fill_q(const PsgdGroup& g, uint64_t seed, uint64_t step, bool only_zero_columns) {
  for (int64_t b = 0; b < g.batch; ++b) {
    float* Q = g.Q + b * g.m * g.r;
    const RngKey key{seed, step, g.ids[b]};
    for (int c = 0; c < g.r; ++c) {
      if (only_zero_columns) {
        bool zero = true;
        for (int64_t i = 0; i < g.m && zero; ++i) zero = Q[i * g.r + c] == 0.0f;
        if (!zero) continue;
      }
      for (int64_t i = 0; i < g.m; ++i)
        Q[i * g.r + c] = psgd_q_value(key, static_cast<uint64_t>(i * g.r + c));
    }
  }
}

void compute_p(const PsgdGroup& g, PsgdContext&) {
  for (int64_t b = 0; b < g.batch; ++b)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(g.n), g.r,
                static_cast<int>(g.m), 1.0f, g.M + b * g.n * g.m, static_cast<int>(g.m),
                g.Q + b * g.m * g.r, g.r, 0.0f, g.P + b * g.n * g.r, g.r);
}

void compute_q(const PsgdGroup& g, PsgdContext&) {
  for (int64_t b = 0; b < g.batch; ++b)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(g.m), g.r,
                static_cast<int>(g.n), 1.0f, g.M + b * g.n * g.m, static_cast<int>(g.m),
                g.P + b * g.n * g.r, g.r, 0.0f, g.Q + b * g.m * g.r, g.r);
}

void reconstruct(const PsgdGroup& g, int64_t b, float* out, PsgdContext&) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(g.n), static_cast<int>(g.m),
              g.r, 1.0f, g.P + b * g.n * g.r, g.r, g.Q + b * g.m * g.r, g.r, 0.0f, out,
              static_cast<int>(g.m));
}

namespace {

// Work items of a fused phase: (group, member, first row, rows), packed as 4 int64 in
// ctx.host_items (grown once, then reused). rows_of(group) gives the item height.
template <class RowsOf>
int64_t build_items(const std::vector<PsgdGroup>& groups, PsgdContext& ctx, RowsOf rows_of,
                    int64_t* work) {
  auto& v = ctx.host_items;
  v.clear();  // keeps the capacity: no allocation after the first step
  *work = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const PsgdGroup& g = groups[gi];
    if (g.n == 0 || g.m == 0) continue;
    const int64_t rows = rows_of(g);
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t i0 = 0; i0 < g.n; i0 += rows) {
        v.push_back(static_cast<int64_t>(gi));
        v.push_back(b);
        v.push_back(i0);
        v.push_back(std::min(rows, g.n - i0));
      }
    *work += g.batch * g.n * g.m;
  }
  return static_cast<int64_t>(v.size() / 4);
}

int fused_threads(int64_t work) {
  return work >= 2 * kGrain ? std::min(omp_get_max_threads(), kMaxThreads) : 1;
}

// Rows of a Q chunk: whole tiles, about kQChunkFloats elements of M.
constexpr int64_t kQChunkFloats = int64_t{1} << 20;
int64_t chunk_rows(const PsgdGroup& g) {
  const int64_t t = tile_rows(g.n, g.m, g.r);
  return t * std::max<int64_t>(1, kQChunkFloats / std::max<int64_t>(1, t * g.m));
}

}  // namespace

void compress_p(const std::vector<PsgdGroup>& groups, const std::vector<std::vector<void*>>& grads,
                DType t, bool add, bool direct, PsgdContext& ctx) {
  int64_t work = 0;
  const int64_t count = build_items(
      groups, ctx, [](const PsgdGroup& g) { return tile_rows(g.n, g.m, g.r); }, &work);
  const int64_t* items = ctx.host_items.data();
  const int T = fused_threads(work);
  const int64_t tile_max = add && !direct ? max_tile_floats(groups) : 0;
  float* scratch = tile_max
                       ? tile_scratch(ctx, static_cast<size_t>(T) * static_cast<size_t>(tile_max))
                       : nullptr;
  with_loader(t, [&](auto L) {
    using Ld = decltype(L);
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
    for (int64_t w = 0; w < count; ++w) {
      const PsgdGroup& g = groups[items[4 * w]];
      const int64_t b = items[4 * w + 1], i0 = items[4 * w + 2], h = items[4 * w + 3];
      const int64_t off = i0 * g.m, len = h * g.m;
      const void* src = grads[items[4 * w]][b];
      const float* A;
      if (direct) {
        A = static_cast<const float*>(src) + off;
      } else if (add) {  // M = error + g in this thread's tile; the error itself is not written
        const float* E = g.M + b * g.n * g.m + off;
        float* Mt = scratch + static_cast<int64_t>(omp_get_thread_num()) * tile_max;
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) Mt[i] = E[i] + Ld::load(src, off + i);
        A = Mt;
      } else {
        float* Mt = g.M + b * g.n * g.m + off;  // no error feedback: M is scratch, not state
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) Mt[i] = Ld::load(src, off + i);
        A = Mt;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(h), g.r,
                  static_cast<int>(g.m), 1.0f, A, static_cast<int>(g.m), g.Q + b * g.m * g.r, g.r,
                  0.0f, g.P + b * g.n * g.r + i0 * g.r, g.r);
    }
  });
}

void orthogonalize_groups(const std::vector<PsgdGroup>& groups, float eps, Orthogonalization how,
                          PsgdContext& ctx) {
  if (how != Orthogonalization::kGramSchmidt && how != Orthogonalization::kAuto) {
    for (const auto& g : groups) orthogonalize(g.P, g.batch, g.n, g.r, eps, how, ctx);
    return;
  }
  for (const auto& g : groups) {  // kAuto: Householder for the groups above the MGS limit
    GC_CHECK_ARG(how == Orthogonalization::kAuto || g.r <= kPowerSGDMaxGramSchmidtRank,
                 "fused Gram-Schmidt supports rank <= ", kPowerSGDMaxGramSchmidtRank, ", got ", g.r,
                 " (use Householder)");
    if (g.r > kPowerSGDMaxGramSchmidtRank)
      orthogonalize(g.P, g.batch, g.n, g.r, eps, Orthogonalization::kHouseholder, ctx);
  }
  int64_t work = 0;
  const int64_t count = build_items(
      groups, ctx, [](const PsgdGroup& g) { return g.n; }, &work);
  const int64_t* items = ctx.host_items.data();
  int64_t p_work = 0;
  for (const auto& g : groups) p_work += g.batch * g.n * g.r;
#pragma omp parallel for num_threads(fused_threads(p_work)) schedule(dynamic, 1)
  for (int64_t w = 0; w < count; ++w) {
    const PsgdGroup& g = groups[items[4 * w]];
    float* A = g.P + items[4 * w + 1] * g.n * g.r;
    if (g.r > kPowerSGDMaxGramSchmidtRank) continue;  // done above
    if (g.r <= 1)
      mgs_serial<1>(A, g.n, g.r, eps);
    else if (g.r <= 2)
      mgs_serial<2>(A, g.n, g.r, eps);
    else if (g.r <= 4)
      mgs_serial<4>(A, g.n, g.r, eps);
    else if (g.r <= 8)
      mgs_serial<8>(A, g.n, g.r, eps);
    else if (g.r <= 16)
      mgs_serial<16>(A, g.n, g.r, eps);
    else
      mgs_serial<32>(A, g.n, g.r, eps);
  }
}

void compute_q_fused(const std::vector<PsgdGroup>& groups,
                     const std::vector<std::vector<void*>>& grads, DType t, bool ef, bool direct,
                     PsgdContext& ctx) {
  // Partial-sum slots: a member with c > 1 chunks gets c slots of m x r floats.
  std::vector<int64_t>& items = ctx.host_items;
  int64_t work = 0;
  const int64_t count = build_items(groups, ctx, chunk_rows, &work);
  // Per item: its slot (-1: the member has one chunk, the GEMM writes Q directly).
  size_t slots = 0;
  std::vector<int64_t>& slot_of = ctx.host_slots;
  slot_of.assign(static_cast<size_t>(count), -1);
  for (int64_t w = 0; w < count; ++w) {
    const PsgdGroup& g = groups[items[4 * w]];
    if (chunk_rows(g) < g.n) {
      slot_of[w] = static_cast<int64_t>(slots);
      slots += static_cast<size_t>(g.m * g.r);
    }
  }
  const int T = fused_threads(work);
  // With error feedback M = error + g is formed again per tile (in this thread's tile scratch,
  // after the partial-sum slots): the error buffer is only written in finish().
  const bool recompute = ef && !direct;
  const int64_t tile_max = recompute ? max_tile_floats(groups) : 0;
  const size_t need = slots + static_cast<size_t>(T) * static_cast<size_t>(tile_max);
  float* part = need ? tile_scratch(ctx, need) : nullptr;
  float* tiles = part ? part + slots : nullptr;
  const int64_t* it = items.data();
  with_loader(t, [&](auto L) {
    using Ld = decltype(L);
#pragma omp parallel num_threads(T)
    {
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < count; ++w) {
        const PsgdGroup& g = groups[it[4 * w]];
        const int64_t b = it[4 * w + 1], c0 = it[4 * w + 2], ch = it[4 * w + 3];
        const int64_t rows = tile_rows(g.n, g.m, g.r);
        float* out = slot_of[w] >= 0 ? part + slot_of[w] : g.Q + b * g.m * g.r;
        const void* src = grads[it[4 * w]][b];
        const float* Mb = direct ? static_cast<const float*>(src) : g.M + b * g.n * g.m;
        float* Mt =
            recompute ? tiles + static_cast<int64_t>(omp_get_thread_num()) * tile_max : nullptr;
        for (int64_t i0 = c0; i0 < c0 + ch; i0 += rows) {  // tiles of the chunk, accumulated
          const int64_t h = std::min(rows, c0 + ch - i0);
          const float* A = Mb + i0 * g.m;
          if (recompute) {
            const int64_t off = i0 * g.m, len = h * g.m;
#pragma omp simd
            for (int64_t i = 0; i < len; ++i) Mt[i] = A[i] + Ld::load(src, off + i);
            A = Mt;
          }
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(g.m), g.r,
                      static_cast<int>(h), 1.0f, A, static_cast<int>(g.m),
                      g.P + b * g.n * g.r + i0 * g.r, g.r, i0 > c0 ? 1.0f : 0.0f, out, g.r);
        }
      }
      // implicit barrier; then the partial sums of each chunked member, in chunk order
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < count; ++w) {
        if (slot_of[w] < 0 || it[4 * w + 2] != 0) continue;  // one task per chunked member
        const PsgdGroup& g = groups[it[4 * w]];
        const int64_t mr = g.m * g.r, chunks = (g.n + chunk_rows(g) - 1) / chunk_rows(g);
        float* Qb = g.Q + it[4 * w + 1] * mr;
        const float* first = part + slot_of[w];  // the member's slots are consecutive
        for (int64_t i = 0; i < mr; ++i) {
          float s = first[i];
          for (int64_t c = 1; c < chunks; ++c) s += first[c * mr + i];
          Qb[i] = s;
        }
      }
    }
  });
}

void finish(const std::vector<PsgdGroup>& groups, const std::vector<std::vector<void*>>& grads,
            DType t, bool ef, PsgdContext& ctx) {
  int64_t work = 0;
  const int64_t count = build_items(
      groups, ctx, [](const PsgdGroup& g) { return tile_rows(g.n, g.m, g.r); }, &work);
  const int64_t* items = ctx.host_items.data();
  const bool direct = t == DType::kFloat32 && !ef;  // the GEMM writes the gradient itself
  const int T = fused_threads(work);
  const int64_t tile_max = max_tile_floats(groups);
  float* scratch =
      direct ? nullptr : tile_scratch(ctx, static_cast<size_t>(T) * static_cast<size_t>(tile_max));
#pragma omp parallel for num_threads(T) schedule(dynamic, 1)
  for (int64_t w = 0; w < count; ++w) {
    const PsgdGroup& g = groups[items[4 * w]];
    const int64_t b = items[4 * w + 1], i0 = items[4 * w + 2], h = items[4 * w + 3];
    const int64_t off = i0 * g.m, len = h * g.m;
    void* dst = grads[items[4 * w]][b];
    float* R = direct ? static_cast<float*>(dst) + off
                      : scratch + static_cast<int64_t>(omp_get_thread_num()) * tile_max;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(h), static_cast<int>(g.m),
                g.r, 1.0f, g.P + b * g.n * g.r + i0 * g.r, g.r, g.Q + b * g.m * g.r, g.r, 0.0f, R,
                static_cast<int>(g.m));
    if (direct) continue;
    const float* E = g.M + b * g.n * g.m + off;
    float* Eo = (g.M_out ? g.M_out : g.M) + b * g.n * g.m + off;  // (may be E itself)
    if (t == DType::kFloat32) {
      float* out = static_cast<float*>(dst) + off;
      if (ef) {  // E holds the old error: error = (error + g) - result, M never stored
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) {
          const float v = R[i];
          const float m = E[i] + out[i];
          out[i] = v;
          Eo[i] = m - v;
        }
      } else {
        std::memcpy(out, R, static_cast<size_t>(len) * sizeof(float));
      }
    } else {
      for (int64_t i = 0; i < len; ++i) {
        const float m = ef ? E[i] + psgd_load(dst, off + i, t) : 0.0f;  // M = error + g
        psgd_store(dst, off + i, t, R[i]);
        if (ef) Eo[i] = m - psgd_load(dst, off + i, t);  // the error keeps the store's rounding too
      }
    }
  }
}

void orthogonalize(float* P, int64_t batch, int64_t n, int r, float eps, Orthogonalization how,
                   PsgdContext& ctx) {
  if (batch == 0 || n == 0 || r == 0) return;
  if (how == Orthogonalization::kAuto)
    how = r <= kPowerSGDMaxGramSchmidtRank ? Orthogonalization::kGramSchmidt
                                           : Orthogonalization::kHouseholder;
  switch (how) {
    case Orthogonalization::kHouseholder:
      householder(P, batch, n, r, ctx);
      return;
    case Orthogonalization::kGramSchmidtUnfused:
      for (int64_t b = 0; b < batch; ++b) mgs_unfused(P + b * n * r, n, r, eps);
      return;
    default:
      break;
  }
  GC_CHECK_ARG(r <= kPowerSGDMaxGramSchmidtRank,
               "fused Gram-Schmidt supports rank <= ", kPowerSGDMaxGramSchmidtRank, ", got ", r,
               " (use Householder)");
  if (r <= 1)
    mgs_batch<1>(P, batch, n, r, eps);
  else if (r <= 2)
    mgs_batch<2>(P, batch, n, r, eps);
  else if (r <= 4)
    mgs_batch<4>(P, batch, n, r, eps);
  else if (r <= 8)
    mgs_batch<8>(P, batch, n, r, eps);
  else if (r <= 16)
    mgs_batch<16>(P, batch, n, r, eps);
  else
    mgs_batch<32>(P, batch, n, r, eps);
}

// ---- the phases of a step (kernels/powersgd_kernels.hpp): the fused passes above ----

void psgd_compute_p(const PsgdBucket& b, PsgdContext& ctx) {
  // M = grad (+ error) and P = M Q fused per cache-resident tile
  compress_p(b.groups, b.grads, b.dtype, b.error_feedback, b.direct, ctx);
}

void psgd_project(const PsgdBucket& b, float eps, Orthogonalization how, PsgdContext& ctx) {
  // one parallel region per phase over all groups
  orthogonalize_groups(b.groups, eps, how, ctx);
  compute_q_fused(b.groups, b.grads, b.dtype, b.error_feedback, b.direct, ctx);
}

void psgd_finish(const PsgdBucket& b, PsgdContext& ctx) {
  // per tile: R = P Q^T in cache, grad = R, error = M - grad (one pass)
  finish(b.groups, b.grads, b.dtype, b.error_feedback, ctx);
}

}  // namespace gradcomp::kernels::cpu

#if !GRADCOMP_HAS_CUDA
// Without CUDA a context holds no library handles (kernels/cuda/powersgd_cuda.cu releases them).
gradcomp::kernels::PsgdContext::~PsgdContext() = default;
#endif
