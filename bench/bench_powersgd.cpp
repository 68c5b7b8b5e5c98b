// SPDX-License-Identifier: Apache-2.0
// PowerSGD microbenchmarks on the CPU, on the layer shapes of ResNet-50 and BERT-base. The
// gradients of a model are one contiguous fp32 bucket (as in DDP) with one view per parameter.
//
//   BM_powersgd_step/<model>/<r>           one full local step of the whole model (world-1 plan:
//                                          M = g + e, P = M Q, orth, Q = M^T P, P Q^T, error),
//                                          error feedback and warm start on (the defaults)
//   BM_powersgd_baseline_step/<model>/<r>  the same step structured as PyTorch's powerSGD_hook
//                                          does it (TorchStyleStep below), same BLAS, same math
//   BM_powersgd_orth/<model>/<r>           orthogonalization of all P blocks of the model only
//   BM_powersgd_baseline_orth/<model>/<r>  the same with the unfused column-by-column baseline
//   BM_powersgd_copy/<model>               memcpy of the model's gradient (frac_of_copy reference)
// Counters: bytes_per_second (gradient bytes per second), compression_ratio (dense bytes / bytes
// sent per step), frac_of_copy (bytes_per_second / memcpy bandwidth of the same binary).
//
// Threads. Our step runs every GEMM per cache tile inside OpenMP loops, below OpenBLAS's threading
// threshold, so only OpenMP's threads run. The baseline calls one GEMM per matrix, threaded by
// OpenBLAS (Debian's default libopenblas0-pthread has its own thread pool, which spins after a
// call and competes with the OpenMP threads of the element-wise passes on a small machine). For
// the comparison of the structure alone run both single-threaded:
//   OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 bench_powersgd --benchmark_filter=step
// Kernels. Debian's OpenBLAS 0.3.21 picks its kernels by CPUID; on a CPU it does not know (a VM
// reporting "Intel Xeon Processor") it falls back to the SSE3 "Prescott" kernels. Check with
// `perf top` (sgemm_kernel_PRESCOTT) and set OPENBLAS_CORETYPE=SkylakeX (AVX-512) or Haswell.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/powersgd.hpp"
#include "kernels/powersgd_kernels.hpp"
#include "model_shapes.hpp"
#include "plans/powersgd_plan.hpp"

namespace {

using gradcomp::Orthogonalization;
using gradcomp::bench::bert_base;
using gradcomp::bench::resnet50;
using gradcomp::bench::Shapes;

const Shapes& model(int id) {
  static const Shapes r = resnet50(), b = bert_base();
  return id == 0 ? r : b;
}
const char* model_name(int id) { return id == 0 ? "resnet50" : "bert_base"; }

struct Grads {
  std::vector<float> bucket;   // every gradient, back to back
  std::vector<float> initial;  // the random gradient every benchmark case starts from
  std::vector<gradcomp::TensorView> views;
  std::vector<int64_t> offsets;
  int64_t numel = 0;
};

Grads& grads(int id) {
  static std::map<int, std::unique_ptr<Grads>> cache;
  auto& g = cache[id];
  if (!g) {
    g = std::make_unique<Grads>();
    for (const auto& s : model(id)) {
      int64_t n = 1;
      for (auto x : s) n *= x;
      g->offsets.push_back(g->numel);
      g->numel += n;
    }
    g->bucket.resize(static_cast<size_t>(g->numel));
    std::mt19937 rng(id + 1);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (auto& x : g->bucket) x = d(rng);
    g->initial = g->bucket;
    for (size_t i = 0; i < model(id).size(); ++i) {
      const auto& s = model(id)[i];
      g->views.emplace_back(g->bucket.data() + g->offsets[i], s.data(), static_cast<int>(s.size()),
                            gradcomp::DType::kFloat32, gradcomp::Device::kCPU);
    }
  }
  return *g;
}

// ------------------------------------------------------------------------------------------------
// The baseline: one step of PowerSGD with the structure of PyTorch's powerSGD_hook
// (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook), written in our C++ with the same
// BLAS and the same kernels for the GEMMs, so that the comparison measures the structure only:
//   1. bucket += error                      (one pass over the whole bucket, in place)
//   2. bucket_copy = clone(bucket)          (kept to compute the error at the end)
//   3. uncompressed tensors: cat into one buffer, (allreduce), /= world, copy back
//   4. same-shape tensors batched with a stack (a copy) when there is more than one
//   5. P = bmm(M, Q)                        (one GEMM per matrix)
//   6. (allreduce P) orthogonalize P column by column: norm, scale, then a dot and an axpy per
//      later column, each a separate strided pass (Orthogonalization::kGramSchmidtUnfused)
//   7. Q = bmm(M^T, P); (allreduce Q) Q /= world
//   8. bmm(P, Q^T, out=M)                   (into the stacked copy, or the gradient itself)
//   9. stacked results copied back into the gradients
//  10. error = bucket_copy - bucket         (one more pass over the whole bucket)
// Element-wise passes are OpenMP loops (as ATen's parallel kernels); a division by world = 1 is
// still a pass, as in PyTorch. More generous than PyTorch: no Python, no allocation per step (the
// clone, the stacks and the error are preallocated buffers). Left out so that both sides compute
// the same math (the paper's Algorithm 1, what our step does): PyTorch's re-orthogonalization of
// the warm-started Q before P = M Q, and its use of torch.linalg.qr instead of Gram-Schmidt for
// rank > 2 in fp32 in recent versions (the issue asks for the column-by-column baseline).
namespace gk = gradcomp::kernels;

void par_copy(float* dst, const float* src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t c = 0; c < (n + 32767) / 32768; ++c) {
    const int64_t b = c * 32768, e = std::min<int64_t>(n, b + 32768);
    std::memcpy(dst + b, src + b, static_cast<size_t>(e - b) * sizeof(float));
  }
}

