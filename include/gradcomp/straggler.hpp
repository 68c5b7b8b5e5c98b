// SPDX-License-Identifier: Apache-2.0
// Straggler mitigation: DropCompute (Giladi et al., a compute threshold tau after which a worker
// stops computing micro-batches and joins the allreduce with what it has) and the Quadratic
// Synchronization Rule for Local SGD (Gu et al., sync period H = max(H_base, floor((alpha/lr)^2))).
//
// The module is clock- and framework-agnostic: plain structs, doubles, std::vector<double>, so the
// Python bindings map one to one. Times are in seconds (any unit works if used consistently).
//
// Pieces:
//  - analytics: E[max of N normals] (paper Eq. 4), E[M~] (Eq. 5), S_eff (Eq. 6), R = M/M~ - 1;
//  - LatencyTrace + find_optimal_tau: the deterministic tau* search over gathered latencies;
//  - ThresholdController: the per-step decision "start/finish this micro-batch or stop";
//  - gradient_scale: the gradient normalisation with drops (nominal or actual count);
//  - DelayModel + simulate_latencies + speedup curves: the paper's delay environment (Fig. 1, 3);
//  - qsr_period + QsrScheduler: when Local SGD averages next.
//
// Example (warm-up without drops, then the automatic tau, identical on every rank):
//   using namespace gradcomp::straggler;
//   ThresholdController ctl({.micro_batches = M, .history_steps = 5});  // tau = +Inf: no drop
//   ... 5 steps ...;  all-gather ctl.history() (5 * M doubles per rank) into `gathered`
//   LatencyTrace trace{world_size, 5, M, gathered};
//   ctl.set_tau(find_optimal_tau(trace, {.serial_time = t_allreduce}).tau);
//   // each step:
//   ctl.begin_step();
//   while (ctl.proceed(DropPoint::kBeforeForward)) { forward_backward(); ctl.micro_batch_done(); }
//   int64_t done = ctl.end_step().completed;   // sum over ranks -> gradient_scale(kActual, ...)
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "gradcomp/types.hpp"

