// SPDX-License-Identifier: Apache-2.0
// PowerSGD on CUDA: element-wise kernels, cuBLAS strided-batched GEMMs, the fused modified
// Gram-Schmidt kernel (one block per matrix, r + 1 passes, deterministic block reductions) and
// cuSOLVER Householder QR. Everything is stream-ordered on the caller's stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <algorithm>
#include <climits>

#include "core/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/powersgd_kernels.hpp"
#include "kernels/powersgd_math.h"

#define GC_CUBLAS_CHECK(call)                                                               \
  do {                                                                                      \
    cublasStatus_t gc_st_ = (call);                                                         \
    if (gc_st_ != CUBLAS_STATUS_SUCCESS)                                                    \
      throw ::gradcomp::BackendError(                                                       \
          ::gradcomp::detail::cat("cuBLAS error ", static_cast<int>(gc_st_), " in ", #call, \
                                  " at ", __FILE__, ":", __LINE__));                        \
  } while (0)

#define GC_CUSOLVER_CHECK(call)                                                               \
  do {                                                                                        \
    cusolverStatus_t gc_st_ = (call);                                                         \
    if (gc_st_ != CUSOLVER_STATUS_SUCCESS)                                                    \
      throw ::gradcomp::BackendError(                                                         \
          ::gradcomp::detail::cat("cuSOLVER error ", static_cast<int>(gc_st_), " in ", #call, \
                                  " at ", __FILE__, ":", __LINE__));                          \
  } while (0)

namespace gradcomp::kernels {

PsgdContext::~PsgdContext() {
  if (cublas) cublasDestroy(static_cast<cublasHandle_t>(cublas));
  if (cusolver) cusolverDnDestroy(static_cast<cusolverDnHandle_t>(cusolver));
}

namespace cuda {

namespace {

using gradcomp::cuda_detail::as_stream;
unsigned blocks_for(int64_t n) { return grid_for(n, kThreads, 65535); }

cublasHandle_t blas(PsgdContext& ctx) {
  if (!ctx.cublas) {
    cublasHandle_t h;
    GC_CUBLAS_CHECK(cublasCreate(&h));
    ctx.cublas = h;
  }
  auto h = static_cast<cublasHandle_t>(ctx.cublas);
  GC_CUBLAS_CHECK(cublasSetStream(h, as_stream(ctx.stream)));
  return h;
}

cusolverDnHandle_t solver(PsgdContext& ctx) {
  if (!ctx.cusolver) {
    cusolverDnHandle_t h;
    GC_CUSOLVER_CHECK(cusolverDnCreate(&h));
    ctx.cusolver = h;
  }
  auto h = static_cast<cusolverDnHandle_t>(ctx.cusolver);
  GC_CUSOLVER_CHECK(cusolverDnSetStream(h, as_stream(ctx.stream)));
  return h;
}

__global__ void load_kernel(const void* g, DType t, int64_t n, float* dst, bool add) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = (add ? dst[i] : 0.0f) + psgd_load(g, i, t);
}

__global__ void divide_kernel(float* x, int64_t n, float world) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] = psgd_mean(x[i], world);
}

__global__ void store_mean_kernel(const float* src, int64_t n, float world, void* g, DType t) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    psgd_store(g, i, t, psgd_mean(src[i], world));
}

__global__ void store_result_kernel(const float* r, void* g, DType t, int64_t n, float* m_err) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    psgd_store(g, i, t, r[i]);
    if (m_err) m_err[i] -= psgd_load(g, i, t);
  }
}