class TorchStyleStep {
 public:
  TorchStyleStep(const gradcomp::PowerSGDState& st, const Grads& g)
      : ctx_(gradcomp::Device::kCPU), offsets_(g.offsets) {
    std::map<int, size_t> slot;
    for (size_t i = 0; i < st.num_tensors(); ++i) {
      const auto& t = st.tensor(i);
      if (t.rank == 0) {
        uncompressed_.push_back(i);
        u_numel_ += t.n * t.m;
        continue;
      }
      auto it = slot.find(t.group);
      if (it == slot.end()) {
        it = slot.emplace(t.group, groups_.size()).first;
        groups_.push_back({});
        groups_.back().n = t.n;
        groups_.back().m = t.m;
        groups_.back().r = t.rank;
      }
      groups_[it->second].members.push_back(i);
    }
    int64_t p = 0, q = 0, stack = 0;
    for (auto& gr : groups_) {
      const int64_t b = static_cast<int64_t>(gr.members.size());
      gr.p_off = p;
      gr.q_off = q;
      p += b * gr.n * gr.r;
      q += b * gr.m * gr.r;
      if (b > 1) {
        gr.stack_off = stack;
        stack += b * gr.n * gr.m;
      }
    }
    error_.assign(static_cast<size_t>(g.numel), 0.0f);
    copy_.assign(static_cast<size_t>(g.numel), 0.0f);
    umem_.assign(static_cast<size_t>(u_numel_), 0.0f);
    pmem_.assign(static_cast<size_t>(p), 0.0f);
    qmem_.assign(static_cast<size_t>(q), 0.0f);
    stack_.assign(static_cast<size_t>(stack), 0.0f);
    for (auto& gr : groups_) {  // initial Q: the same draw as ours
      ids_.clear();
      for (size_t i : gr.members) ids_.push_back(static_cast<uint32_t>(i));
      gk::PsgdGroup grp = group(gr, nullptr);
      gk::cpu::fill_q(grp, 0, 0, false);
    }
  }