namespace gradcomp::straggler {

// ------------------------------------------------------------------------------------------------
// Analytics (paper Section 4)
// ------------------------------------------------------------------------------------------------

/// The Euler-Mascheroni constant gamma used by Eq. 4.
inline constexpr double kEulerGamma = 0.57721566490153286060651209008240243;

/// Standard normal CDF Phi(x). Example: normal_cdf(0.0) == 0.5.
double normal_cdf(double x);

/// Inverse of Phi: the x with Phi(x) = p, for p in (0, 1), accurate to ~1e-15 relative.
/// Throws InvalidArgument outside (0, 1). Example: normal_quantile(0.975) ~= 1.959964.
double normal_quantile(double p);

/// E[max(T_1..T_N)] for N iid N(mu, sigma^2) by the paper's Eq. 4 (Bailey et al. 2014):
///   sigma * ((1 - gamma) Phi^-1(1 - 1/N) + gamma Phi^-1(1 - 1/(e N))) + mu.
/// N = 1 returns mu (exact; Eq. 4 is undefined there). The approximation is within 2% of the exact
/// value (mu = 0, sigma = 1) for N >= 16; for N = 2 it is ~8% low.
/// Throws InvalidArgument for n < 1, sigma < 0 or non-finite mu/sigma.
/// Example: expected_max_normal(64, 0.0, 1.0) ~= 2.369 (the exact expectation is 2.344).
double expected_max_normal(int64_t n, double mu, double sigma);

/// E[M~(tau)] by Eq. 5: sum_{m=1..M} Phi((tau - m mu) / sqrt(m sigma^2)), the expected number of
/// micro-batches a worker completes by time tau when each takes mu +- sigma (CLT). With sigma = 0
/// the terms are steps: 1 if m mu <= tau. Throws InvalidArgument for tau <= 0, M < 1, mu <= 0,
/// sigma < 0 or non-finite values.
/// Example: expected_completed_microbatches(12.0, 12, 1.0, 0.1) ~= 11.5.
double expected_completed_microbatches(double tau, int64_t micro_batches, double mu, double sigma);

/// S_eff by Eq. 6: m_tilde (T + Tc) / (M (min(tau, T) + Tc)). Throws InvalidArgument for
/// m_tilde outside [0, M], M < 1, tau <= 0, T < 0, Tc < 0, T + Tc == 0 or non-finite values.
/// Example: effective_speedup(11.0, 12, 10.0, 12.0, 0.5) == 11 * 12.5 / (12 * 10.5).
double effective_speedup(double m_tilde, int64_t micro_batches, double tau, double step_time,
                         double serial_time);

/// The compensation factor R = M / M~ - 1: the extra steps (R * I_base) or the batch-size increase
/// that restores the sample count lost to drops. Throws InvalidArgument for m_tilde outside (0, M].
/// Example: compensation_factor(0.9 * 12, 12) ~= 0.111.
double compensation_factor(double m_tilde, int64_t micro_batches);

/// The analytic model of a training setting: N workers, M micro-batches each taking mu +- sigma
/// (normal per micro-batch, so a worker's step takes N(M mu, M sigma^2)), serial time Tc per step.
struct AnalyticModel {
  int64_t workers = 1;
  int64_t micro_batches = 1;
  double mu = 1.0;           ///< mean latency of one micro-batch, > 0
  double sigma = 0.0;        ///< standard deviation of one micro-batch's latency, >= 0
  double serial_time = 0.0;  ///< Tc >= 0: allreduce and other per-step serial time
  void validate() const;
};

/// The analytic prediction at one tau (Eq. 4, 5, 6).
struct AnalyticPoint {
  double tau = 0.0;
  double step_time = 0.0;           ///< E[T] by Eq. 4 (or the given one), no threshold
  double completed = 0.0;           ///< E[M~] by Eq. 5
  double completion_rate = 0.0;     ///< E[M~] / M
  double drop_rate = 0.0;           ///< 1 - E[M~] / M
  double step_time_with_tau = 0.0;  ///< min(tau, E[T])
  double speedup = 0.0;             ///< S_eff, Eq. 6
  double step_speedup = 0.0;        ///< (E[T] + Tc) / (min(tau, E[T]) + Tc)
};

/// Evaluates Eq. 4-6 at tau. If step_time > 0 it is used for E[T] instead of Eq. 4 (the paper's
/// "analytical given E[T]" curve). Throws InvalidArgument for tau <= 0 or an invalid model.
/// Example: analytic_point({.workers = 64, .micro_batches = 12, .mu = 1, .sigma = 0.3}, 12.5);
AnalyticPoint analytic_point(const AnalyticModel& model, double tau, double step_time = 0.0);

/// The tau maximising the analytic S_eff, by a scan of `grid` points over (0, E[T]] followed by a
/// golden-section refinement; never below the point of no drop if nothing is gained (then tau =
/// E[T], speedup 1). Deterministic. Example: analytic_optimal_tau(model).tau.
AnalyticPoint analytic_optimal_tau(const AnalyticModel& model, int64_t grid = 2048);

// ------------------------------------------------------------------------------------------------
// Latency traces and the automatic tau (paper Section 4.4)
// ------------------------------------------------------------------------------------------------

/// Per-micro-batch latencies t_n^(m) of all workers over some steps, row-major
/// [worker][step][micro_batch]: latency[(n * steps + s) * micro_batches + m]. This is exactly the
/// concatenation, in rank order, of each worker's ThresholdController::history() after an
/// all-gather.
struct LatencyTrace {
  int64_t workers = 0;
  int64_t steps = 0;
  int64_t micro_batches = 0;
  std::vector<double> latency;
  /// Throws InvalidArgument on a zero dimension, a size mismatch, or a negative/NaN/Inf latency
  /// (naming the first bad [worker, step, micro-batch]).
  void validate() const;
  double at(int64_t worker, int64_t step, int64_t m) const {
    return latency[static_cast<size_t>((worker * steps + step) * micro_batches + m)];
  }
};

/// How a worker stops once its elapsed compute time passes tau.
enum class StopModel : uint8_t {
  /// The paper's model (Algorithm 1, Eq. 6): the worker is preempted at exactly tau; it keeps the
  /// micro-batches finished by tau (T^(m) <= tau) and its step time is min(tau, T_n).
  kPreemptive = 0,
  /// What a check between micro-batches can do (DropPoint::kBeforeForward / kAfterBackward): a
  /// micro-batch is started while the elapsed time is <= tau and then finished and kept; the
  /// step time is the end of the last micro-batch started. At least one micro-batch per worker.
  kMicroBatchBoundary = 1,
};

struct TauOptions {
  double serial_time = 0.0;  ///< Tc >= 0, per-step serial time (allreduce, optimizer, ...)
  StopModel model = StopModel::kPreemptive;
  /// A drop threshold must beat "no drop" (speedup 1) and any larger candidate by this relative
  /// margin: float noise never makes a run without variance drop. >= 0.
  double min_gain = 1e-9;
  void validate() const;
};

/// The empirical quantities at one tau, averaged over the trace's steps:
/// S_eff = M~ (T + Tc) / (M (T(tau) + Tc)) with T, T(tau) the mean per-step compute times (max
/// over workers) without/with the threshold and M~ the mean completed micro-batches per worker.
struct TauEval {
  double tau = 0.0;
  double completed = 0.0;           ///< M~
  double completion_rate = 0.0;     ///< M~ / M
  double drop_rate = 0.0;           ///< 1 - M~ / M
  double step_time = 0.0;           ///< mean T
  double step_time_with_tau = 0.0;  ///< mean T(tau)
  double speedup = 0.0;             ///< S_eff
  double step_speedup = 0.0;        ///< (T + Tc) / (T(tau) + Tc)
};

/// S_eff and friends of the trace at one tau > 0 (tau may exceed every step: no drop).
/// Example: evaluate_tau(trace, 11.5, {.serial_time = 0.3}).speedup.
TauEval evaluate_tau(const LatencyTrace& trace, double tau, const TauOptions& opt = {});

/// The tau* maximising the empirical S_eff over every candidate where S_eff can change (the
/// cumulative times T_n^(m) in the trace; S_eff is piecewise, best at the left end of a piece).
/// Deterministic: the same trace gives the bitwise same result on every rank (sorted candidates,
/// sequential sums in a fixed order, no threads). Ties and gains below opt.min_gain go to the
/// larger tau; if no threshold gains, tau* = max step time (no drop, speedup 1).
/// Throws InvalidArgument on an invalid trace or options.
/// Example: double tau = find_optimal_tau(trace, {.serial_time = 0.2}).tau;
TauEval find_optimal_tau(const LatencyTrace& trace, const TauOptions& opt = {});

/// Mean and (population) standard deviation of all latencies: the (mu, sigma) of Eq. 4-5.
struct LatencyStats {
  double mean = 0.0;
  double stddev = 0.0;
};
LatencyStats latency_stats(const LatencyTrace& trace);

// ------------------------------------------------------------------------------------------------
// The per-step threshold logic
// ------------------------------------------------------------------------------------------------

/// Where in a micro-batch the controller is consulted (the Python helper passes one of these at
/// each point; only the configured one can stop the step).
enum class DropPoint : uint8_t {
  /// Before the forward pass: an unstarted micro-batch is skipped. Nothing computed is wasted.
  kBeforeForward = 0,
  /// After the forward pass: the backward is skipped and this micro-batch's forward is wasted;
  /// stops earlier than kBeforeForward when the backward dominates.
  kBetweenForwardBackward = 1,
  /// After the backward pass: the micro-batch just computed is kept (its gradient is already
  /// accumulated) and no further micro-batch starts.
  kAfterBackward = 2,
};

/// Seconds on some monotonic clock. The default is std::chrono::steady_clock. A GPU timer is a
/// clock that records a CUDA event and synchronises on it (or on an earlier one), so that the
/// elapsed time includes the device work; tests use a ManualClock.
using ClockFn = std::function<double()>;

/// steady_clock in seconds.
double monotonic_seconds();

/// A clock for tests and simulations: now() returns what was set.
/// Example: ManualClock c; ThresholdController ctl(cfg, c.fn()); c.advance(0.5);
struct ManualClock {
  double now_s = 0.0;
  void advance(double dt) { now_s += dt; }
  /// A ClockFn reading this clock (the ManualClock must outlive it).
  ClockFn fn() {
    return [this] { return now_s; };
  }
};

struct ThresholdConfig {
  /// Compute threshold in seconds, > 0; +Inf (the default) never drops (warm-up).
  double tau = std::numeric_limits<double>::infinity();
  int64_t micro_batches = 1;  ///< M >= 1
  DropPoint drop_point = DropPoint::kBeforeForward;
  /// Keep the per-micro-batch latencies of steps that completed all M micro-batches (for
  /// find_optimal_tau); at most this many steps (oldest dropped first). 0 = do not record.
  int64_t history_steps = 0;
  void validate() const;
};

/// The DropCompute decision of one worker, step by step, independent of the clock source.
///
/// Per step:  begin_step(); then for each micro-batch m: proceed(kBeforeForward), forward,
/// proceed(kBetweenForwardBackward), backward, micro_batch_done(), proceed(kAfterBackward);
/// stop the loop as soon as proceed() returns false; end_step() returns the step's record.
/// proceed(p) returns false once the elapsed time since begin_step() exceeds tau at the configured
/// point p (never at other points), and stays false for the rest of the step; it also returns
/// false after M micro-batches. Thread-compatible (one controller per worker thread).
class ThresholdController {
 public:
  explicit ThresholdController(const ThresholdConfig& cfg, ClockFn clock = {});

