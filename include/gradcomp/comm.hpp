// SPDX-License-Identifier: Apache-2.0
// Communicators: the engines that execute the collectives of a Plan (plan.hpp). One interface,
// implementations over MPI (CPU buffers), NCCL (CUDA buffers) and threads of one process
// (InProcessGroup, CPU or CUDA buffers), and the driver loop run_plan().
//
// Example (4 ranks under mpirun, plain averaged allreduce of a CPU gradient):
//   gradcomp::MpiCommunicator comm;                       // MPI_COMM_WORLD, MPI initialised
//   gradcomp::DenseAllreducePlan plan(grad.size(), gradcomp::DType::kFloat32, comm.size());
//   plan.begin(gradcomp::TensorView::cpu(grad.data(), grad.size()));
//   gradcomp::run_plan(plan, comm);                       // grad now holds the average
//
// Determinism: every allreduce / reduce-scatter of this layer sums in rank order (rank 0 first),
// element by element, whatever the engine. The engines' own reductions (MPI_Allreduce,
// ncclAllReduce) do not promise an order, so the engines provide data movement only (all-to-all,
// allgather, broadcast) and the sum is written once, in Communicator (comm/communicator.cpp): every
// rank ends with the same bits, equal to run_plans_in_process().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/cost_model.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/workspace.hpp"

namespace gradcomp {

enum class ReduceOp : uint8_t { kSum = 0, kMean = 1 };

/// What a communicator did since construction (or reset_stats()).
struct CommStats {
  uint64_t calls = 0;       ///< collectives executed
  uint64_t bytes_sent = 0;  ///< bytes this rank put on the wire (by the algorithm used)
  double seconds = 0.0;     ///< wall time spent inside collectives (host view)
};

/// A communicator is two layers:
///  - the collectives below (public, the same for every engine): argument checks, statistics,
///    and the rank-ordered sums. allreduce and reduce_scatter are written once, here, over the
///    engine's primitives: an all-to-all of chunks, a rank-ordered local sum of this rank's chunk
///    (kernels/reduce_kernels.hpp, on device()), then an allgather of the chunks (2 n (P-1)/P
///    elements sent per rank, like a ring); vectors of at most 32 KiB take one allgather of the
///    whole vector and a rank-ordered sum on every rank (one round of latency). Every rank
///    therefore ends with the same bits, equal to run_plans_in_process(), whatever the engine.
///  - the engine's primitives (protected, below): move bytes, never sum. An engine must execute
///    them the same on every rank, accept buffers on device() only, and turn a failed or
///    vanished peer into gradcomp::BackendError within timeout_seconds() instead of hanging;
///    after such an error it is broken and every call throws (check_usable).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Where the buffers of its collectives live.
  virtual Device device() const = 0;
  /// The CUDA stream collectives are ordered on (nullptr for CPU communicators).
  virtual void* stream() const { return nullptr; }
  /// "mpi", "nccl", ...
  virtual std::string backend() const = 0;
  virtual double timeout_seconds() const = 0;

  /// recv[i] = sum (or mean) over ranks, in rank order, of send[i]; count elements. In place
  /// when send == recv. Mean divides the sum by size() (fp32/fp16/bf16 only).
  void allreduce(const void* send, void* recv, size_t count, ElemType t, ReduceOp op);
  /// recv = concat over ranks of send (count elements each).
  void allgather(const void* send, void* recv, size_t count, ElemType t);
  /// send holds size() blocks of count elements; block r goes to rank r; recv block r comes
  /// from rank r.
  void alltoall(const void* send, void* recv, size_t count, ElemType t);
  /// send holds size() blocks of count elements; recv (count elements) = rank-ordered sum (or
  /// mean) over ranks of block rank().
  void reduce_scatter(const void* send, void* recv, size_t count, ElemType t, ReduceOp op);
  /// recv on every rank = send of `root` (send is read on root only; may equal recv).
  void broadcast(const void* send, void* recv, size_t count, ElemType t, int root);
  void barrier();

  /// Allgather of byte strings of different lengths: one length exchange, then an allgather
  /// padded to the longest. On return `sizes[r]` is rank r's length and its bytes start at
  /// recv.data() + r * stride (returned). recv is grown as needed (on device()).
  ///
  /// Example:  std::vector<uint64_t> sizes;  Buffer all(comm.device());
  ///           size_t stride = comm.allgather_varying(p.data(), p.size(), all, sizes);
  size_t allgather_varying(const void* send, size_t nbytes, Buffer& recv,
                           std::vector<uint64_t>& sizes);

