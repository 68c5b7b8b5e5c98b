// SPDX-License-Identifier: Apache-2.0
// In-process execution of plans in lockstep on one thread: P simulated ranks, collectives done with
// memcpy and the rank-ordered sum of kernels/reduce_kernels.hpp (the one every engine uses). CPU
// buffers only; for ranks on threads or on CUDA buffers use InProcessGroup (inprocess_comm.cpp).
#include <cstring>
#include <exception>

#include "gradcomp/detail/numeric.hpp"
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

std::vector<Collective> run_plans_in_process(const std::vector<Plan*>& ranks) {
  const size_t P = ranks.size();
  GC_CHECK_ARG(P > 0, "run_plans_in_process: no ranks");
  std::vector<Collective> log;
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
    const Collective& c0 = *cs[0];
    for (size_t r = 0; r < P; ++r) {
      const Collective& c = *cs[r];
      GC_CHECK_ARG(
          c.kind == c0.kind && c.type == c0.type && c.count == c0.count && c.root == c0.root,
          "plan '", ranks[r]->name(), "': rank ", r, " asks for ", collective_name(c.kind), " of ",
          c.count, " elements, rank 0 for ", collective_name(c0.kind), " of ", c0.count);
      GC_CHECK_ARG(c.device == Device::kCPU, "run_plans_in_process runs CPU buffers only");
    }
    const size_t es = elem_size(c0.type), bytes = c0.count * es;
    switch (c0.kind) {
      case CollectiveKind::kAllreduceSum: {  // the engines' rank-ordered sum (reduce_kernels)
        std::vector<uint8_t> blocks(bytes * P), acc(bytes);
        for (size_t r = 0; r < P; ++r) copy_bytes(blocks.data() + r * bytes, cs[r]->send, bytes);
        kernels::cpu::reduce_blocks(blocks.data(), P, c0.count, c0.count, c0.type, acc.data());
        for (size_t r = 0; r < P; ++r) copy_bytes(cs[r]->recv, acc.data(), bytes);
        break;
      }
      case CollectiveKind::kAllgather: {
        std::vector<uint8_t> all(bytes * P);
        for (size_t r = 0; r < P; ++r) copy_bytes(all.data() + r * bytes, cs[r]->send, bytes);
        for (size_t r = 0; r < P; ++r) copy_bytes(cs[r]->recv, all.data(), bytes * P);
        break;
      }
      case CollectiveKind::kAllToAll: {
        std::vector<std::vector<uint8_t>> sends(P);
        for (size_t r = 0; r < P; ++r) {
          const auto* s = static_cast<const uint8_t*>(cs[r]->send);
          sends[r].assign(s, s + bytes * P);
        }
        for (size_t dst = 0; dst < P; ++dst)
          for (size_t src = 0; src < P; ++src)
            copy_bytes(static_cast<uint8_t*>(cs[dst]->recv) + src * bytes,
                       sends[src].data() + dst * bytes, bytes);
        break;
      }
      case CollectiveKind::kBroadcast: {
        GC_CHECK_ARG(c0.root >= 0 && static_cast<size_t>(c0.root) < P, "broadcast root ", c0.root,
                     " out of range");
        std::vector<uint8_t> b(static_cast<const uint8_t*>(cs[c0.root]->send),
                               static_cast<const uint8_t*>(cs[c0.root]->send) + bytes);
        for (size_t r = 0; r < P; ++r) copy_bytes(cs[r]->recv, b.data(), bytes);
        break;
      }
    }
    log.push_back(c0);
  }
}

}  // namespace gradcomp