  /// Starts a step: the elapsed time counts from now. Throws if a step is already open.
  void begin_step();
  /// Whether to go on past point `p` of the current micro-batch (see the class comment).
  bool proceed(DropPoint p);
  /// Whether to go on, judged on an elapsed time measured by the caller (e.g. from CUDA events).
  bool proceed_elapsed(DropPoint p, double elapsed_s);
  /// Records that one micro-batch's gradient was accumulated (its latency = time since the
  /// previous micro_batch_done() or begin_step()).
  void micro_batch_done();

  struct StepRecord {
    int64_t completed = 0;  ///< micro-batches whose gradient was accumulated
    bool dropped = false;   ///< fewer than M micro-batches were completed
    double elapsed = 0.0;   ///< seconds from begin_step() to end_step()
  };
  /// Closes the step; appends its latencies to history() if all M micro-batches were completed.
  StepRecord end_step();

  double elapsed() const;  ///< seconds since begin_step() of the open step
  int64_t completed() const { return completed_; }
  bool in_step() const { return in_step_; }
  double tau() const { return cfg_.tau; }
  /// Sets a new threshold (e.g. from find_optimal_tau); takes effect at the next begin_step().
  /// Throws InvalidArgument (leaving tau unchanged) for tau <= 0 or NaN.
  void set_tau(double tau);
  const ThresholdConfig& config() const { return cfg_; }