  void step(float* bucket, int64_t numel, float world = 1.0f) {
    float* err = error_.data();
#pragma omp parallel for schedule(static) if (numel > (1 << 16))
    for (int64_t i = 0; i < numel; ++i) bucket[i] += err[i];  // 1
    par_copy(copy_.data(), bucket, numel);                    // 2
    int64_t u = 0;                                            // 3
    for (size_t i : uncompressed_) {
      const int64_t n = size(i);
      par_copy(umem_.data() + u, bucket + offsets_[i], n);
      u += n;
    }
    float* um = umem_.data();
#pragma omp parallel for schedule(static) if (u_numel_ > (1 << 16))
    for (int64_t i = 0; i < u_numel_; ++i) um[i] /= world;
    u = 0;
    for (size_t i : uncompressed_) {
      const int64_t n = size(i);
      par_copy(bucket + offsets_[i], umem_.data() + u, n);
      u += n;
    }
    for (auto& gr : groups_) {  // 4, 5
      float* M = matrices(gr, bucket);
      if (gr.members.size() > 1)
        for (size_t b = 0; b < gr.members.size(); ++b)
          par_copy(M + b * gr.n * gr.m, bucket + offsets_[gr.members[b]], gr.n * gr.m);
      gk::cpu::compute_p(group(gr, M), ctx_);
    }
    for (auto& gr : groups_)  // 6
      gk::cpu::orthogonalize(pmem_.data() + gr.p_off, static_cast<int64_t>(gr.members.size()), gr.n,
                             gr.r, 0.0f, gradcomp::Orthogonalization::kGramSchmidtUnfused, ctx_);
    for (auto& gr : groups_) gk::cpu::compute_q(group(gr, matrices(gr, bucket)), ctx_);  // 7
    float* qm = qmem_.data();
    const int64_t nq = static_cast<int64_t>(qmem_.size());
#pragma omp parallel for schedule(static) if (nq > (1 << 16))
    for (int64_t i = 0; i < nq; ++i) qm[i] /= world;
    for (auto& gr : groups_) {  // 8, 9
      float* M = matrices(gr, bucket);
      const gk::PsgdGroup grp = group(gr, M);
      for (size_t b = 0; b < gr.members.size(); ++b)
        gk::cpu::reconstruct(grp, static_cast<int64_t>(b), M + b * gr.n * gr.m, ctx_);
      if (gr.members.size() > 1)
        for (size_t b = 0; b < gr.members.size(); ++b)
          par_copy(bucket + offsets_[gr.members[b]], M + b * gr.n * gr.m, gr.n * gr.m);
    }
    const float* cp = copy_.data();  // 10
#pragma omp parallel for schedule(static) if (numel > (1 << 16))
    for (int64_t i = 0; i < numel; ++i) err[i] = cp[i] - bucket[i];
  }

 private:
  struct Group {
    int64_t n = 0, m = 0;
    int r = 0;
    std::vector<size_t> members;
    int64_t p_off = 0, q_off = 0, stack_off = 0;
  };
  int64_t size(size_t i) const {
    return (i + 1 < offsets_.size() ? offsets_[i + 1] : static_cast<int64_t>(error_.size())) -
           offsets_[i];
  }
  float* matrices(const Group& gr, float* bucket) {
    return gr.members.size() > 1 ? stack_.data() + gr.stack_off : bucket + offsets_[gr.members[0]];
  }
  gk::PsgdGroup group(const Group& gr, float* M) {
    gk::PsgdGroup g;
    g.batch = static_cast<int64_t>(gr.members.size());
    g.n = gr.n;
    g.m = gr.m;
    g.r = gr.r;
    g.M = M;
    g.P = pmem_.data() + gr.p_off;
    g.Q = qmem_.data() + gr.q_off;
    g.ids = ids_.data();
    return g;
  }
  gk::PsgdContext ctx_;
  std::vector<int64_t> offsets_;
  std::vector<size_t> uncompressed_;
  std::vector<Group> groups_;
  int64_t u_numel_ = 0;
  std::vector<float> error_, copy_, umem_, pmem_, qmem_, stack_;
  std::vector<uint32_t> ids_;
};

// memcpy bandwidth (bytes/s, read + write counted once as the copied size) of the model's size.
double copy_bandwidth(int id) {
  static std::map<int, double> bw;
  if (bw.count(id)) return bw[id];
  const Grads& g = grads(id);
  std::vector<float> dst(static_cast<size_t>(g.numel)), src(static_cast<size_t>(g.numel), 1.0f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), src.size() * 4);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(src.size() * 4) / s);
  }
  benchmark::DoNotOptimize(dst.data());
  return bw[id] = best;
}