// One block per member: draws Q (or only its all-zero columns).
__global__ void fill_q_kernel(float* Q, int64_t m, int r, uint64_t seed, uint64_t step,
                              const uint32_t* ids, bool only_zero) {
  float* q = Q + blockIdx.x * m * r;
  const RngKey key{seed, step, ids[blockIdx.x]};
  for (int c = 0; c < r; ++c) {
    if (only_zero) {
      int nonzero = 0;
      for (int64_t i = threadIdx.x; i < m; i += blockDim.x) nonzero |= q[i * r + c] != 0.0f;
      if (__syncthreads_or(nonzero)) continue;  // uniform across the block
    }
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x)
      q[i * r + c] = psgd_q_value(key, static_cast<uint64_t>(i * r + c));
  }
}

// The block's range (psgd_prescale_exponent, as the CPU's prescale): max |a| over the thread
// block, then every element times 2^k where that is needed. All threads of the block call it.
__device__ void block_prescale(float* A, int64_t len, float eps) {
  __shared__ float red[kThreads / 32];
  __shared__ int shift;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float mx = 0.0f;
  for (int64_t i = tid; i < len; i += blockDim.x) mx = fmaxf(mx, fabsf(A[i]));
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_down_sync(0xffffffffu, mx, off));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  if (tid == 0) {
    float m = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
    shift = psgd_prescale_exponent(m, eps);
  }
  __syncthreads();
  const int k = shift;
  if (k != 0)
    for (int64_t i = tid; i < len; i += blockDim.x) A[i] = ldexpf(A[i], k);
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) prescale_kernel(float* X, int64_t len, float eps) {
  block_prescale(X + blockIdx.x * len, len, eps);
}

// Fused MGS: one block per n x r matrix; pass j finishes column j-1 and accumulates the sums of
// column j (see powersgd_math.h). Reductions: warp shuffles, then warps summed in a fixed order.
template <int R>
__global__ void __launch_bounds__(kThreads) mgs_kernel(float* P, int64_t n, int r, float eps) {
  float* A = P + blockIdx.x * n * r;
  // Every array 16-byte aligned and a multiple of 16 bytes long: the compiler reads scale and coef
  // with 16-byte loads at their absolute offsets, and such a load must not cover a neighbour
  // (unaligned, a load fetched red's last element beside scale[0..2], unused, which racecheck
  // reported as a write-after-read hazard against the warp that writes that element).
  constexpr int RP = R < 4 ? 4 : R;
  __shared__ __align__(16) float red[kThreads / 32][2 * RP];
  __shared__ __align__(16) float scale[RP];
  __shared__ __align__(16) float coef[RP];
  __shared__ __align__(16) float orig[RP];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  block_prescale(A, n * r, eps);
  if (tid < R) {
    scale[tid] = 1.0f;
    coef[tid] = 0.0f;
    orig[tid] = 0.0f;
  }
  __syncthreads();
  for (int j = 0; j <= r; ++j) {
    float acc[2 * R];
#pragma unroll
    for (int k = 0; k < 2 * R; ++k) acc[k] = 0.0f;
    for (int64_t i = tid; i < n; i += blockDim.x) {
      float* row = A + i * r;
      float v[R];
#pragma unroll
      for (int k = 0; k < R; ++k) v[k] = k < r ? row[k] : 0.0f;
      if (j > 0) {
        psgd_mgs_update_row<R>(v, j - 1, scale, coef);
#pragma unroll
        for (int k = 0; k < R; ++k)
          if (k >= j - 1 && k < r) row[k] = v[k];
      }
      if (j == 0)
        psgd_mgs_accumulate_row<R, true>(v, j, acc);
      else if (j < r)
        psgd_mgs_accumulate_row<R, false>(v, j, acc);
    }
    if (j == r) break;  // the last pass only finishes column r-1
#pragma unroll
    for (int k = 0; k < 2 * R; ++k) {
      float x = acc[k];
      for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
      if (lane == 0) red[warp][k] = x;
    }
    __syncthreads();
    if (tid == 0) {
      float s[2 * R];
      for (int k = 0; k < 2 * R; ++k) {
        float x = 0.0f;
        for (int w = 0; w < kThreads / 32; ++w) x += red[w][k];
        s[k] = x;
      }
      if (j == 0)
        for (int k = 0; k < r; ++k) orig[k] = s[R + k];
      psgd_mgs_coefficients<R>(s, orig, r, j, eps, scale, coef);
    }
    __syncthreads();
  }
}

