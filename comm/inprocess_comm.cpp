// SPDX-License-Identifier: Apache-2.0
// InProcessGroup: P ranks as threads of one process. The engine's primitives are copies between
// the ranks' buffers; the sums are Communicator's (comm/communicator.cpp), as for MPI and NCCL.
//
// Every primitive is two rendezvous: each rank posts what it offers (its send buffer, counts,
// displacements) and arrives; then each rank pulls what it needs from the peers' posted buffers
// into its own and arrives again, so no rank reuses a buffer or a slot while a peer may still read
// it. A rank never writes into a peer's memory.
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp {
namespace {

enum class Op : int { kAllgather, kAlltoallv, kAllgatherv, kBroadcast, kBarrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllgather:
      return "allgather";
    case Op::kAlltoallv:
      return "all-to-all";
    case Op::kAllgatherv:
      return "allgatherv";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kBarrier:
      return "barrier";
  }
  return "?";
}

}  // namespace

struct InProcessGroup::Shared {
  struct Slot {
    Op op = Op::kBarrier;
    ElemType type = ElemType::kU8;
    size_t count = 0;  // allgather / broadcast count; root for broadcast in `root`
    int root = 0;
    const void* data = nullptr;
    const size_t* counts = nullptr;
    const size_t* displs = nullptr;
  };
  int size = 1;
  Device device = Device::kCPU;
  double timeout_s = 60.0;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool broken = false;
  std::string why;
  std::vector<Slot> slots;

  [[noreturn]] void throw_broken(int rank) const {
    throw BackendError(
        detail::cat("InProcessGroup rank ", rank, ": the group is broken (", why, ")"));
  }
  void check_usable(int rank) {
    std::lock_guard<std::mutex> lk(mu);
    if (broken) throw_broken(rank);
  }
  /// Waits until every rank has arrived (or the deadline passes: the group breaks).
  void arrive(int rank, Op op) {
    std::unique_lock<std::mutex> lk(mu);
    if (broken) throw_broken(rank);
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const auto limit = std::chrono::duration<double>(timeout_s);
    if (!cv.wait_for(lk, limit, [&] { return generation != gen || broken; })) {
      broken = true;
      why = detail::cat(op_name(op), " did not complete within ", timeout_s, " s: rank ", rank,
                        " waited for a rank that did not arrive");
      cv.notify_all();
      throw BackendError(detail::cat("InProcessGroup rank ", rank, ": ", why));
    }
    if (broken) throw_broken(rank);
  }
};

