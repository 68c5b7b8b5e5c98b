// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator: collectives over MPI on CPU buffers, each issued nonblocking and polled
// against a deadline, with MPI_ERRORS_RETURN so that failures become exceptions.
//
// Sums are never left to MPI_Allreduce (whose association order is the library's choice): the
// large-message allreduce is MPI_Ialltoallv of P chunks + a rank-ordered local sum of this rank's
// chunk + MPI_Iallgatherv (2 n (P-1)/P elements sent, like a ring); small messages use one
// allgather of the whole vector and a rank-ordered sum on every rank (one round of latency).
// Both orders are "rank 0 first", so results are bitwise those of run_plans_in_process().
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "kernels/reduce.hpp"

namespace gradcomp {
namespace {

constexpr size_t kSmallAllreduceBytes = 32 * 1024;

MPI_Datatype mpi_type(ElemType t) {
  switch (t) {
    case ElemType::kF32: return MPI_FLOAT;
    case ElemType::kF16: case ElemType::kBF16: return MPI_UINT16_T;
    case ElemType::kU8: return MPI_UINT8_T;
    case ElemType::kU32: return MPI_UINT32_T;
    case ElemType::kI64: return MPI_INT64_T;
  }
  return MPI_BYTE;
}

DType float_dtype(ElemType t, const char* what) {
  GC_CHECK_ARG(t == ElemType::kF32 || t == ElemType::kF16 || t == ElemType::kBF16, what,
               ": a mean needs a floating-point element type");
  return t == ElemType::kF32 ? DType::kFloat32 : t == ElemType::kF16 ? DType::kFloat16
                                                                     : DType::kBFloat16;
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
      throw BackendError(detail::cat("MpiCommunicator: ", what, " called on a broken communicator (",
                                     broken_why, ")"));
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
      if (timeout_s > 0 &&
          std::chrono::duration<double>(clk::now() - start).count() > timeout_s) {
        broken = true;
        broken_why = detail::cat("MPI ", what, " did not complete within ", timeout_s,
                                 " s: a peer exited, hung or is far behind");
        // the request cannot be cancelled (MPI has no cancel for collectives): it is leaked
        throw BackendError(detail::cat("rank ", rank, ": ", broken_why,
                                       "; the communicator is now unusable"));
      }
      // spin first (latency), then back off to at most 1 ms so a long wait does not burn a core
      if (spins > 2000) {
        pause = std::min(pause + std::chrono::microseconds(20), std::chrono::microseconds(1000));
        std::this_thread::sleep_for(pause);
      }
    }
  }
  void account(uint64_t bytes, std::chrono::steady_clock::time_point t0, CommStats& st) {
    st.calls += 1;
    st.bytes_sent += bytes;
    st.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  GC_CHECK_ARG(init, "MpiCommunicator: MPI is not initialised (call gradcomp::mpi_init() or MPI_Init)");
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

MpiCommunicator::~MpiCommunicator() {
  if (!impl_ || impl_->comm == MPI_COMM_NULL) return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin && !impl_->broken) MPI_Comm_free(&impl_->comm);  // a broken one may have pending requests
}

int MpiCommunicator::rank() const { return impl_->rank; }
int MpiCommunicator::size() const { return impl_->size; }
double MpiCommunicator::timeout_seconds() const { return impl_->timeout_s; }
void MpiCommunicator::set_timeout(double seconds) { impl_->timeout_s = seconds; }

void MpiCommunicator::allgather(const void* send, void* recv, size_t count, ElemType t) {
  Impl& s = *impl_;
  s.check_usable("allgather");
  const int n = as_int(count, "allgather");
  const auto t0 = std::chrono::steady_clock::now();
  const size_t bytes = count * elem_size(t);
  auto* r = static_cast<uint8_t*>(recv);
  const void* sb = send == r + bytes * static_cast<size_t>(s.rank) ? MPI_IN_PLACE : send;
  MPI_Request req;
  s.check(MPI_Iallgather(sb, n, mpi_type(t), recv, n, mpi_type(t), s.comm, &req), "allgather");
  s.wait(req, "allgather");
  s.account(bytes * static_cast<uint64_t>(s.size - 1), t0, stats_);
}

void MpiCommunicator::alltoall(const void* send, void* recv, size_t count, ElemType t) {
  Impl& s = *impl_;
  s.check_usable("alltoall");
  GC_CHECK_ARG(send != recv || count == 0, "alltoall: send and recv must be different buffers");
  const int n = as_int(count, "alltoall");
  const auto t0 = std::chrono::steady_clock::now();
  MPI_Request req;
  s.check(MPI_Ialltoall(send, n, mpi_type(t), recv, n, mpi_type(t), s.comm, &req), "alltoall");
  s.wait(req, "alltoall");
  s.account(count * elem_size(t) * static_cast<uint64_t>(s.size - 1), t0, stats_);
}

void MpiCommunicator::broadcast(const void* send, void* recv, size_t count, ElemType t, int root) {
  Impl& s = *impl_;
  s.check_usable("broadcast");
  GC_CHECK_ARG(root >= 0 && root < s.size, "broadcast: root ", root, " is not a rank of 0..",
               s.size - 1);
  const int n = as_int(count, "broadcast");
  const auto t0 = std::chrono::steady_clock::now();
  if (s.rank == root && send != recv && count) std::memcpy(recv, send, count * elem_size(t));
  MPI_Request req;
  s.check(MPI_Ibcast(recv, n, mpi_type(t), root, s.comm, &req), "broadcast");
  s.wait(req, "broadcast");
  s.account(s.rank == root ? count * elem_size(t) : 0, t0, stats_);
}

void MpiCommunicator::barrier() {
  Impl& s = *impl_;
  s.check_usable("barrier");
  const auto t0 = std::chrono::steady_clock::now();
  MPI_Request req;
  s.check(MPI_Ibarrier(s.comm, &req), "barrier");
  s.wait(req, "barrier");
  s.account(0, t0, stats_);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, size_t count, ElemType t,
                                     ReduceOp op) {
  Impl& s = *impl_;
  s.check_usable("reduce_scatter");
  const DType ft = op == ReduceOp::kMean ? float_dtype(t, "reduce_scatter") : DType::kFloat32;
  const int n = as_int(count, "reduce_scatter");
  const auto t0 = std::chrono::steady_clock::now();
  const size_t es = elem_size(t), P = static_cast<size_t>(s.size);
  auto* blocks = s.scratch.get<uint8_t>(count * es * P);
  MPI_Request req;
  s.check(MPI_Ialltoall(send, n, mpi_type(t), blocks, n, mpi_type(t), s.comm, &req),
          "reduce_scatter (alltoall)");
  s.wait(req, "reduce_scatter (alltoall)");
  kernels::cpu::reduce_blocks(blocks, P, count, count, t, recv);
  if (op == ReduceOp::kMean)
    kernels::cpu::convert(recv, ft, recv, ft, static_cast<int64_t>(count), float(s.size));
  s.account(count * es * (P - 1), t0, stats_);
}

void MpiCommunicator::allreduce(const void* send, void* recv, size_t count, ElemType t,
                                ReduceOp op) {
  Impl& s = *impl_;
  s.check_usable("allreduce");
  const DType ft = op == ReduceOp::kMean ? float_dtype(t, "allreduce") : DType::kFloat32;
  as_int(count, "allreduce");
  const auto t0 = std::chrono::steady_clock::now();
  const size_t es = elem_size(t), P = static_cast<size_t>(s.size), bytes = count * es;
  const auto me = static_cast<size_t>(s.rank);
  uint64_t sent = 0;
  if (P == 1 || count == 0) {
    if (send != recv && bytes) std::memcpy(recv, send, bytes);
    if (P > 1) barrier();  // keep the ranks in step even for empty buckets
  } else if (bytes <= kSmallAllreduceBytes || count < P) {
    // one round: everyone gets every vector and sums them in rank order
    auto* blocks = s.scratch.get<uint8_t>(bytes * P);
    MPI_Request req;
    const int n = static_cast<int>(count);
    s.check(MPI_Iallgather(send, n, mpi_type(t), blocks, n, mpi_type(t), s.comm, &req),
            "allreduce (allgather)");
    s.wait(req, "allreduce (allgather)");
    kernels::cpu::reduce_blocks(blocks, P, count, count, t, recv);
    sent = bytes * (P - 1);
  } else {
    // reduce-scatter by all-to-all of chunks + ordered local sum, then allgather of the chunks
    for (size_t r = 0; r < P; ++r) {
      const size_t b = count * r / P, e = count * (r + 1) / P;
      s.scounts[r] = static_cast<int>(e - b);
      s.sdispls[r] = static_cast<int>(b);
    }
    const size_t mine = static_cast<size_t>(s.scounts[me]), my_off = s.sdispls[me];
    for (size_t r = 0; r < P; ++r) {
      s.rcounts[r] = static_cast<int>(mine);
      s.rdispls[r] = static_cast<int>(mine * r);
    }
    auto* blocks = s.scratch.get<uint8_t>(mine * es * P);
    MPI_Request req;
    s.check(MPI_Ialltoallv(send, s.scounts.data(), s.sdispls.data(), mpi_type(t), blocks,
                           s.rcounts.data(), s.rdispls.data(), mpi_type(t), s.comm, &req),
            "allreduce (alltoallv)");
    s.wait(req, "allreduce (alltoallv)");
    auto* out = static_cast<uint8_t*>(recv);
    kernels::cpu::reduce_blocks(blocks, P, mine, mine, t, out + my_off * es);
    s.check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, s.scounts.data(),
                            s.sdispls.data(), mpi_type(t), s.comm, &req),
            "allreduce (allgatherv)");
    s.wait(req, "allreduce (allgatherv)");
    sent = 2 * (bytes - mine * es);
  }
  if (op == ReduceOp::kMean)
    kernels::cpu::convert(recv, ft, recv, ft, static_cast<int64_t>(count), float(s.size));
  s.account(sent, t0, stats_);
}

}  // namespace gradcomp