template <int R>
void launch_mgs(float* P, int64_t batch, int64_t n, int r, float eps, cudaStream_t s) {
  for (int64_t b0 = 0; b0 < batch; b0 += 65535) {
    const int grid = static_cast<int>(std::min<int64_t>(65535, batch - b0));
    mgs_kernel<R><<<grid, kThreads, 0, s>>>(P + b0 * n * r, n, r, eps);
    GC_CUDA_CHECK_LAUNCH();
  }
}

void householder(float* P, int64_t batch, int64_t n, int r, PsgdContext& ctx) {
  GC_CHECK_ARG(n <= INT_MAX, "Householder QR on CUDA: n = ", n, " exceeds int range");
  cublasHandle_t hb = blas(ctx);
  cusolverDnHandle_t hs = solver(ctx);
  const int N = static_cast<int>(n);
  float* a = ctx.work.get<float>(static_cast<size_t>(n) * r + r);
  int lw1 = 0, lw2 = 0;
  GC_CUSOLVER_CHECK(cusolverDnSgeqrf_bufferSize(hs, N, r, a, N, &lw1));
  GC_CUSOLVER_CHECK(cusolverDnSorgqr_bufferSize(hs, N, r, r, a, N, a + n * r, &lw2));
  const int lwork = std::max(std::max(lw1, lw2), 1);
  a = ctx.work.get<float>(static_cast<size_t>(n) * r + r + lwork);
  float* tau = a + n * r;
  float* work = tau + r;
  int* info = ctx.info.get<int>(1);
  const float one = 1.0f, zero = 0.0f;
  for (int64_t b = 0; b < batch; ++b) {
    float* A = P + b * n * r;  // row-major n x r == column-major r x n (ld r)
    GC_CUBLAS_CHECK(cublasSgeam(hb, CUBLAS_OP_T, CUBLAS_OP_N, N, r, &one, A, r, &zero, a, N, a, N));
    GC_CUSOLVER_CHECK(cusolverDnSgeqrf(hs, N, r, a, N, tau, work, lwork, info));
    GC_CUSOLVER_CHECK(cusolverDnSorgqr(hs, N, r, r, a, N, tau, work, lwork, info));
    GC_CUBLAS_CHECK(cublasSgeam(hb, CUBLAS_OP_T, CUBLAS_OP_N, r, N, &one, a, N, &zero, A, r, A, r));
  }
}

int to_int(int64_t v, const char* what) {
  GC_CHECK_ARG(v <= INT_MAX, "PowerSGD on CUDA: ", what, " = ", v, " exceeds cuBLAS int range");
  return static_cast<int>(v);
}

}  // namespace

void load(const void* g, DType t, int64_t n, float* dst, bool add, void* stream) {
  if (n == 0) return;
  load_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(g, t, n, dst, add);
  GC_CUDA_CHECK_LAUNCH();
}

void divide(float* x, int64_t n, float world, void* stream) {
  if (n == 0 || world == 1.0f) return;
  divide_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(x, n, world);
  GC_CUDA_CHECK_LAUNCH();
}

void store_mean(const float* src, int64_t n, float world, void* g, DType t, void* stream) {
  if (n == 0) return;
  store_mean_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(src, n, world, g, t);
  GC_CUDA_CHECK_LAUNCH();
}

void store_result(const float* r, void* g, DType t, int64_t n, float* m_err, void* stream) {
  if (n == 0) return;
  store_result_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(r, g, t, n, m_err);
  GC_CUDA_CHECK_LAUNCH();
}