namespace {

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup::Shared& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size; }
  Device device() const override { return g_.device; }
  std::string backend() const override { return "inprocess"; }
  double timeout_seconds() const override { return g_.timeout_s; }

 protected:
  void check_usable(const char*) const override { g_.check_usable(rank_); }

  void do_allgather(const void* send, void* recv, size_t count, ElemType t) override {
    post(Op::kAllgather, t, count, 0, send, nullptr, nullptr);
    const size_t bytes = count * elem_size(t);
    exchange([&](const InProcessGroup::Shared::Slot& s, int r) {
      copy(static_cast<uint8_t*>(recv) + bytes * static_cast<size_t>(r), s.data, bytes);
    });
  }
  void do_alltoallv(const void* send, const size_t* scounts, const size_t* sdispls, void* recv,
                    const size_t* rcounts, const size_t* rdispls, ElemType t) override {
    post(Op::kAlltoallv, t, 0, 0, send, scounts, sdispls);
    const size_t es = elem_size(t);
    exchange([&](const InProcessGroup::Shared::Slot& s, int r) {
      const size_t me = static_cast<size_t>(rank_);
      GC_CHECK(s.counts[me] == rcounts[r], "in-process all-to-all: rank ", r, " sends ",
               s.counts[me], " elements to rank ", rank_, ", which expects ", rcounts[r]);
      copy(static_cast<uint8_t*>(recv) + rdispls[r] * es,
           static_cast<const uint8_t*>(s.data) + s.displs[me] * es, rcounts[r] * es);
    });
  }
  void do_allgatherv(void* buf, const size_t* counts, const size_t* displs, ElemType t) override {
    post(Op::kAllgatherv, t, 0, 0, buf, counts, displs);
    const size_t es = elem_size(t);
    exchange([&](const InProcessGroup::Shared::Slot& s, int r) {
      if (r == rank_) return;  // this rank's chunk is already in place
      copy(static_cast<uint8_t*>(buf) + displs[r] * es,
           static_cast<const uint8_t*>(s.data) + displs[r] * es, counts[r] * es);
    });
  }
  void do_broadcast(const void* send, void* recv, size_t count, ElemType t, int root) override {
    post(Op::kBroadcast, t, count, root, send, nullptr, nullptr);
    exchange([&](const InProcessGroup::Shared::Slot& s, int r) {
      if (r == root && (r != rank_ || send != recv)) copy(recv, s.data, count * elem_size(t));
    });
  }
  void do_barrier() override {
    post(Op::kBarrier, ElemType::kU8, 0, 0, nullptr, nullptr, nullptr);
    exchange([](const InProcessGroup::Shared::Slot&, int) {});
  }

 private:
  void post(Op op, ElemType t, size_t count, int root, const void* data, const size_t* counts,
            const size_t* displs) {
    // the data must be ready before a peer reads it (CUDA: this rank's stream has produced it)
    if (g_.device == Device::kCUDA) cuda::stream_synchronize(stream());
    std::lock_guard<std::mutex> lk(g_.mu);
    g_.slots[static_cast<size_t>(rank_)] = {op, t, count, root, data, counts, displs};
  }
  /// First rendezvous, the agreement check, the pulls, the second rendezvous.
  template <class Pull>
  void exchange(const Pull& pull) {
    const Op op = g_.slots[static_cast<size_t>(rank_)].op;
    g_.arrive(rank_, op);
    const auto& s0 = g_.slots[0];
    std::string disagree;
    for (int r = 1; r < g_.size && disagree.empty(); ++r) {
      const auto& s = g_.slots[static_cast<size_t>(r)];
      if (s.op != s0.op || s.type != s0.type || s.count != s0.count || s.root != s0.root)
        disagree =
            detail::cat("ranks disagree on the collective: rank 0 asks for ", op_name(s0.op),
                        " of ", s0.count, " elements (root ", s0.root, "), rank ", r, " for ",
                        op_name(s.op), " of ", s.count, " elements (root ", s.root, ")");
    }
    std::string failed;
    if (disagree.empty()) {
      try {
        for (int r = 0; r < g_.size; ++r) pull(g_.slots[static_cast<size_t>(r)], r);
        if (g_.device == Device::kCUDA) cuda::stream_synchronize(stream());
      } catch (const std::exception& e) {
        failed = e.what();
      }
    }
    g_.arrive(rank_, op);  // every rank arrives before any throws: no slot is reused early
    if (!disagree.empty()) throw InvalidArgument(disagree);
    if (!failed.empty())
      throw BackendError(detail::cat("InProcessGroup rank ", rank_, ": ", failed));
  }
  void copy(void* dst, const void* src, size_t bytes) {
    if (bytes && dst != src) device_copy(dst, g_.device, src, g_.device, bytes, stream());
  }

  InProcessGroup::Shared& g_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int size, Device device, double timeout_s)
    : shared_(std::make_unique<Shared>()) {
  GC_CHECK_ARG(size >= 1, "InProcessGroup: size must be at least 1, got ", size);
  GC_CHECK_ARG(timeout_s > 0, "InProcessGroup: timeout_s must be positive, got ", timeout_s);
  if (device == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda("InProcessGroup on CUDA buffers");
  shared_->size = size;
  shared_->device = device;
  shared_->timeout_s = timeout_s;
  shared_->slots.resize(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    comms_.push_back(std::make_unique<InProcessCommunicator>(*shared_, r));
}

InProcessGroup::~InProcessGroup() = default;

Communicator& InProcessGroup::comm(int rank) {
  GC_CHECK_ARG(rank >= 0 && rank < size(), "InProcessGroup::comm: rank ", rank,
               " is not a rank of 0..", size() - 1);
  return *comms_[static_cast<size_t>(rank)];
}

}  // namespace gradcomp
