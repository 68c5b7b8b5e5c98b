// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: collectives over NCCL on CUDA buffers, stream-ordered on the caller's stream.
// Init is non-blocking (ncclCommInitRankConfig with blocking = 0) and polled against a deadline;
// a collective that does not finish in time aborts the communicator (ncclCommAbort), which
// unblocks the stream, and throws BackendError.
//
// The engine provides the primitives of Communicator: grouped ncclSend/ncclRecv (all-to-all of
// uneven chunks), grouped ncclBroadcast (allgather of uneven chunks), ncclAllGather, ncclBroadcast.
// The rank-ordered sums (default) are Communicator's, bitwise the MPI engine's result; with
// NcclOptions::ordered_sum = false, ncclAllReduce / ncclReduceScatter sum in NCCL's order.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp {
namespace {

ncclDataType_t nccl_type(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return ncclFloat32;
    case ElemType::kF16:
      return ncclFloat16;
    case ElemType::kBF16:
      return ncclBfloat16;
    case ElemType::kU8:
      return ncclUint8;
    case ElemType::kU32:
      return ncclUint32;
    case ElemType::kI64:
      return ncclInt64;
  }
  return ncclUint8;
}

using clk = std::chrono::steady_clock;

}  // namespace

struct NcclCommunicator::Impl {
  ncclComm_t comm = nullptr;
  bool owned = false;
  cudaStream_t stream = nullptr;
  int rank = 0, size = 1;
  NcclOptions opt;
  bool broken = false;
  std::string broken_why;
  Buffer scratch{Device::kCUDA};

  void check_usable(const char* what) const {
    if (broken)
      throw BackendError(detail::cat("NcclCommunicator: ", what,
                                     " called on a broken communicator (", broken_why, ")"));
  }
  [[noreturn]] void fail(const std::string& why) {
    broken = true;
    broken_why = why;
    if (comm) ncclCommAbort(comm);  // unblocks kernels waiting on a dead peer
    comm = nullptr;
    throw BackendError(detail::cat("rank ", rank, ": ", why));
  }
  bool past(clk::time_point start) const {
    return opt.timeout_s > 0 &&
           std::chrono::duration<double>(clk::now() - start).count() > opt.timeout_s;
  }
  /// Waits until the communicator is no longer "in progress" (non-blocking NCCL).
  void settle(ncclResult_t rc, const char* what) {
    const auto start = clk::now();
    while (rc == ncclInProgress) {
      if (past(start))
        fail(detail::cat("NCCL ", what, " did not complete within ", opt.timeout_s, " s"));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      ncclCommGetAsyncError(comm, &rc);
    }
    if (rc != ncclSuccess)
      fail(detail::cat("NCCL ", what, " failed: ", ncclGetErrorString(rc),
                       comm ? detail::cat(" (", ncclGetLastError(comm), ")") : std::string()));
  }
  /// Polls the stream and NCCL's async error until the stream is idle or the deadline passes.
  void drain(const char* what) {
    const auto start = clk::now();
    for (int spins = 0;; ++spins) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady)
        fail(detail::cat("CUDA error during NCCL ", what, ": ", cudaGetErrorString(q)));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        fail(detail::cat("NCCL ", what, " failed: ", ncclGetErrorString(async)));
      if (past(start))
        fail(detail::cat("NCCL ", what, " did not complete within ", opt.timeout_s,
                         " s: a peer exited or hung; the communicator was aborted"));
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
};

NcclCommunicator::NcclCommunicator(Communicator& bootstrap, void* stream, const NcclOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  GC_CHECK_ARG(bootstrap.device() == Device::kCPU,
               "NcclCommunicator: the bootstrap communicator must work on CPU buffers (MPI), got ",
               bootstrap.backend());
  Impl& s = *impl_;
  s.opt = opt;
  s.stream = static_cast<cudaStream_t>(stream);
  s.rank = bootstrap.rank();
  s.size = bootstrap.size();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (s.rank == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess)
      throw BackendError(detail::cat("ncclGetUniqueId failed: ", ncclGetErrorString(rc)));
  }
  bootstrap.broadcast(&id, &id, sizeof id, ElemType::kU8, 0);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t rc = ncclCommInitRankConfig(&s.comm, s.size, id, s.rank, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    s.comm = nullptr;
    throw BackendError(detail::cat("ncclCommInitRankConfig failed: ", ncclGetErrorString(rc)));
  }
  s.owned = true;
  s.settle(rc, "communicator init");
  s.scratch.set_stream(stream);
}