void fill_q(const PsgdGroup& g, uint64_t seed, uint64_t step, bool only_zero_columns,
            void* stream) {
  if (g.batch == 0 || g.m == 0) return;
  for (int64_t b0 = 0; b0 < g.batch; b0 += 65535) {
    const int grid = static_cast<int>(std::min<int64_t>(65535, g.batch - b0));
    fill_q_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(g.Q + b0 * g.m * g.r, g.m, g.r, seed,
                                                            step, g.ids + b0, only_zero_columns);
    GC_CUDA_CHECK_LAUNCH();
  }
}

void prescale_blocks(float* X, int64_t batch, int64_t len, float eps, void* stream) {
  if (len == 0 || eps > 0.0f) return;
  for (int64_t b0 = 0; b0 < batch; b0 += 65535) {
    const int grid = static_cast<int>(std::min<int64_t>(65535, batch - b0));
    prescale_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(X + b0 * len, len, eps);
    GC_CUDA_CHECK_LAUNCH();
  }
}

// Row-major X (a x b) is column-major X^T (b x a, ld b); each product below is the transposed
// column-major one.
void compute_p(const PsgdGroup& g, PsgdContext& ctx) {  // P^T (r x n) = Q^T (r x m) M^T (m x n)
  if (g.batch == 0) return;
  const float one = 1.0f, zero = 0.0f;
  GC_CUBLAS_CHECK(cublasSgemmStridedBatched(blas(ctx), CUBLAS_OP_N, CUBLAS_OP_N, g.r,
                                            to_int(g.n, "n"), to_int(g.m, "m"), &one, g.Q, g.r,
                                            g.m * g.r, g.M, to_int(g.m, "m"), g.n * g.m, &zero, g.P,
                                            g.r, g.n * g.r, to_int(g.batch, "batch")));
}

void compute_q(const PsgdGroup& g, PsgdContext& ctx) {  // Q^T (r x m) = P^T (r x n) M (n x m)
  if (g.batch == 0) return;
  const float one = 1.0f, zero = 0.0f;
  GC_CUBLAS_CHECK(cublasSgemmStridedBatched(blas(ctx), CUBLAS_OP_N, CUBLAS_OP_T, g.r,
                                            to_int(g.m, "m"), to_int(g.n, "n"), &one, g.P, g.r,
                                            g.n * g.r, g.M, to_int(g.m, "m"), g.n * g.m, &zero, g.Q,
                                            g.r, g.m * g.r, to_int(g.batch, "batch")));
}

void reconstruct(const PsgdGroup& g, int64_t b0, int64_t count, float* out,
                 PsgdContext& ctx) {  // R^T (m x n) = Q (m x r) P^T (r x n)
  if (count == 0) return;
  const float one = 1.0f, zero = 0.0f;
  GC_CUBLAS_CHECK(cublasSgemmStridedBatched(
      blas(ctx), CUBLAS_OP_T, CUBLAS_OP_N, to_int(g.m, "m"), to_int(g.n, "n"), g.r, &one,
      g.Q + b0 * g.m * g.r, g.r, g.m * g.r, g.P + b0 * g.n * g.r, g.r, g.n * g.r, &zero, out,
      to_int(g.m, "m"), g.n * g.m, to_int(count, "batch")));
}

void orthogonalize(float* P, int64_t batch, int64_t n, int r, float eps, Orthogonalization how,
                   PsgdContext& ctx) {
  if (batch == 0 || n == 0 || r == 0) return;
  if (how == Orthogonalization::kAuto)
    how = r <= kPowerSGDMaxGramSchmidtRank ? Orthogonalization::kGramSchmidt
                                           : Orthogonalization::kHouseholder;
  GC_CHECK_ARG(how != Orthogonalization::kGramSchmidtUnfused,
               "the unfused Gram-Schmidt baseline is CPU only");
  if (how == Orthogonalization::kHouseholder) {
    householder(P, batch, n, r, ctx);
    return;
  }
  GC_CHECK_ARG(r <= kPowerSGDMaxGramSchmidtRank,
               "fused Gram-Schmidt supports rank <= ", kPowerSGDMaxGramSchmidtRank, ", got ", r,
               " (use Householder)");
  cudaStream_t s = as_stream(ctx.stream);
  if (r <= 1)
    launch_mgs<1>(P, batch, n, r, eps, s);
  else if (r <= 2)
    launch_mgs<2>(P, batch, n, r, eps, s);
  else if (r <= 4)
    launch_mgs<4>(P, batch, n, r, eps, s);
  else if (r <= 8)
    launch_mgs<8>(P, batch, n, r, eps, s);
  else if (r <= 16)
    launch_mgs<16>(P, batch, n, r, eps, s);
  else
    launch_mgs<32>(P, batch, n, r, eps, s);
}

