// SPDX-License-Identifier: Apache-2.0
// PowerSGD's phases behind one API (kernels/dispatch.hpp): the CPU runs its fused tile passes
// (one OpenMP region per phase over all groups), CUDA runs each group as cuBLAS / cuSOLVER calls.
#include <algorithm>

#include "kernels/dispatch.hpp"

namespace gradcomp::kernels::dispatch {

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

void psgd_load(const Exec& e, const void* g, DType t, int64_t n, float* dst, bool add) {
  if (e.cuda())
    cuda::load(g, t, n, dst, add, e.stream);
  else
    cpu::load(g, t, n, dst, add);
}

void psgd_divide(const Exec& e, float* x, int64_t n, float world) {
  if (e.cuda())
    cuda::divide(x, n, world, e.stream);
  else
    cpu::divide(x, n, world);
}

void psgd_store_mean(const Exec& e, const float* src, int64_t n, float world, void* g, DType t) {
  if (e.cuda())
    cuda::store_mean(src, n, world, g, t, e.stream);
  else
    cpu::store_mean(src, n, world, g, t);
}

void psgd_fill_q(const Exec& e, const PsgdGroup& g, uint64_t seed, uint64_t step,
                 bool only_zero_columns) {
  if (e.cuda())
    cuda::fill_q(g, seed, step, only_zero_columns, e.stream);
  else
    cpu::fill_q(g, seed, step, only_zero_columns);
}

void psgd_prescale_q(const Exec& e, const PsgdGroup& g, float eps) {
  if (e.cuda())
    cuda::prescale_blocks(g.Q, g.batch, g.m * g.r, eps, e.stream);
  else
    cpu::prescale_blocks(g.Q, g.batch, g.m * g.r, eps);
}

bool psgd_forms_m_itself(const Exec& e) { return !e.cuda(); }

void psgd_compute_p(const Exec& e, const PsgdBucket& b, PsgdContext& ctx) {
  if (!e.cuda()) {  // M = grad (+ error) and P = M Q fused per cache-resident tile
    cpu::compress_p(b.groups, b.grads, b.dtype, b.error_feedback, b.direct, ctx);
    return;
  }
  // direct: one GEMM per member on its gradient (no copy pass); else one strided batch
  for (size_t gi = 0; gi < b.groups.size(); ++gi) {
    if (!b.direct) {
      cuda::compute_p(b.groups[gi], ctx);
      continue;
    }
    for (int64_t m = 0; m < b.groups[gi].batch; ++m)
      cuda::compute_p(member_of(b.groups[gi], m, static_cast<float*>(b.grads[gi][m])), ctx);
  }
}

void psgd_project(const Exec& e, const PsgdBucket& b, float eps, Orthogonalization how,
                  PsgdContext& ctx) {
  if (!e.cuda()) {  // one parallel region per phase over all groups
    cpu::orthogonalize_groups(b.groups, eps, how, ctx);
    cpu::compute_q_fused(b.groups, b.grads, b.dtype, b.error_feedback, b.direct, ctx);
    return;
  }
  for (const auto& grp : b.groups)
    cuda::orthogonalize(grp.P, grp.batch, grp.n, grp.r, eps, how, ctx);
  for (size_t gi = 0; gi < b.groups.size(); ++gi) {
    if (!b.direct) {
      cuda::compute_q(b.groups[gi], ctx);
      continue;
    }
    for (int64_t m = 0; m < b.groups[gi].batch; ++m)
      cuda::compute_q(member_of(b.groups[gi], m, static_cast<float*>(b.grads[gi][m])), ctx);
  }
}

void psgd_finish(const Exec& e, const PsgdBucket& b, float* scratch, int64_t scratch_floats,
                 PsgdContext& ctx) {
  if (!e.cuda()) {  // per tile: R = P Q^T in cache, grad = R, error = M - grad (one pass)
    cpu::finish(b.groups, b.grads, b.dtype, b.error_feedback, ctx);
    return;
  }
  for (size_t gi = 0; gi < b.groups.size(); ++gi) {
    const PsgdGroup& grp = b.groups[gi];
    const int64_t nm = grp.n * grp.m;
    if (b.direct) {  // as on the CPU: the GEMM writes the gradient, no scratch, no copy pass
      for (int64_t m = 0; m < grp.batch; ++m) {
        float* g = static_cast<float*>(b.grads[gi][m]);
        cuda::reconstruct(member_of(grp, m, g), 0, 1, g, ctx);
      }
      continue;
    }
    const int64_t chunk = std::max<int64_t>(1, scratch_floats / std::max<int64_t>(1, nm));
    for (int64_t m0 = 0; m0 < grp.batch; m0 += chunk) {
      const int64_t cnt = std::min(chunk, grp.batch - m0);
      cuda::reconstruct(grp, m0, cnt, scratch, ctx);
      for (int64_t m = m0; m < m0 + cnt; ++m)
        cuda::store_result(scratch + (m - m0) * nm, b.grads[gi][m], b.dtype, nm,
                           b.error_feedback ? grp.M + m * nm : nullptr, e.stream);
    }
  }
}

}  // namespace gradcomp::kernels::dispatch