void run_step(benchmark::State& state, bool baseline, bool check = false) {
  const int id = static_cast<int>(state.range(0));
  gradcomp::PowerSGDConfig cfg;
  cfg.rank = static_cast<int>(state.range(1));
  cfg.orthogonalization = Orthogonalization::kGramSchmidt;
  // off by default: PyTorch's hook does not check either; BM_powersgd_step_checked times what
  // the default (on: the finiteness test on P, the error and Q saved for a skipped or undone
  // step) costs against BM_powersgd_step in the same run
  cfg.check_finite = check;
  Grads& g = grads(id);
  // A case after another would otherwise start from that case's rank-r results (degenerate P).
  std::copy(g.initial.begin(), g.initial.end(), g.bucket.begin());
  gradcomp::PowerSGDState st(cfg, model(id));
  gradcomp::PowerSGDPlan plan(st, 1);
  std::unique_ptr<TorchStyleStep> torch_style;
  if (baseline) torch_style = std::make_unique<TorchStyleStep>(st, g);
  auto step = [&] {
    if (baseline) {
      torch_style->step(g.bucket.data(), g.numel);
      return;
    }
    plan.begin(g.views);
    while (plan.next()) {
    }  // world 1: each allreduce is the identity
  };
  if (baseline) {  // same input, fresh states: the baseline must compute what our step computes
    const std::vector<float> input = g.bucket;
    plan.begin(g.views);
    while (plan.next()) {
    }  // also gives the statistics (the same collectives would be sent)
    const std::vector<float> ours = g.bucket;
    std::copy(input.begin(), input.end(), g.bucket.begin());
    torch_style->step(g.bucket.data(), g.numel);
    double num = 0, den = 0;
    for (size_t i = 0; i < ours.size(); ++i) {
      const double d = static_cast<double>(g.bucket[i]) - ours[i];
      num += d * d;
      den += static_cast<double>(ours[i]) * ours[i];
    }
    const double rel = std::sqrt(num / (den > 0 ? den : 1.0));
    state.counters["rel_diff_vs_ours"] = rel;
    if (!(rel < 1e-3)) state.SkipWithError("the baseline step does not compute what ours does");
  }
  step();  // warm-up: Q drawn, pages touched, scratch grown
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) step();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bytes = static_cast<double>(g.numel) * 4;
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["compression_ratio"] = st.last_stats().compression_ratio();
  // A plain ratio of two bandwidths (gradient bytes per second of the step / memcpy bytes per
  // second), not a Counter rate: a rate flag would print it as "0.0787/s".
  state.counters["frac_of_copy"] =
      bytes * static_cast<double>(state.iterations()) / seconds / copy_bandwidth(id);
  state.counters["elements"] = static_cast<double>(g.numel);
  state.SetLabel(std::string(model_name(id)) + " r=" + std::to_string(cfg.rank));
}

void BM_powersgd_step(benchmark::State& s) { run_step(s, false); }
void BM_powersgd_baseline_step(benchmark::State& s) { run_step(s, true); }
void BM_powersgd_step_checked(benchmark::State& s) { run_step(s, false, true); }

// Orthogonalization of every P block of the model (one batch group per distinct shape).
void run_orth(benchmark::State& state, Orthogonalization how) {
  const int id = static_cast<int>(state.range(0));
  gradcomp::PowerSGDConfig cfg;
  cfg.rank = static_cast<int>(state.range(1));
  gradcomp::PowerSGDState st(cfg, model(id));
  std::map<std::pair<int64_t, int>, int64_t> groups;  // (n, r) -> batch
  for (size_t i = 0; i < st.num_tensors(); ++i)
    if (st.tensor(i).rank > 0) ++groups[{st.tensor(i).n, st.tensor(i).rank}];
  std::vector<float> src(static_cast<size_t>(st.p_numel())), p;
  std::mt19937 rng(7);
  std::normal_distribution<float> d;
  for (auto& x : src) x = d(rng);
  gradcomp::kernels::PsgdContext ctx(gradcomp::Device::kCPU);
  for (auto _ : state) {
    state.PauseTiming();
    p = src;
    state.ResumeTiming();
    float* at = p.data();
    for (const auto& [key, batch] : groups) {
      gradcomp::kernels::cpu::orthogonalize(at, batch, key.first, key.second, 0.0f, how, ctx);
      at += batch * key.first * key.second;
    }
    benchmark::DoNotOptimize(p.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(src.size() * 4) * state.iterations());
  state.SetLabel(std::string(model_name(id)) + " P blocks: " + std::to_string(src.size()) +
                 " floats");
}

void BM_powersgd_orth(benchmark::State& s) { run_orth(s, Orthogonalization::kGramSchmidt); }
void BM_powersgd_baseline_orth(benchmark::State& s) {
  run_orth(s, Orthogonalization::kGramSchmidtUnfused);
}

void BM_powersgd_copy(benchmark::State& state) {
  const int id = static_cast<int>(state.range(0));
  const Grads& g = grads(id);
  std::vector<float> dst(static_cast<size_t>(g.numel)), src(static_cast<size_t>(g.numel), 1.0f);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size() * 4);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(src.size() * 4) * state.iterations());
  state.SetLabel(model_name(id));
}

void step_args(benchmark::internal::Benchmark* b) {
  for (int id : {0, 1})
    for (int r : {1, 2, 4, 8}) b->Args({id, r});
  b->ArgNames({"model", "r"})->Unit(benchmark::kMillisecond)->MinTime(0.3)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_powersgd_step)->Apply(step_args);
BENCHMARK(BM_powersgd_baseline_step)->Apply(step_args);
BENCHMARK(BM_powersgd_step_checked)->Apply(step_args);
BENCHMARK(BM_powersgd_orth)->Apply(step_args);
BENCHMARK(BM_powersgd_baseline_orth)->Apply(step_args);
BENCHMARK(BM_powersgd_copy)
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1)
    ->UseRealTime();

BENCHMARK_MAIN();