  /// Recorded latencies, [step][micro_batch] row-major, history_steps() * M values.
  const std::vector<double>& history() const { return history_; }
  int64_t history_steps() const;
  void clear_history() { history_.clear(); }

 private:
  ThresholdConfig cfg_;
  ClockFn clock_;
  double active_tau_ = 0.0;
  double start_ = 0.0;
  double last_done_ = 0.0;
  int64_t completed_ = 0;
  bool in_step_ = false;
  bool stopped_ = false;
  std::vector<double> step_latency_;
  std::vector<double> history_;
};

// ------------------------------------------------------------------------------------------------
// Gradient normalisation with drops
// ------------------------------------------------------------------------------------------------

enum class Normalization : uint8_t {
  /// Divide the summed micro-batch gradients by the nominal N * M (the reference
  /// implementation). Bias: E[g] = (E[M~] / M) * true gradient, i.e. the gradient (and so the
  /// effective learning rate) shrinks by the completion rate; no extra communication.
  kNominal = 0,
  /// Divide by the actual number of micro-batches computed on all workers (the counts summed
  /// across workers, e.g. appended to the gradient allreduce). The result is exactly the mean of
  /// the computed micro-batch gradients: no shrinkage, but a ratio estimator, so it is unbiased
  /// only conditionally on the counts; samples that are slow to compute (long sequences) are
  /// dropped more often, a selection bias that both options share.
  kActual = 1,
};

/// The factor to multiply the cross-worker SUM of micro-batch gradients with (each micro-batch
/// gradient being the mean over its samples). total_completed = sum over workers of the
/// micro-batches accumulated, in [0, N*M]; with kActual and total_completed == 0 it returns 0 (no
/// gradient: skip the optimizer step). If the allreduce already averaged over the N workers (DDP),
/// multiply by N * gradient_scale(...). Throws InvalidArgument for N < 1, M < 1 or a count out of
/// range. Example: gradient_scale(Normalization::kActual, 4, 12, 45) == 1.0 / 45.
double gradient_scale(Normalization norm, int64_t workers, int64_t micro_batches,
                      int64_t total_completed);

// ------------------------------------------------------------------------------------------------
// Delay environment (simulator)
// ------------------------------------------------------------------------------------------------

enum class DelayKind : uint8_t {
  /// t = max(0, N(mean, stddev^2)).
  kNormal = 0,
  /// The paper's simulated delay environment: a base latency N(mean, stddev^2) (clamped at 0)
  /// plus an additive bounded log-normal noise min(exp(N(log_mu, log_sigma^2)), cap).
  kBoundedLogNormal = 1,
};

struct DelayModel {
  DelayKind kind = DelayKind::kNormal;
  double mean = 1.0;       ///< base micro-batch latency mean, >= 0
  double stddev = 0.0;     ///< base latency standard deviation, >= 0
  double log_mu = 0.0;     ///< log-normal noise: mean of the underlying normal
  double log_sigma = 1.0;  ///< log-normal noise: stddev of the underlying normal, >= 0
  double cap = 1.0;        ///< upper bound of the additive noise, >= 0
  void validate() const;
};

/// The exact mean and standard deviation of one micro-batch latency under the model (the clamp of
/// the base normal at 0 is ignored: keep stddev well below mean). Example:
/// latency_moments({.kind = DelayKind::kNormal, .mean = 1, .stddev = 0.2}).stddev == 0.2.
LatencyStats latency_moments(const DelayModel& model);

/// Draws a trace of per-micro-batch latencies (workers x steps x M). Deterministic given seed:
/// latency [n][s][m] comes from RngKey{seed, s, n} at counter m, independent of threading.
/// Throws InvalidArgument on zero dimensions or an invalid model.
/// Example: auto tr = simulate_latencies({.kind = DelayKind::kNormal, .mean = 1, .stddev = 0.2},
///                                       2048, 10, 12, 42);
LatencyTrace simulate_latencies(const DelayModel& model, int64_t workers, int64_t steps,
                                int64_t micro_batches, uint64_t seed);

/// One point of the paper's Fig. 3 (S_eff vs tau): simulated (from the trace), analytic (Eq. 4-6
/// from the trace's mean and variance) and analytic given the simulated E[T].
struct TauCurvePoint {
  TauEval simulated;
  AnalyticPoint analytic;
  AnalyticPoint analytic_given_t;
};

/// S_eff etc. at `points` taus spread evenly over [tau_lo, tau_hi] (tau_lo > 0).
std::vector<TauCurvePoint> tau_curve(const LatencyTrace& trace, double tau_lo, double tau_hi,
                                     int64_t points, const TauOptions& opt = {});

/// One point of the paper's Fig. 1 (scaling with N): throughput in micro-batches per unit time,
/// normalised by a single worker's no-variance throughput M / (M mean + Tc).
struct ScalePoint {
  int64_t workers = 0;
  double linear = 0.0;                ///< N: perfect scaling
  double baseline = 0.0;              ///< simulated synchronous training
  double dropcompute = 0.0;           ///< simulated, at the tau* found on the trace
  double baseline_analytic = 0.0;     ///< Eq. 4 for E[T]
  double dropcompute_analytic = 0.0;  ///< Eq. 4-6 at the analytic optimum tau
  TauEval simulated;                  ///< the tau* point of the trace
  AnalyticPoint analytic;             ///< the analytic optimum
};

/// Simulates each worker count in `workers` for `steps` steps (seed + index as the seed) and
/// reports Fig. 1's curves. The analytic model uses the trace's mean and stddev per micro-batch.
std::vector<ScalePoint> scale_curve(const DelayModel& model, const std::vector<int64_t>& workers,
                                    int64_t steps, int64_t micro_batches, uint64_t seed,
                                    const TauOptions& opt = {});

// ------------------------------------------------------------------------------------------------
// Quadratic Synchronization Rule (Local SGD / Local AdamW)
// ------------------------------------------------------------------------------------------------

/// H = max(h_base, floor((alpha / lr)^2)). Throws InvalidArgument for lr <= 0, alpha < 0,
/// h_base < 1 or non-finite values. Example: qsr_period(0.001, 0.0175, 4) == 306.
int64_t qsr_period(double lr, double alpha, int64_t h_base);

struct QsrConfig {
  double alpha = 0.0;        ///< growth coefficient, >= 0 (0 = constant period h_base)
  int64_t h_base = 1;        ///< base period, >= 1
  int64_t total_steps = 0;   ///< training length in steps, >= 1: the period is capped at the end
  int64_t warmup_steps = 0;  ///< learning-rate warm-up: H = h_base while step < warmup_steps
  void validate() const;
};

/// Decides when Local SGD averages: after each averaging (and at the start), the next one is
/// H steps later, H from the learning rate at that moment, capped by the remaining steps.
///
/// Example:
///   QsrScheduler q({.alpha = 0.0175, .h_base = 4, .total_steps = T, .warmup_steps = W}, lr(0));
///   for (int64_t s = 0; s < T; ++s) {       // s = steps done before this one
///     local_step(lr(s));
///     if (q.after_step(s + 1, lr(s + 1))) average_parameters();
///   }
class QsrScheduler {
 public:
  /// The first period starts at step 0, as if on_average(0, initial_lr) (so H = h_base during
  /// warm-up). Throws InvalidArgument on an invalid config or initial_lr <= 0.
  QsrScheduler(const QsrConfig& cfg, double initial_lr);
  /// Records an averaging after `step` steps done, with the learning rate `lr` that the following
  /// steps use; returns the step count at which the next averaging happens:
  /// min(step + H, total_steps). Throws InvalidArgument (state unchanged) for step outside
  /// [0, total_steps) or a bad lr.
  int64_t on_average(int64_t step, double lr);
  /// Call after each local step with the number of steps done and the next learning rate; returns
  /// true when the parameters must be averaged now (and then schedules the next averaging). The
  /// last averaging is at step == total_steps. Throws InvalidArgument for step outside
  /// [1, total_steps].
  bool after_step(int64_t step, double next_lr);
  int64_t next_sync() const { return next_sync_; }
  /// The period in force after the last on_average().
  int64_t period() const { return period_; }
  const QsrConfig& config() const { return cfg_; }

