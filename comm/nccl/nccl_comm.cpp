// SPDX-License-Identifier: Apache-2.0
// NcclCommunicator: collectives over NCCL on CUDA buffers, stream-ordered on the caller's stream.
// Init is non-blocking (ncclCommInitRankConfig with blocking = 0) and polled against a deadline;
// a collective that does not finish in time aborts the communicator (ncclCommAbort), which
// unblocks the stream, and throws BackendError.
//
// Rank-ordered sums (default): grouped ncclSend/ncclRecv of P chunks (an all-to-all), the
// rank-ordered sum kernel of kernels/reduce.hpp on this rank's chunk, then grouped ncclBroadcast
// of every rank's chunk (an allgather of uneven chunks): bitwise the MPI driver's result.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce.hpp"

namespace gradcomp {
namespace {

ncclDataType_t nccl_type(ElemType t) {
  switch (t) {
    case ElemType::kF32: return ncclFloat32;
    case ElemType::kF16: return ncclFloat16;
    case ElemType::kBF16: return ncclBfloat16;
    case ElemType::kU8: return ncclUint8;
    case ElemType::kU32: return ncclUint32;
    case ElemType::kI64: return ncclInt64;
  }
  return ncclUint8;
}

DType float_dtype(ElemType t, const char* what) {
  GC_CHECK_ARG(t == ElemType::kF32 || t == ElemType::kF16 || t == ElemType::kBF16, what,
               ": a mean needs a floating-point element type");
  return t == ElemType::kF32 ? DType::kFloat32 : t == ElemType::kF16 ? DType::kFloat16
                                                                     : DType::kBFloat16;
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
  void finish(const char* what, uint64_t bytes, clk::time_point t0, CommStats& st) {
    if (opt.synchronous) drain(what);
    st.calls += 1;
    st.bytes_sent += bytes;
    st.seconds += std::chrono::duration<double>(clk::now() - t0).count();
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
    for (int i = 0; i < 100000 && st == ncclInProgress; ++i) ncclCommGetAsyncError(impl_->comm, &st);
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

void NcclCommunicator::allgather(const void* send, void* recv, size_t count, ElemType t) {
  Impl& s = *impl_;
  s.check_usable("allgather");
  const auto t0 = clk::now();
  s.settle(ncclAllGather(send, recv, count, nccl_type(t), s.comm, s.stream), "allgather");
  s.finish("allgather", count * elem_size(t) * uint64_t(s.size - 1), t0, stats_);
}

void NcclCommunicator::broadcast(const void* send, void* recv, size_t count, ElemType t,
                                 int root) {
  Impl& s = *impl_;
  s.check_usable("broadcast");
  GC_CHECK_ARG(root >= 0 && root < s.size, "broadcast: root ", root, " is not a rank of 0..",
               s.size - 1);
  const auto t0 = clk::now();
  s.settle(ncclBroadcast(send, recv, count, nccl_type(t), root, s.comm, s.stream), "broadcast");
  s.finish("broadcast", s.rank == root ? count * elem_size(t) : 0, t0, stats_);
}

void NcclCommunicator::alltoall(const void* send, void* recv, size_t count, ElemType t) {
  Impl& s = *impl_;
  s.check_usable("alltoall");
  GC_CHECK_ARG(send != recv || count == 0, "alltoall: send and recv must be different buffers");
  const auto t0 = clk::now();
  const size_t bytes = count * elem_size(t);
  ncclGroupStart();
  for (int r = 0; r < s.size; ++r) {
    ncclSend(static_cast<const uint8_t*>(send) + bytes * r, count, nccl_type(t), r, s.comm, s.stream);
    ncclRecv(static_cast<uint8_t*>(recv) + bytes * r, count, nccl_type(t), r, s.comm, s.stream);
  }
  s.settle(ncclGroupEnd(), "alltoall");
  s.finish("alltoall", bytes * uint64_t(s.size - 1), t0, stats_);
}

void NcclCommunicator::barrier() {
  Impl& s = *impl_;
  s.check_usable("barrier");
  const auto t0 = clk::now();
  auto* one = s.scratch.get<float>(1);
  s.settle(ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, s.comm, s.stream), "barrier");
  s.drain("barrier");
  s.finish("barrier", 0, t0, stats_);
}

void NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t count, ElemType t,
                                      ReduceOp op) {
  Impl& s = *impl_;
  s.check_usable("reduce_scatter");
  const DType ft = op == ReduceOp::kMean ? float_dtype(t, "reduce_scatter") : DType::kFloat32;
  const auto t0 = clk::now();
  const size_t es = elem_size(t), P = static_cast<size_t>(s.size);
  if (s.opt.ordered_sum) {
    auto* blocks = s.scratch.get<uint8_t>(count * es * P);
    ncclGroupStart();
    for (int r = 0; r < s.size; ++r) {
      ncclSend(static_cast<const uint8_t*>(send) + count * es * r, count, nccl_type(t), r, s.comm,
               s.stream);
      ncclRecv(blocks + count * es * r, count, nccl_type(t), r, s.comm, s.stream);
    }
    s.settle(ncclGroupEnd(), "reduce_scatter (alltoall)");
    kernels::cuda::reduce_blocks(blocks, P, count, count, t, recv, s.stream);
  } else {
    s.settle(ncclReduceScatter(send, recv, count, nccl_type(t), ncclSum, s.comm, s.stream),
             "reduce_scatter");
  }
  if (op == ReduceOp::kMean)
    kernels::cuda::convert(recv, ft, recv, ft, int64_t(count), float(s.size), s.stream);
  s.finish("reduce_scatter", count * es * (P - 1), t0, stats_);
}

void NcclCommunicator::allreduce(const void* send, void* recv, size_t count, ElemType t,
                                 ReduceOp op) {
  Impl& s = *impl_;
  s.check_usable("allreduce");
  const DType ft = op == ReduceOp::kMean ? float_dtype(t, "allreduce") : DType::kFloat32;
  const auto t0 = clk::now();
  const size_t es = elem_size(t), P = static_cast<size_t>(s.size), bytes = count * es;
  const auto ty = nccl_type(t);
  if (P == 1 || count == 0) {
    if (send != recv && bytes)
      GC_CHECK(cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDefault, s.stream) == cudaSuccess);
  } else if (s.opt.ordered_sum) {
    const size_t me = static_cast<size_t>(s.rank);
    const size_t my_b = count * me / P, mine = count * (me + 1) / P - my_b;
    auto* blocks = s.scratch.get<uint8_t>(mine * es * P);
    const auto* in = static_cast<const uint8_t*>(send);
    auto* out = static_cast<uint8_t*>(recv);
    ncclGroupStart();
    for (size_t r = 0; r < P; ++r) {
      const size_t b = count * r / P, e = count * (r + 1) / P;
      ncclSend(in + b * es, e - b, ty, int(r), s.comm, s.stream);
      ncclRecv(blocks + mine * es * r, mine, ty, int(r), s.comm, s.stream);
    }
    s.settle(ncclGroupEnd(), "allreduce (alltoall)");
    kernels::cuda::reduce_blocks(blocks, P, mine, mine, t, out + my_b * es, s.stream);
    ncclGroupStart();
    for (size_t r = 0; r < P; ++r) {
      const size_t b = count * r / P, e = count * (r + 1) / P;
      ncclBroadcast(out + b * es, out + b * es, e - b, ty, int(r), s.comm, s.stream);
    }
    s.settle(ncclGroupEnd(), "allreduce (allgather)");
  } else {
    s.settle(ncclAllReduce(send, recv, count, ty, ncclSum, s.comm, s.stream), "allreduce");
  }
  if (op == ReduceOp::kMean)
    kernels::cuda::convert(recv, ft, recv, ft, int64_t(count), float(s.size), s.stream);
  s.finish("allreduce", P > 1 ? 2 * bytes * (P - 1) / P : 0, t0, stats_);
}

}  // namespace gradcomp
