// SPDX-License-Identifier: Apache-2.0
// CPU-only build: NcclCommunicator exists and its constructors throw "built without CUDA".
#include "gradcomp/comm.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp {

namespace {
[[noreturn]] void no_nccl() { throw_not_built_with_cuda("NcclCommunicator (NCCL)"); }
}  // namespace

struct NcclCommunicator::Impl {};
NcclCommunicator::NcclCommunicator(Communicator&, void*, const NcclOptions&) { no_nccl(); }
NcclCommunicator::NcclCommunicator(void*, void*, const NcclOptions&) { no_nccl(); }
NcclCommunicator::~NcclCommunicator() = default;
int NcclCommunicator::rank() const { no_nccl(); }
int NcclCommunicator::size() const { no_nccl(); }
void* NcclCommunicator::stream() const { no_nccl(); }
double NcclCommunicator::timeout_seconds() const { no_nccl(); }
void NcclCommunicator::synchronize() { no_nccl(); }
void NcclCommunicator::allreduce(const void*, void*, size_t, ElemType, ReduceOp) { no_nccl(); }
void NcclCommunicator::allgather(const void*, void*, size_t, ElemType) { no_nccl(); }
void NcclCommunicator::alltoall(const void*, void*, size_t, ElemType) { no_nccl(); }
void NcclCommunicator::reduce_scatter(const void*, void*, size_t, ElemType, ReduceOp) { no_nccl(); }
void NcclCommunicator::broadcast(const void*, void*, size_t, ElemType, int) { no_nccl(); }
void NcclCommunicator::barrier() { no_nccl(); }

}  // namespace gradcomp
