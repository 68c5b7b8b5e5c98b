// SPDX-License-Identifier: Apache-2.0
// In-process execution of plans in lockstep on one thread: P simulated ranks, collectives done with
// memcpy and the rank-ordered sum of kernels/reduce_kernels.hpp (the one every engine uses). CPU
// buffers only; for ranks on threads or on CUDA buffers use InProcessGroup (inprocess_comm.cpp).
#include <algorithm>
#include <cstring>
#include <exception>

#include "gradcomp/detail/numeric.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/plan.hpp"
#include "kernels/reduce_kernels.hpp"

namespace gradcomp {

namespace {

// memcpy for buffers that may be empty: an empty std::vector or collective buffer may be null, and
// memcpy's pointers must be valid even for 0 bytes.
void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

}  // namespace

namespace {

/// Runs one collective among `members` (ranks' plans), each of which asked for cs[member]; the
/// members must agree (kind, type, count, root). Data moves by memcpy; sums are rank ordered.
void execute_among(const std::vector<Plan*>& ranks,
                   const std::vector<std::optional<Collective>>& cs,
                   const std::vector<size_t>& members) {
  const size_t P = members.size();
  const Collective& c0 = *cs[members[0]];
  for (size_t m = 0; m < P; ++m) {
    const size_t r = members[m];
    const Collective& c = *cs[r];
    GC_CHECK_ARG(c.kind == c0.kind && c.type == c0.type && c.count == c0.count &&
                     c.root == c0.root && c.scope == c0.scope,
                 "plan '", ranks[r]->name(), "': rank ", r, " asks for ", collective_name(c.kind),
                 " of ", c.count, " elements (", scope_name(c.scope), "), rank ", members[0],
                 " for ", collective_name(c0.kind), " of ", c0.count, " (", scope_name(c0.scope),
                 ")");
    GC_CHECK_ARG(c.device == Device::kCPU, "run_plans_in_process runs CPU buffers only");
  }
  const size_t es = elem_size(c0.type), bytes = c0.count * es;
  auto send = [&](size_t m) { return static_cast<const uint8_t*>(cs[members[m]]->send); };
  auto recv = [&](size_t m) { return static_cast<uint8_t*>(cs[members[m]]->recv); };
  switch (c0.kind) {
    case CollectiveKind::kAllreduceSum: {  // the engines' rank-ordered sum (reduce_kernels)
      std::vector<uint8_t> blocks(bytes * P), acc(bytes);
      for (size_t m = 0; m < P; ++m) copy_bytes(blocks.data() + m * bytes, send(m), bytes);
      kernels::cpu::reduce_blocks(blocks.data(), P, c0.count, c0.count, c0.type, acc.data());
      for (size_t m = 0; m < P; ++m) copy_bytes(recv(m), acc.data(), bytes);
      break;
    }
    case CollectiveKind::kAllgather: {
      std::vector<uint8_t> all(bytes * P);
      for (size_t m = 0; m < P; ++m) copy_bytes(all.data() + m * bytes, send(m), bytes);
      for (size_t m = 0; m < P; ++m) copy_bytes(recv(m), all.data(), bytes * P);
      break;
    }
    case CollectiveKind::kAllToAll: {
      std::vector<std::vector<uint8_t>> sends(P);
      for (size_t m = 0; m < P; ++m) sends[m].assign(send(m), send(m) + bytes * P);
      for (size_t dst = 0; dst < P; ++dst)
        for (size_t src = 0; src < P; ++src)
          copy_bytes(recv(dst) + src * bytes, sends[src].data() + dst * bytes, bytes);
      break;
    }
    case CollectiveKind::kBroadcast: {
      GC_CHECK_ARG(c0.root >= 0 && static_cast<size_t>(c0.root) < P, "broadcast root ", c0.root,
                   " out of range");
      std::vector<uint8_t> b(send(static_cast<size_t>(c0.root)),
                             send(static_cast<size_t>(c0.root)) + bytes);
      for (size_t m = 0; m < P; ++m) copy_bytes(recv(m), b.data(), bytes);
      break;
    }
  }
}

}  // namespace

std::vector<Collective> run_plans_in_process(const std::vector<Plan*>& ranks) {
  const size_t P = ranks.size();
  GC_CHECK_ARG(P > 0, "run_plans_in_process: no ranks");
  std::vector<Collective> log;
  std::vector<size_t> all(P);
  for (size_t r = 0; r < P; ++r) all[r] = r;
  for (;;) {
    std::vector<std::optional<Collective>> cs(P);
    // Every rank runs its phase, as ranks of separate processes would, even when one throws:
    // a plan that raises on every rank (OnNonFinite::kRaise) ends its step on each of them, and
    // the first exception is rethrown once all have run.
    std::exception_ptr first;
    for (size_t r = 0; r < P; ++r) {
      try {
        cs[r] = ranks[r]->next();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    const bool done = !cs[0].has_value();
    for (size_t r = 1; r < P; ++r)
      GC_CHECK_ARG(cs[r].has_value() != done, "plan '", ranks[r]->name(), "': rank ", r,
                   (done ? " asks for a collective" : " finished"), " while rank 0 ",
                   (done ? "finished" : "asks for one"));
    if (done) return log;
    GC_CHECK_ARG(cs[0]->scope == Scope::kWorld, "plan '", ranks[0]->name(), "' asks for a ",
                 scope_name(cs[0]->scope),
                 " collective: run it with run_plans_in_process(ranks, "
                 "per_node)");
    execute_among(ranks, cs, all);
    log.push_back(*cs[0]);
  }
}

std::vector<Collective> run_plans_in_process(const std::vector<Plan*>& ranks, int per_node) {
  const size_t P = ranks.size();
  GC_CHECK_ARG(P > 0, "run_plans_in_process: no ranks");
  GC_CHECK_ARG(per_node >= 1 && P % static_cast<size_t>(per_node) == 0, "run_plans_in_process: ", P,
               " ranks do not split into nodes of ", per_node);
  const size_t L = static_cast<size_t>(per_node);
  // the members of rank r's group in each scope, in rank order
  auto group = [&](size_t r, Scope s) {
    std::vector<size_t> m;
    for (size_t q = 0; q < P; ++q)
      if (s == Scope::kWorld || (s == Scope::kNode && q / L == r / L) ||
          (s == Scope::kCross && q % L == r % L))
        m.push_back(q);
    return m;
  };
  std::vector<Collective> log;
  std::vector<std::optional<Collective>> cs(P);
  std::vector<bool> waiting(P, false), finished(P, false);
  std::exception_ptr first;
  for (;;) {
    // every rank that is neither waiting on a collective nor finished runs its next phase (a
    // rank that throws counts as finished; the first exception is rethrown at the end)
    for (size_t r = 0; r < P; ++r) {
      if (waiting[r] || finished[r]) continue;
      try {
        cs[r] = ranks[r]->next();
      } catch (...) {
        if (!first) first = std::current_exception();
        cs[r].reset();
      }
      if (cs[r]) {
        waiting[r] = true;
      } else {
        finished[r] = true;
      }
    }
    if (std::all_of(finished.begin(), finished.end(), [](bool f) { return f; })) break;
    // run every group whose members all wait (the lowest rank's group first)
    bool progressed = false;
    for (size_t r = 0; r < P; ++r) {
      if (!waiting[r]) continue;
      const std::vector<size_t> m = group(r, cs[r]->scope);
      if (m[0] != r) continue;  // each group once, from its lowest rank
      bool ready = true;
      // (a member waiting in another scope, e.g. still in its cross group, is not ready)
      for (size_t q : m) ready = ready && waiting[q] && cs[q]->scope == cs[r]->scope;
      if (!ready) continue;
      execute_among(ranks, cs, m);
      log.push_back(*cs[r]);
      for (size_t q : m) waiting[q] = false;
      progressed = true;
    }
    if (progressed) continue;
    if (first) std::rethrow_exception(first);
    std::string what;
    for (size_t r = 0; r < P; ++r)
      what +=
          detail::cat(r ? "; " : "", "rank ", r, ": ",
                      finished[r] ? std::string("finished")
                                  : detail::cat(collective_name(cs[r]->kind), " of ", cs[r]->count,
                                                " (", scope_name(cs[r]->scope), ")"));
    GC_CHECK_ARG(false, "plan '", ranks[0]->name(), "': the ranks cannot proceed (", what, ")");
  }
  if (first) std::rethrow_exception(first);
  return log;
}

}  // namespace gradcomp
