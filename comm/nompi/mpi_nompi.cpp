// SPDX-License-Identifier: Apache-2.0
// Build without MPI: MpiCommunicator exists and its constructors throw a clear error.
#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"

namespace gradcomp {

namespace {
[[noreturn]] void no_mpi() {
  throw BackendError("gradcomp was built without MPI (install libopenmpi-dev and reconfigure)");
}
}  // namespace

struct MpiCommunicator::Impl {};
bool built_with_mpi() { return false; }
bool mpi_init(int*, char***) { return false; }
void mpi_finalize() {}
MpiCommunicator::MpiCommunicator(const MpiOptions&) { no_mpi(); }
MpiCommunicator::MpiCommunicator(const void*, const MpiOptions&) { no_mpi(); }
MpiCommunicator::~MpiCommunicator() = default;
std::unique_ptr<MpiCommunicator> MpiCommunicator::split(int, int) { no_mpi(); }
int MpiCommunicator::rank() const { no_mpi(); }
int MpiCommunicator::size() const { no_mpi(); }
double MpiCommunicator::timeout_seconds() const { no_mpi(); }
void MpiCommunicator::set_timeout(double) { no_mpi(); }

void MpiCommunicator::check_usable(const char*) const { no_mpi(); }
void MpiCommunicator::do_allgather(const void*, void*, size_t, ElemType) { no_mpi(); }
void MpiCommunicator::do_alltoallv(const void*, const size_t*, const size_t*, void*, const size_t*,
                                   const size_t*, ElemType) {
  no_mpi();
}
void MpiCommunicator::do_allgatherv(void*, const size_t*, const size_t*, ElemType) { no_mpi(); }
void MpiCommunicator::do_broadcast(const void*, void*, size_t, ElemType, int) { no_mpi(); }
void MpiCommunicator::do_barrier() { no_mpi(); }

}  // namespace gradcomp