  /// Executes one collective of a plan (the vocabulary of plan.hpp).
  void execute(const Collective& c);

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }

 protected:
  // The engine's primitives: bytes only, no sums. Counts and displacements are in elements,
  // size() entries each. Called only with size() > 1, after check_usable().
  /// recv = concat over ranks of send (count elements each).
  virtual void do_allgather(const void* send, void* recv, size_t count, ElemType t) = 0;
  /// Sends send[sdispls[r], +scounts[r]) to rank r and receives rank r's part into
  /// recv[rdispls[r], +rcounts[r]); send and recv do not overlap.
  virtual void do_alltoallv(const void* send, const size_t* scounts, const size_t* sdispls,
                            void* recv, const size_t* rcounts, const size_t* rdispls,
                            ElemType t) = 0;
  /// In place: buf[displs[r], +counts[r]) of rank r is copied to every rank.
  virtual void do_allgatherv(void* buf, const size_t* counts, const size_t* displs, ElemType t) = 0;
  /// recv = root's send on every rank (root copies send to recv itself when they differ).
  virtual void do_broadcast(const void* send, void* recv, size_t count, ElemType t, int root) = 0;
  virtual void do_barrier() = 0;
  /// An engine's own (faster, unordered) sum, when it is configured to use one: issues it
  /// (allreduce of count elements, or reduce-scatter to count elements when `scatter`) and
  /// returns true; false (the default) = the rank-ordered algorithm of this class.
  virtual bool do_native_sum(const void* /*send*/, void* /*recv*/, size_t /*count*/, ElemType /*t*/,
                             bool /*scatter*/) {
    return false;
  }
  /// Throws BackendError when the communicator is broken.
  virtual void check_usable(const char* /*what*/) const {}
  /// Called at the end of every collective (NCCL: waits for the stream when synchronous).
  virtual void complete(const char* /*what*/) {}

  CommStats stats_;
  Buffer varying_send_{Device::kCPU}, varying_sizes_{Device::kCPU};

 private:
  /// The rank-ordered sum into recv (count > 0, size() > 1); returns the bytes this rank sent.
  uint64_t ordered_allreduce(const void* send, void* recv, size_t count, ElemType t);
  /// Device scratch of at least `bytes` (on device(), ordered on stream()).
  uint8_t* scratch(size_t bytes);
  /// Counts and displacements of `P` equal blocks of `count`, or of the P chunks of `count`.
  void plan_chunks(size_t count, bool equal_blocks);
  void account(uint64_t bytes, std::chrono::steady_clock::time_point t0);
  Buffer scratch_{Device::kCPU};
  std::vector<size_t> scounts_, sdispls_, rcounts_, rdispls_;
};

/// Times a small and a large allgather on `comm` (collective: every rank must call it) and fits
/// latency and bandwidth. The values are rank 0's, broadcast, so that every rank makes the same
/// choices from them.
///
/// Example:  gradcomp::CostModel cm = gradcomp::measure_cost_model(comm);
CostModel measure_cost_model(Communicator& comm, size_t large_bytes = size_t{4} << 20);

/// How run_plan checks that all ranks run the same plan on the same sizes.
enum class Handshake : uint8_t {
  kNone = 0,   ///< trust the caller
  kFirst = 1,  ///< one tiny allgather before the plan's first collective (bucket size, kind,
               ///< element type, count): a mismatch throws on every rank with both sizes
  kEvery = 2,  ///< the same before every collective of the plan
};

// Plan::bucket_numel() (plan.hpp): plans that know the size of their bucket expose it for the
// handshake.

/// Drives a plan to completion on a communicator: while (auto c = plan.next()) comm.execute(*c).
/// With a handshake, a disagreement between ranks (bucket sizes, collective kind, element type,
/// count, one rank finished early) throws InvalidArgument on every rank, naming rank 0's value
/// and the other rank's, before any mismatched collective is issued. Returns the collectives
/// executed. A bucket plan's skipped() then says whether the step was skipped (a NaN/Inf on some
/// rank: the average is NaN on every rank, no state changed); settle_step() (plan.hpp) ends a
/// step over several buckets.
///
/// Example:  plan.begin(grad);  gradcomp::run_plan(plan, comm);
std::vector<Collective> run_plan(Plan& plan, Communicator& comm,
                                 Handshake handshake = Handshake::kFirst);

