// SPDX-License-Identifier: Apache-2.0
// A build without NCCL: NcclCommunicator exists and throws. Without CUDA the message says
// "built without CUDA"; with CUDA but no NCCL found at configure time (GRADCOMP_CUDA_NO_NCCL,
// set by cmake/comm.cmake) it says "built without NCCL".
#include "gradcomp/comm.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp {

namespace {
#ifdef GRADCOMP_CUDA_NO_NCCL
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif
[[noreturn]] void no_nccl() { throw_not_built_with_nccl("NcclCommunicator", kCudaBuilt); }
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

void NcclCommunicator::check_usable(const char*) const { no_nccl(); }
void NcclCommunicator::do_allgather(const void*, void*, size_t, ElemType) { no_nccl(); }
void NcclCommunicator::do_alltoallv(const void*, const size_t*, const size_t*, void*, const size_t*,
                                    const size_t*, ElemType) {
  no_nccl();
}
void NcclCommunicator::do_allgatherv(void*, const size_t*, const size_t*, ElemType) { no_nccl(); }
void NcclCommunicator::do_broadcast(const void*, void*, size_t, ElemType, int) { no_nccl(); }
void NcclCommunicator::do_barrier() { no_nccl(); }
bool NcclCommunicator::do_native_sum(const void*, void*, size_t, ElemType, bool) { no_nccl(); }
void NcclCommunicator::complete(const char*) { no_nccl(); }

}  // namespace gradcomp
