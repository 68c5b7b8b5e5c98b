// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator: collectives over MPI on CPU buffers, each issued nonblocking and polled
// against a deadline, with MPI_ERRORS_RETURN so that failures become exceptions.
//
// The engine provides the primitives of Communicator (allgather, alltoallv, in-place allgatherv,
// broadcast, barrier); the rank-ordered sums are Communicator's (comm/communicator.cpp), never
// MPI_Allreduce's (whose association order is the library's choice).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"

namespace gradcomp {
namespace {

MPI_Datatype mpi_type(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return MPI_FLOAT;
    case ElemType::kF16:
    case ElemType::kBF16:
      return MPI_UINT16_T;
    case ElemType::kU8:
      return MPI_UINT8_T;
    case ElemType::kU32:
      return MPI_UINT32_T;
    case ElemType::kI64:
      return MPI_INT64_T;
  }
  return MPI_BYTE;
}

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return detail::cat("MPI error ", code);
  return std::string(buf, static_cast<size_t>(len));
}

int as_int(size_t v, const char* what) {
  GC_CHECK_ARG(v <= static_cast<size_t>(INT_MAX), what, ": ", v,
               " elements exceed MPI's int count; split the bucket");
  return static_cast<int>(v);
}

}  // namespace

struct MpiCommunicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  double timeout_s = 300.0;
  bool broken = false;
  std::string broken_why;
  Buffer scratch{Device::kCPU};
  std::vector<int> scounts, sdispls, rcounts, rdispls;  // sized once: no allocation per call

  void check_usable(const char* what) const {
    if (broken)
      throw BackendError(detail::cat("MpiCommunicator: ", what,
                                     " called on a broken communicator (", broken_why, ")"));
  }
  void check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    broken = true;
    broken_why = detail::cat("MPI ", what, " failed: ", mpi_error_string(rc));
    throw BackendError(detail::cat("rank ", rank, ": ", broken_why));
  }
  /// Polls `req` until it completes or the deadline passes.
  void wait(MPI_Request& req, const char* what) {
    using clk = std::chrono::steady_clock;
    const auto start = clk::now();
    int flag = 0;
    auto pause = std::chrono::microseconds(0);
    for (int spins = 0;; ++spins) {
      check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), what);
      if (flag) return;
      if (timeout_s > 0 && std::chrono::duration<double>(clk::now() - start).count() > timeout_s) {
        broken = true;
        broken_why = detail::cat("MPI ", what, " did not complete within ", timeout_s,
                                 " s: a peer exited, hung or is far behind");
        // the request cannot be cancelled (MPI has no cancel for collectives): it is leaked
        throw BackendError(
            detail::cat("rank ", rank, ": ", broken_why, "; the communicator is now unusable"));
      }
      // spin first (latency), then back off to at most 1 ms so a long wait does not burn a core
      if (spins > 2000) {
        pause = std::min(pause + std::chrono::microseconds(20), std::chrono::microseconds(1000));
        std::this_thread::sleep_for(pause);
      }
    }
  }
};

bool built_with_mpi() { return true; }

bool mpi_init(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      throw BackendError("MPI_Init_thread failed");
  }
  return true;
}

void mpi_finalize() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Finalize();
}

namespace {
const MPI_Comm kWorld = MPI_COMM_WORLD;  // MPI_COMM_WORLD is not an lvalue in every MPI
}  // namespace

MpiCommunicator::MpiCommunicator(const MpiOptions& opt) : MpiCommunicator(&kWorld, opt) {}