/// Drives a hierarchical plan (make_hierarchical_plan, gradcomp/make_plan.hpp) to completion: its
/// Scope::kNode collectives on `node` (the ranks of this rank's node, in local rank order) and
/// its Scope::kCross collectives on `cross` (the ranks of this rank's local rank on every node,
/// in node order); a flat (Scope::kWorld) collective is an InvalidArgument. With MPI the two
/// come from MPI_Comm_split (color = node, key = rank; color = local rank, key = rank), wrapped
/// by MpiCommunicator(&comm, opt); with NCCL, from ncclCommSplit or a bootstrap per group. The
/// handshake runs on each communicator before its first collective (bucket sizes, then each
/// collective as `handshake` says). Returns the collectives executed.
///
/// Example:  plan->begin(grad);  gradcomp::run_plan(*plan, node, cross);
std::vector<Collective> run_plan(Plan& plan, Communicator& node, Communicator& cross,
                                 Handshake handshake = Handshake::kFirst);

/// Runs plans over one communicator, checking each bucket's sizes once: the first time a bucket
/// id is seen it runs with Handshake::kEvery, afterwards with none (the per-step cost is then
/// only the plan's own collectives).
///
/// Example:  gradcomp::PlanRunner runner(comm);
///           for (step...) { plan.begin(grad); runner.run(plan, /*bucket=*/0); }
class PlanRunner {
 public:
  explicit PlanRunner(Communicator& comm) : comm_(comm) {}
  void run(Plan& plan, uint64_t bucket_id);
  Communicator& comm() { return comm_; }

 private:
  Communicator& comm_;
  std::vector<uint64_t> verified_;
};

// ---------------------------------------------------------------------------------------------
// In-process

/// `size` ranks in one process, one thread per rank: the communicator of rank r moves data by
/// copying between the ranks' buffers (CPU memory, or CUDA memory of the current device), so the
/// rank-ordered sums of Communicator run over it unchanged: the same bits as over MPI or NCCL.
/// For tests, and for checking the engine-independent algorithms on one machine or one GPU
/// without MPI or NCCL. Each rank's communicator is used from its own thread. Every collective
/// checks that all ranks ask for the same one (kind, element type, count; InvalidArgument on
/// every rank otherwise); a rank that does not arrive within `timeout_s` makes the waiting ranks
/// throw BackendError, and the group is broken afterwards (every call throws).
///
/// Example:
///   gradcomp::InProcessGroup group(4);
///   std::vector<std::thread> ts;
///   for (int r = 0; r < 4; ++r)
///     ts.emplace_back([&, r] { group.comm(r).allreduce(x[r], x[r], n, gradcomp::ElemType::kF32,
///                                                      gradcomp::ReduceOp::kSum); });
///   for (auto& t : ts) t.join();
class InProcessGroup {
 public:
  explicit InProcessGroup(int size, Device device = Device::kCPU, double timeout_s = 60.0);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;
  int size() const { return static_cast<int>(comms_.size()); }
  /// Rank r's communicator (0 <= r < size()).
  Communicator& comm(int rank);

  struct Shared;  ///< the ranks' rendezvous (comm/inprocess_comm.cpp)

 private:
  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

// ---------------------------------------------------------------------------------------------
// MPI

struct MpiOptions {
  /// A collective that has not completed after this many seconds throws BackendError (a peer
  /// exited or hangs). Polling granularity is ~50 us at first, backing off to 1 ms.
  double timeout_s = 300.0;
};

/// Communicator over MPI (OpenMPI from Debian; CPU buffers, CUDA-aware MPI is not assumed).
///
/// Errors: the communicator is a duplicate of the one given, with MPI_ERRORS_RETURN, so an MPI
/// failure becomes BackendError instead of aborting the job. Every collective is issued as a
/// nonblocking MPI call and polled with MPI_Test until `timeout_s`; a peer that never arrives
/// (exited, hung, killed) produces BackendError after the timeout. MPI cannot cancel a pending
/// collective, so afterwards this communicator is broken (every call throws) and the process
/// should leave: MPI_Finalize may block on the dead peer, so call MPI_Abort or _exit.
/// With OpenMPI (tested with 4.1), mpirun ends the whole job when a process exits without
/// MPI_Finalize or dies, so the survivors never see their BackendError, unless it runs with
///   mpirun --mca orte_allowed_exit_without_sync 1 --mca orte_abort_on_non_zero_status 0
///          --mca orte_enable_recovery 1 ...        (one command line)
/// orte_allowed_exit_without_sync 1 covers a peer that exits with status 0; a peer killed by a
/// signal (SIGKILL, the OOM killer) or exiting non-zero also needs orte_abort_on_non_zero_status 0;
/// and without orte_enable_recovery 1 mpirun then never returns, even after every process has
/// exited. With these flags mpirun's exit status is 0 whatever the processes return: take the
/// verdict from the ranks (tests/comm/test_comm_mpi_fail.cpp and run_mpi_fail.cmake test both
/// cases under -np 2 and 4). A peer that finalizes early is always survived.
///
/// Example:
///   gradcomp::mpi_init();  // or MPI_Init yourself
///   gradcomp::MpiCommunicator comm({.timeout_s = 30});
class MpiCommunicator : public Communicator {
 public:
  /// Over MPI_COMM_WORLD (MPI must be initialised).
  explicit MpiCommunicator(const MpiOptions& opt = {});
  /// Over an existing communicator: `mpi_comm` points at an MPI_Comm (it is duplicated).
  MpiCommunicator(const void* mpi_comm, const MpiOptions& opt);
  ~MpiCommunicator() override;
  /// A communicator of the ranks that pass the same `color` (>= 0), ordered by `key`
  /// (MPI_Comm_split; collective over this communicator, and, like the constructor's
  /// MPI_Comm_dup, not bounded by the timeout), with this one's timeout. For a hierarchical plan
  /// (nodes of L ranks, node-major): node = split(rank / L, rank), cross = split(rank % L, rank).
  std::unique_ptr<MpiCommunicator> split(int color, int key);