// ---- the phases of a step (kernels/powersgd_kernels.hpp): each group as cuBLAS / cuSOLVER
// calls on ctx's handles and stream ----

namespace {
// Member b of a group as a batch of one whose M is `M` (the gradient itself in direct mode).
PsgdGroup member_of(const PsgdGroup& g, int64_t b, float* M) {
  PsgdGroup one = g;
  one.batch = 1;
  one.M = M;
  one.P = g.P + b * g.n * g.r;
  one.Q = g.Q + b * g.m * g.r;
  one.ids = g.ids + b;
  return one;
}
}  // namespace

void psgd_compute_p(const PsgdBucket& b, PsgdContext& ctx, void* /*stream: ctx's*/) {
  // direct: one GEMM per member on its gradient (no copy pass); else one strided batch
  for (size_t gi = 0; gi < b.groups.size(); ++gi) {
    if (!b.direct) {
      compute_p(b.groups[gi], ctx);
      continue;
    }
    for (int64_t m = 0; m < b.groups[gi].batch; ++m)
      compute_p(member_of(b.groups[gi], m, static_cast<float*>(b.grads[gi][m])), ctx);
  }
}

void psgd_project(const PsgdBucket& b, float eps, Orthogonalization how, PsgdContext& ctx,
                  void* /*stream: ctx's*/) {
  for (const auto& grp : b.groups) orthogonalize(grp.P, grp.batch, grp.n, grp.r, eps, how, ctx);
  for (size_t gi = 0; gi < b.groups.size(); ++gi) {
    if (!b.direct) {
      compute_q(b.groups[gi], ctx);
      continue;
    }
    for (int64_t m = 0; m < b.groups[gi].batch; ++m)
      compute_q(member_of(b.groups[gi], m, static_cast<float*>(b.grads[gi][m])), ctx);
  }
}

void psgd_finish(const PsgdBucket& b, PsgdContext& ctx, float* scratch, int64_t scratch_floats,
                 void* stream) {
  for (size_t gi = 0; gi < b.groups.size(); ++gi) {
    const PsgdGroup& grp = b.groups[gi];
    const int64_t nm = grp.n * grp.m;
    if (b.direct) {  // as on the CPU: the GEMM writes the gradient, no scratch, no copy pass
      for (int64_t m = 0; m < grp.batch; ++m) {
        float* g = static_cast<float*>(b.grads[gi][m]);
        reconstruct(member_of(grp, m, g), 0, 1, g, ctx);
      }
      continue;
    }
    const int64_t chunk = std::max<int64_t>(1, scratch_floats / std::max<int64_t>(1, nm));
    for (int64_t m0 = 0; m0 < grp.batch; m0 += chunk) {
      const int64_t cnt = std::min(chunk, grp.batch - m0);
      reconstruct(grp, m0, cnt, scratch, ctx);
      for (int64_t m = m0; m < m0 + cnt; ++m)
        store_result(scratch + (m - m0) * nm, b.grads[gi][m], b.dtype, nm,
                     b.error_feedback ? grp.M + m * nm : nullptr, stream);
    }
  }
}

}  // namespace cuda
}  // namespace gradcomp::kernels