NcclCommunicator::NcclCommunicator(void* nccl_comm, void* stream, const NcclOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  GC_CHECK_ARG(nccl_comm != nullptr, "NcclCommunicator: null ncclComm_t");
  Impl& s = *impl_;
  s.opt = opt;
  s.comm = static_cast<ncclComm_t>(nccl_comm);
  s.stream = static_cast<cudaStream_t>(stream);
  int n = 0, r = 0;
  if (ncclCommCount(s.comm, &n) != ncclSuccess || ncclCommUserRank(s.comm, &r) != ncclSuccess)
    throw BackendError("NcclCommunicator: ncclCommCount/ncclCommUserRank failed on the given comm");
  s.size = n;
  s.rank = r;
  s.scratch.set_stream(stream);
}

NcclCommunicator::~NcclCommunicator() {
  if (!impl_) return;
  try {
    impl_->scratch.release();
  } catch (...) {
  }
  if (impl_->owned && impl_->comm) {
    cudaStreamSynchronize(impl_->stream);
    ncclCommFinalize(impl_->comm);
    ncclResult_t st = ncclInProgress;
    for (int i = 0; i < 100000 && st == ncclInProgress; ++i)
      ncclCommGetAsyncError(impl_->comm, &st);
    if (st == ncclSuccess)
      ncclCommDestroy(impl_->comm);
    else
      ncclCommAbort(impl_->comm);
  }
}

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::size() const { return impl_->size; }
void* NcclCommunicator::stream() const { return impl_->stream; }
double NcclCommunicator::timeout_seconds() const { return impl_->opt.timeout_s; }
void NcclCommunicator::synchronize() {
  impl_->check_usable("synchronize");
  impl_->drain("synchronize");
}

void NcclCommunicator::check_usable(const char* what) const { impl_->check_usable(what); }

void NcclCommunicator::complete(const char* what) {
  if (impl_->opt.synchronous) impl_->drain(what);
}

void NcclCommunicator::do_allgather(const void* send, void* recv, size_t count, ElemType t) {
  Impl& s = *impl_;
  s.settle(ncclAllGather(send, recv, count, nccl_type(t), s.comm, s.stream), "allgather");
}

void NcclCommunicator::do_broadcast(const void* send, void* recv, size_t count, ElemType t,
                                    int root) {
  Impl& s = *impl_;
  s.settle(ncclBroadcast(send, recv, count, nccl_type(t), root, s.comm, s.stream), "broadcast");
}

void NcclCommunicator::do_alltoallv(const void* send, const size_t* scounts, const size_t* sdispls,
                                    void* recv, const size_t* rcounts, const size_t* rdispls,
                                    ElemType t) {
  Impl& s = *impl_;
  const size_t es = elem_size(t);
  const auto ty = nccl_type(t);
  ncclGroupStart();
  for (int r = 0; r < s.size; ++r) {
    ncclSend(static_cast<const uint8_t*>(send) + sdispls[r] * es, scounts[r], ty, r, s.comm,
             s.stream);
    ncclRecv(static_cast<uint8_t*>(recv) + rdispls[r] * es, rcounts[r], ty, r, s.comm, s.stream);
  }
  s.settle(ncclGroupEnd(), "alltoallv");
}

void NcclCommunicator::do_allgatherv(void* buf, const size_t* counts, const size_t* displs,
                                     ElemType t) {
  // an allgather of uneven chunks: one broadcast per rank, grouped
  Impl& s = *impl_;
  const size_t es = elem_size(t);
  auto* b = static_cast<uint8_t*>(buf);
  ncclGroupStart();
  for (int r = 0; r < s.size; ++r)
    ncclBroadcast(b + displs[r] * es, b + displs[r] * es, counts[r], nccl_type(t), r, s.comm,
                  s.stream);
  s.settle(ncclGroupEnd(), "allgatherv");
}

void NcclCommunicator::do_barrier() {
  Impl& s = *impl_;
  auto* one = s.scratch.get<float>(1);
  s.settle(ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, s.comm, s.stream), "barrier");
  s.drain("barrier");
}

bool NcclCommunicator::do_native_sum(const void* send, void* recv, size_t count, ElemType t,
                                     bool scatter) {
  Impl& s = *impl_;
  if (s.opt.ordered_sum) return false;
  if (scatter)
    s.settle(ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, s.comm, s.stream),
             "reduce_scatter");
  else
    s.settle(ncclAllReduce(send, recv, count, nccl_type(t), ncclSum, s.comm, s.stream),
             "allreduce");
  return true;
}

}  // namespace gradcomp
