// SPDX-License-Identifier: Apache-2.0
// The engine-independent part of the communication layer: the collectives over the engines'
// primitives (argument checks, statistics and the rank-ordered sums, written once for MPI, NCCL
// and any other engine), dispatch of a plan's collectives, the variable-length allgather, the
// size handshake and the driver loop, and the cost model fit.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"
#include "kernels/reduce_kernels.hpp"

namespace gradcomp {
namespace {

using clk = std::chrono::steady_clock;

/// Vectors up to this size are allreduced in one round (allgather + local ordered sum).
constexpr size_t kSmallAllreduceBytes = 32 * 1024;

DType float_dtype(ElemType t, const char* what) {
  GC_CHECK_ARG(t == ElemType::kF32 || t == ElemType::kF16 || t == ElemType::kBF16, what,
               ": a mean needs a floating-point element type");
  return t == ElemType::kF32   ? DType::kFloat32
         : t == ElemType::kF16 ? DType::kFloat16
                               : DType::kBFloat16;
}

}  // namespace

void Communicator::account(uint64_t bytes, clk::time_point t0) {
  stats_.calls += 1;
  stats_.bytes_sent += bytes;
  stats_.seconds += std::chrono::duration<double>(clk::now() - t0).count();
}

uint8_t* Communicator::scratch(size_t bytes) {
  if (scratch_.device() != device()) scratch_ = Buffer(device());
  scratch_.set_stream(stream());
  return static_cast<uint8_t*>(scratch_.reserve(bytes));
}

void Communicator::plan_chunks(size_t count, bool equal_blocks) {
  const auto P = static_cast<size_t>(size());
  for (auto* v : {&scounts_, &sdispls_, &rcounts_, &rdispls_}) v->resize(P);
  const auto me = static_cast<size_t>(rank());
  const size_t mine = equal_blocks ? count : count * (me + 1) / P - count * me / P;
  for (size_t r = 0; r < P; ++r) {
    const size_t b = equal_blocks ? count * r : count * r / P;
    scounts_[r] = equal_blocks ? count : count * (r + 1) / P - b;
    sdispls_[r] = b;
    rcounts_[r] = mine;
    rdispls_[r] = mine * r;
  }
}

uint64_t Communicator::ordered_allreduce(const void* send, void* recv, size_t count, ElemType t) {
  const auto P = static_cast<size_t>(size());
  const size_t es = elem_size(t), bytes = count * es;
  if (bytes <= kSmallAllreduceBytes || count < P) {
    // one round: everyone gets every vector and sums them in rank order
    uint8_t* blocks = scratch(bytes * P);
    do_allgather(send, blocks, count, t);
    kernels::reduce_blocks({device(), stream()}, blocks, P, count, count, t, recv);
    return bytes * (P - 1);
  }
  // reduce-scatter by all-to-all of chunks + ordered local sum, then allgather of the chunks
  plan_chunks(count, /*equal_blocks=*/false);
  const size_t mine = rcounts_[0], my_off = sdispls_[static_cast<size_t>(rank())];
  uint8_t* blocks = scratch(mine * es * P);
  do_alltoallv(send, scounts_.data(), sdispls_.data(), blocks, rcounts_.data(), rdispls_.data(), t);
  kernels::reduce_blocks({device(), stream()}, blocks, P, mine, mine, t,
                         static_cast<uint8_t*>(recv) + my_off * es);
  do_allgatherv(recv, scounts_.data(), sdispls_.data(), t);
  return 2 * (bytes - mine * es);
}

void Communicator::allreduce(const void* send, void* recv, size_t count, ElemType t, ReduceOp op) {
  check_usable("allreduce");
  const DType ft = op == ReduceOp::kMean ? float_dtype(t, "allreduce") : DType::kFloat32;
  const auto t0 = clk::now();
  const int P = size();
  const size_t bytes = count * elem_size(t);
  uint64_t sent = 0;
  if (P == 1 || count == 0) {
    if (send != recv && bytes) device_copy(recv, device(), send, device(), bytes, stream());
    if (P > 1) do_barrier();  // keep the ranks in step even for empty buckets
  } else if (do_native_sum(send, recv, count, t, /*scatter=*/false)) {
    sent = 2 * bytes * static_cast<uint64_t>(P - 1) / static_cast<uint64_t>(P);  // a ring
  } else {
    sent = ordered_allreduce(send, recv, count, t);
  }
  if (op == ReduceOp::kMean)
    kernels::convert({device(), stream()}, recv, ft, recv, ft, static_cast<int64_t>(count),
                     float(P));
  complete("allreduce");
  account(sent, t0);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t count, ElemType t,
                                  ReduceOp op) {
  check_usable("reduce_scatter");
  const DType ft = op == ReduceOp::kMean ? float_dtype(t, "reduce_scatter") : DType::kFloat32;
  const auto t0 = clk::now();
  const int P = size();
  const size_t es = elem_size(t);
  if (P == 1 || count == 0) {
    if (send != recv && count) device_copy(recv, device(), send, device(), count * es, stream());
    if (P > 1) do_barrier();
  } else if (!do_native_sum(send, recv, count, t, /*scatter=*/true)) {
    plan_chunks(count, /*equal_blocks=*/true);
    uint8_t* blocks = scratch(count * es * static_cast<size_t>(P));
    do_alltoallv(send, scounts_.data(), sdispls_.data(), blocks, rcounts_.data(), rdispls_.data(),
                 t);
    kernels::reduce_blocks({device(), stream()}, blocks, static_cast<size_t>(P), count, count, t,
                           recv);
  }
  if (op == ReduceOp::kMean)
    kernels::convert({device(), stream()}, recv, ft, recv, ft, static_cast<int64_t>(count),
                     float(P));
  complete("reduce_scatter");
  account(count * es * static_cast<uint64_t>(P - 1), t0);
}

void Communicator::allgather(const void* send, void* recv, size_t count, ElemType t) {
  check_usable("allgather");
  const auto t0 = clk::now();
  const size_t bytes = count * elem_size(t);
  if (size() == 1) {
    if (send != recv && bytes) device_copy(recv, device(), send, device(), bytes, stream());
  } else {
    do_allgather(send, recv, count, t);
  }
  complete("allgather");
  account(bytes * static_cast<uint64_t>(size() - 1), t0);
}

void Communicator::alltoall(const void* send, void* recv, size_t count, ElemType t) {
  check_usable("alltoall");
  GC_CHECK_ARG(send != recv || count == 0, "alltoall: send and recv must be different buffers");
  const auto t0 = clk::now();
  const size_t bytes = count * elem_size(t);
  if (size() == 1) {
    if (bytes) device_copy(recv, device(), send, device(), bytes, stream());
  } else {
    plan_chunks(count, /*equal_blocks=*/true);
    do_alltoallv(send, scounts_.data(), sdispls_.data(), recv, rcounts_.data(), rdispls_.data(), t);
  }
  complete("alltoall");
  account(bytes * static_cast<uint64_t>(size() - 1), t0);
}

void Communicator::broadcast(const void* send, void* recv, size_t count, ElemType t, int root) {
  check_usable("broadcast");
  GC_CHECK_ARG(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of 0..",
               size() - 1);
  const auto t0 = clk::now();
  const size_t bytes = count * elem_size(t);
  if (size() == 1) {
    if (send != recv && bytes) device_copy(recv, device(), send, device(), bytes, stream());
  } else {
    do_broadcast(send, recv, count, t, root);
  }
  complete("broadcast");
  account(rank() == root ? bytes : 0, t0);
}

void Communicator::barrier() {
  check_usable("barrier");
  const auto t0 = clk::now();
  if (size() > 1) do_barrier();
  complete("barrier");
  account(0, t0);
}

size_t Communicator::allgather_varying(const void* send, size_t nbytes, Buffer& recv,
                                       std::vector<uint64_t>& sizes) {
  const int P = size();
  const Device dev = device();
  GC_CHECK_ARG(recv.device() == dev, "allgather_varying: receive buffer is on ",
               device_name(recv.device()), ", the communicator works on ", device_name(dev));
  // length exchange (on the communicator's device)
  if (varying_sizes_.device() != dev) varying_sizes_ = Buffer(dev);
  auto* lens = varying_sizes_.get<uint64_t>(static_cast<size_t>(P) + 1);
  const uint64_t mine = nbytes;
  device_copy(lens + P, dev, &mine, Device::kCPU, sizeof mine, stream());
  allgather(lens + P, lens, 1, ElemType::kI64);
  sizes.resize(static_cast<size_t>(P));
  device_copy(sizes.data(), Device::kCPU, lens, dev, sizeof(uint64_t) * P, stream());
  if (dev == Device::kCUDA) cuda::stream_synchronize(stream());
  uint64_t longest = 0;
  for (uint64_t s : sizes) longest = std::max(longest, s);
  const size_t stride = (static_cast<size_t>(longest) + 7) / 8 * 8;
  // padded allgather: the send block is copied into a stride-long, zero-padded buffer
  if (varying_send_.device() != dev) varying_send_ = Buffer(dev);
  auto* block = varying_send_.get<uint8_t>(stride);
  if (nbytes) device_copy(block, dev, send, dev, nbytes, stream());
  if (stride > nbytes) device_zero(dev, block + nbytes, stride - nbytes, stream());
  auto* out = recv.get<uint8_t>(stride * static_cast<size_t>(P));
  allgather(block, out, stride, ElemType::kU8);
  return stride;
}

void Communicator::execute(const Collective& c) {
  GC_CHECK_ARG(c.device == device(), "collective '", c.tag, "' has buffers on ",
               device_name(c.device), "; the ", backend(), " communicator works on ",
               device_name(device()));
  GC_CHECK_ARG(c.world == size(), "collective '", c.tag, "' comes from a plan built for ", c.world,
               " ranks; the communicator has ", size());
  switch (c.kind) {
    case CollectiveKind::kAllreduceSum:
      return allreduce(c.send, c.recv, c.count, c.type, ReduceOp::kSum);
    case CollectiveKind::kAllgather:
      return allgather(c.send, c.recv, c.count, c.type);
    case CollectiveKind::kAllToAll:
      return alltoall(c.send, c.recv, c.count, c.type);
    case CollectiveKind::kBroadcast:
      return broadcast(c.send, c.recv, c.count, c.type, c.root);
  }
  GC_CHECK(false, "unknown collective kind ", int(c.kind));
}

// ---------------------------------------------------------------------------------------------
namespace {

constexpr int64_t kSigWords = 6;

struct Signature {
  int64_t w[kSigWords];  // has_collective, numel, kind, type, count, root
  std::string describe(const std::string& plan) const {
    if (w[0] == 2) return detail::cat("to start plan '", plan, "'");
    if (!w[0]) return detail::cat("finished plan '", plan, "'");
    return detail::cat(
        collective_name(CollectiveKind(w[2])), " of ", w[4], " ", elem_type_name(ElemType(w[3])),
        (w[2] == int64_t(CollectiveKind::kBroadcast) ? detail::cat(" from root ", w[5])
                                                     : std::string()));
  }
};

/// Allgathers this rank's signature and throws the same InvalidArgument on every rank when any
/// rank differs from rank 0.
void handshake(Communicator& comm, Plan& plan, const std::optional<Collective>& c, Buffer& buf,
               bool pre = false) {
  const int P = comm.size();
  Signature mine{};
  mine.w[0] = pre ? 2 : c.has_value();
  mine.w[1] = plan.bucket_numel();  // -1 for a plan without a bucket
  if (c) {
    mine.w[2] = int64_t(c->kind);
    mine.w[3] = int64_t(c->type);
    mine.w[4] = static_cast<int64_t>(c->count);
    mine.w[5] = c->kind == CollectiveKind::kBroadcast ? c->root : 0;
  }
  if (P == 1) return;
  const Device dev = comm.device();
  if (buf.device() != dev) buf = Buffer(dev);
  auto* d = buf.get<int64_t>(static_cast<size_t>(kSigWords) * (P + 1));
  device_copy(d + kSigWords * P, dev, mine.w, Device::kCPU, sizeof mine.w, comm.stream());
  comm.allgather(d + kSigWords * P, d, kSigWords, ElemType::kI64);
  std::vector<Signature> all(static_cast<size_t>(P));
  device_copy(all.data(), Device::kCPU, d, dev, sizeof(Signature) * P, comm.stream());
  if (dev == Device::kCUDA) cuda::stream_synchronize(comm.stream());
  const Signature& s0 = all[0];
  const std::string name = plan.name();
  for (int r = 1; r < P; ++r) {
    const Signature& s = all[static_cast<size_t>(r)];
    if (s.w[1] != s0.w[1])
      throw InvalidArgument(detail::cat(
          "plan '", name, "': bucket sizes differ across ranks: rank 0 has ", s0.w[1],
          " elements, rank ", r, " has ", s.w[1], " (every rank must pass the same bucket)"));
    if (!std::equal(s.w, s.w + kSigWords, s0.w))
      throw InvalidArgument(
          detail::cat("plan '", name, "': ranks disagree on the next collective: rank 0 asks for ",
                      s0.describe(name), ", rank ", r, " for ", s.describe(name)));
  }
}

}  // namespace

std::vector<Collective> run_plan(Plan& plan, Communicator& comm, Handshake hs) {
  std::vector<Collective> log;
  Buffer sig(comm.device());
  bool first = true;
  // sizes first, before the plan's first local work changes any state
  if (hs != Handshake::kNone) handshake(comm, plan, std::nullopt, sig, /*pre=*/true);
  for (;;) {
    std::optional<Collective> c = plan.next();
    if (hs == Handshake::kEvery || (hs == Handshake::kFirst && first))
      handshake(comm, plan, c, sig);
    first = false;
    if (!c) return log;
    GC_CHECK_ARG(c->scope == Scope::kWorld, "plan '", plan.name(), "' asks for a ",
                 scope_name(c->scope), " collective: run it with run_plan(plan, node, cross)");
    comm.execute(*c);
    log.push_back(std::move(*c));
  }
}

std::vector<Collective> run_plan(Plan& plan, Communicator& node, Communicator& cross,
                                 Handshake hs) {
  std::vector<Collective> log;
  Buffer sig_node(node.device()), sig_cross(cross.device());
  bool first_node = true, first_cross = true;
  if (hs != Handshake::kNone) {
    handshake(node, plan, std::nullopt, sig_node, /*pre=*/true);
    handshake(cross, plan, std::nullopt, sig_cross, /*pre=*/true);
  }
  for (;;) {
    std::optional<Collective> c = plan.next();
    if (!c) return log;  // (each group's last collective was checked when it was issued)
    GC_CHECK_ARG(c->scope != Scope::kWorld, "plan '", plan.name(), "' asks for a flat ",
                 collective_name(c->kind), ": run it with run_plan(plan, comm)");
    const bool on_node = c->scope == Scope::kNode;
    Communicator& comm = on_node ? node : cross;
    bool& first = on_node ? first_node : first_cross;
    if (hs == Handshake::kEvery || (hs == Handshake::kFirst && first))
      handshake(comm, plan, c, on_node ? sig_node : sig_cross);
    first = false;
    comm.execute(*c);
    log.push_back(std::move(*c));
  }
}

void PlanRunner::run(Plan& plan, uint64_t bucket_id) {
  const bool known = std::find(verified_.begin(), verified_.end(), bucket_id) != verified_.end();
  if (known) {
    while (auto c = plan.next()) comm_.execute(*c);
    return;
  }
  run_plan(plan, comm_, Handshake::kEvery);
  verified_.push_back(bucket_id);
}

// ---------------------------------------------------------------------------------------------
CostModel measure_cost_model(Communicator& comm, size_t large_bytes) {
  CostModel cm;
  const int P = comm.size();
  if (P == 1) return cm;
  const Device dev = comm.device();
  const size_t per_rank = std::max<size_t>(large_bytes / P, 8) / 8 * 8;
  Buffer send(dev), recv(dev);
  auto* s = send.get<uint8_t>(per_rank);
  auto* r = recv.get<uint8_t>(per_rank * P);
  device_zero(dev, s, per_rank, comm.stream());
  using clk = std::chrono::steady_clock;
  auto timed = [&](size_t bytes, int reps) {
    comm.barrier();
    const auto t0 = clk::now();
    for (int i = 0; i < reps; ++i) comm.allgather(s, r, bytes, ElemType::kU8);
    comm.barrier();
    return std::chrono::duration<double>(clk::now() - t0).count() / reps;
  };
  timed(8, 2);  // warm-up (connection setup)
  const double t_small = timed(8, 20);
  const double t_large = timed(per_rank, 3);
  double params[2];
  params[0] = std::max(t_small / (P - 1), 1e-7);  // per round (ring: P-1 rounds)
  const double sent = static_cast<double>(per_rank) * (P - 1);
  params[1] = sent / std::max(t_large - t_small, 1e-9);
  // everyone uses rank 0's numbers, so that every rank makes the same choices
  auto* d = send.get<double>(2);
  device_copy(d, dev, params, Device::kCPU, sizeof params, comm.stream());
  comm.broadcast(d, d, 2, ElemType::kI64, 0);
  device_copy(params, Device::kCPU, d, dev, sizeof params, comm.stream());
  if (dev == Device::kCUDA) cuda::stream_synchronize(comm.stream());
  cm.latency_s = params[0];
  cm.bandwidth_Bps = params[1];
  return cm;
}

}  // namespace gradcomp