 private:
  QsrConfig cfg_;
  int64_t next_sync_ = 0;
  int64_t period_ = 0;
};

}  // namespace gradcomp::straggler

// The names of its enums (gradcomp/types.hpp: parse_enum, enum_name).
namespace gradcomp {

template <>
struct EnumNames<straggler::DropPoint> {
  static constexpr const char* what = "drop point";
  static constexpr std::size_t members = 3;
  static constexpr EnumName<straggler::DropPoint> table[] = {
      {"before_forward", straggler::DropPoint::kBeforeForward},
      {"between_forward_backward", straggler::DropPoint::kBetweenForwardBackward},
      {"after_backward", straggler::DropPoint::kAfterBackward}};
};

template <>
struct EnumNames<straggler::StopModel> {
  static constexpr const char* what = "stop model";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<straggler::StopModel> table[] = {
      {"preemptive", straggler::StopModel::kPreemptive},
      {"boundary", straggler::StopModel::kMicroBatchBoundary},
      {"micro_batch_boundary", straggler::StopModel::kMicroBatchBoundary}};
};

template <>
struct EnumNames<straggler::Normalization> {
  static constexpr const char* what = "normalization";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<straggler::Normalization> table[] = {
      {"nominal", straggler::Normalization::kNominal},
      {"actual", straggler::Normalization::kActual}};
};

template <>
struct EnumNames<straggler::DelayKind> {
  static constexpr const char* what = "delay kind";
  static constexpr std::size_t members = 2;
  static constexpr EnumName<straggler::DelayKind> table[] = {
      {"normal", straggler::DelayKind::kNormal},
      {"lognormal", straggler::DelayKind::kBoundedLogNormal},
      {"bounded_lognormal", straggler::DelayKind::kBoundedLogNormal}};
};

}  // namespace gradcomp