  int rank() const override;
  int size() const override;
  Device device() const override { return Device::kCPU; }
  std::string backend() const override { return "mpi"; }
  double timeout_seconds() const override;
  void set_timeout(double seconds);

 protected:
  void do_allgather(const void* send, void* recv, size_t count, ElemType t) override;
  void do_alltoallv(const void* send, const size_t* scounts, const size_t* sdispls, void* recv,
                    const size_t* rcounts, const size_t* rdispls, ElemType t) override;
  void do_allgatherv(void* buf, const size_t* counts, const size_t* displs, ElemType t) override;
  void do_broadcast(const void* send, void* recv, size_t count, ElemType t, int root) override;
  void do_barrier() override;
  void check_usable(const char* what) const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Initialises MPI (thread level FUNNELED) if nobody did; true when MPI is available in this build.
bool mpi_init(int* argc = nullptr, char*** argv = nullptr);
/// Finalises MPI if initialised and not yet finalised.
void mpi_finalize();
/// True when this library was built with MPI.
bool built_with_mpi();

// ---------------------------------------------------------------------------------------------
// NCCL

struct NcclOptions {
  /// Init and collectives that do not complete in this time are aborted (ncclCommAbort) and
  /// throw BackendError.
  double timeout_s = 300.0;
  /// After each collective, wait (polling the stream and ncclCommGetAsyncError with the deadline)
  /// so that a dead peer is detected; false = stream-ordered only (call synchronize()).
  bool synchronous = true;
  /// Rank-ordered sums (alltoall + ordered local sum + allgather): bitwise the MPI result. false =
  /// ncclAllReduce / ncclReduceScatter (faster; the same bits on every rank, NCCL's order).
  bool ordered_sum = true;
};

/// Communicator over NCCL (CUDA buffers on the current device, collectives on `stream`).
/// Built only with CUDA; in a CPU-only build every constructor throws NotBuiltWithCuda.
///
/// Example (one GPU per rank, bootstrapped over MPI):
///   gradcomp::MpiCommunicator mpi;
///   cudaSetDevice(mpi.rank() % ngpus);
///   gradcomp::NcclCommunicator nccl(mpi, stream, {});
class NcclCommunicator : public Communicator {
 public:
  /// Creates a communicator of bootstrap.size() ranks: rank 0's ncclUniqueId is broadcast over
  /// `bootstrap`, then ncclCommInitRankConfig runs non-blocking, polled until the timeout.
  NcclCommunicator(Communicator& bootstrap, void* stream, const NcclOptions& opt = {});
  /// Wraps an existing ncclComm_t (`nccl_comm`, not owned: not destroyed or aborted on exit).
  NcclCommunicator(void* nccl_comm, void* stream, const NcclOptions& opt = {});
  ~NcclCommunicator() override;

  int rank() const override;
  int size() const override;
  Device device() const override { return Device::kCUDA; }
  void* stream() const override;
  std::string backend() const override { return "nccl"; }
  double timeout_seconds() const override;

  /// Waits for the stream's pending collectives (with the timeout and abort).
  void synchronize();

 protected:
  void do_allgather(const void* send, void* recv, size_t count, ElemType t) override;
  void do_alltoallv(const void* send, const size_t* scounts, const size_t* sdispls, void* recv,
                    const size_t* rcounts, const size_t* rdispls, ElemType t) override;
  void do_allgatherv(void* buf, const size_t* counts, const size_t* displs, ElemType t) override;
  void do_broadcast(const void* send, void* recv, size_t count, ElemType t, int root) override;
  void do_barrier() override;
  void check_usable(const char* what) const override;
  bool do_native_sum(const void* send, void* recv, size_t count, ElemType t, bool scatter) override;
  void complete(const char* what) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gradcomp