MpiCommunicator::MpiCommunicator(const void* mpi_comm, const MpiOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  int init = 0;
  MPI_Initialized(&init);
  GC_CHECK_ARG(init,
               "MpiCommunicator: MPI is not initialised (call gradcomp::mpi_init() or MPI_Init)");
  GC_CHECK_ARG(mpi_comm != nullptr, "MpiCommunicator: null MPI_Comm pointer");
  Impl& s = *impl_;
  s.timeout_s = opt.timeout_s;
  const MPI_Comm base = *static_cast<const MPI_Comm*>(mpi_comm);
  if (MPI_Comm_dup(base, &s.comm) != MPI_SUCCESS) throw BackendError("MPI_Comm_dup failed");
  MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(s.comm, &s.rank);
  MPI_Comm_size(s.comm, &s.size);
  const auto P = static_cast<size_t>(s.size);
  s.scounts.resize(P);
  s.sdispls.resize(P);
  s.rcounts.resize(P);
  s.rdispls.resize(P);
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::split(int color, int key) {
  check_usable("split");
  MPI_Comm sub = MPI_COMM_NULL;
  if (MPI_Comm_split(impl_->comm, color, key, &sub) != MPI_SUCCESS)
    throw BackendError("MPI_Comm_split failed");
  // the new communicator duplicates `sub`; ours is freed whatever happens
  struct Free {
    MPI_Comm* c;
    ~Free() { MPI_Comm_free(c); }
  } free_sub{&sub};
  return std::make_unique<MpiCommunicator>(&sub, MpiOptions{.timeout_s = impl_->timeout_s});
}

MpiCommunicator::~MpiCommunicator() {
  if (!impl_ || impl_->comm == MPI_COMM_NULL) return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin && !impl_->broken)
    MPI_Comm_free(&impl_->comm);  // a broken one may have pending requests
}

int MpiCommunicator::rank() const { return impl_->rank; }
int MpiCommunicator::size() const { return impl_->size; }
double MpiCommunicator::timeout_seconds() const { return impl_->timeout_s; }
void MpiCommunicator::set_timeout(double seconds) { impl_->timeout_s = seconds; }

void MpiCommunicator::check_usable(const char* what) const { impl_->check_usable(what); }

void MpiCommunicator::do_allgather(const void* send, void* recv, size_t count, ElemType t) {
  Impl& s = *impl_;
  const int n = as_int(count, "allgather");
  auto* r = static_cast<uint8_t*>(recv);
  const void* sb =
      send == r + count * elem_size(t) * static_cast<size_t>(s.rank) ? MPI_IN_PLACE : send;
  MPI_Request req;
  s.check(MPI_Iallgather(sb, n, mpi_type(t), recv, n, mpi_type(t), s.comm, &req), "allgather");
  s.wait(req, "allgather");
}

void MpiCommunicator::do_alltoallv(const void* send, const size_t* scounts, const size_t* sdispls,
                                   void* recv, const size_t* rcounts, const size_t* rdispls,
                                   ElemType t) {
  Impl& s = *impl_;
  for (size_t r = 0; r < static_cast<size_t>(s.size); ++r) {
    s.scounts[r] = as_int(scounts[r], "alltoall");
    s.sdispls[r] = as_int(sdispls[r], "alltoall");
    s.rcounts[r] = as_int(rcounts[r], "alltoall");
    s.rdispls[r] = as_int(rdispls[r], "alltoall");
  }
  MPI_Request req;
  s.check(MPI_Ialltoallv(send, s.scounts.data(), s.sdispls.data(), mpi_type(t), recv,
                         s.rcounts.data(), s.rdispls.data(), mpi_type(t), s.comm, &req),
          "alltoallv");
  s.wait(req, "alltoallv");
}

void MpiCommunicator::do_allgatherv(void* buf, const size_t* counts, const size_t* displs,
                                    ElemType t) {
  Impl& s = *impl_;
  for (size_t r = 0; r < static_cast<size_t>(s.size); ++r) {
    s.rcounts[r] = as_int(counts[r], "allgatherv");
    s.rdispls[r] = as_int(displs[r], "allgatherv");
  }
  MPI_Request req;
  s.check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, s.rcounts.data(),
                          s.rdispls.data(), mpi_type(t), s.comm, &req),
          "allgatherv");
  s.wait(req, "allgatherv");
}

void MpiCommunicator::do_broadcast(const void* send, void* recv, size_t count, ElemType t,
                                   int root) {
  Impl& s = *impl_;
  const int n = as_int(count, "broadcast");
  if (s.rank == root && send != recv && count) std::memcpy(recv, send, count * elem_size(t));
  MPI_Request req;
  s.check(MPI_Ibcast(recv, n, mpi_type(t), root, s.comm, &req), "broadcast");
  s.wait(req, "broadcast");
}

void MpiCommunicator::do_barrier() {
  Impl& s = *impl_;
  MPI_Request req;
  s.check(MPI_Ibarrier(s.comm, &req), "barrier");
  s.wait(req, "barrier");
}

}  // namespace gradcomp
