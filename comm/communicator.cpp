// SPDX-License-Identifier: Apache-2.0
// The engine-independent part of the communication layer: dispatch of a plan's collectives,
// the variable-length allgather, the size handshake and the driver loop, and the cost model fit.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "gradcomp/comm.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/runtime.hpp"

namespace gradcomp {

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
    case CollectiveKind::kAllgather: return allgather(c.send, c.recv, c.count, c.type);
    case CollectiveKind::kAllToAll: return alltoall(c.send, c.recv, c.count, c.type);
    case CollectiveKind::kBroadcast: return broadcast(c.send, c.recv, c.count, c.type, c.root);
  }
  GC_CHECK(false, "unknown collective kind ", int(c.kind));
}

// ---------------------------------------------------------------------------------------------
namespace {

constexpr int64_t kSigWords = 6;
constexpr int64_t kNoNumel = -1;

const char* elem_name(ElemType t) {
  switch (t) {
    case ElemType::kF32: return "fp32";
    case ElemType::kF16: return "fp16";
    case ElemType::kBF16: return "bf16";
    case ElemType::kU8: return "u8";
    case ElemType::kU32: return "u32";
    case ElemType::kI64: return "i64";
  }
  return "?";
}

struct Signature {
  int64_t w[kSigWords];  // has_collective, numel, kind, type, count, root
  std::string describe(const std::string& plan) const {
    if (w[0] == 2) return detail::cat("to start plan '", plan, "'");
    if (!w[0]) return detail::cat("finished plan '", plan, "'");
    return detail::cat(collective_name(CollectiveKind(w[2])), " of ", w[4], " ",
                       elem_name(ElemType(w[3])), (w[2] == int64_t(CollectiveKind::kBroadcast)
                                                       ? detail::cat(" from root ", w[5])
                                                       : std::string()));
  }
};

/// Allgathers this rank's signature and throws the same InvalidArgument on every rank when any
/// rank differs from rank 0.
void handshake(Communicator& comm, Plan& plan, const std::optional<Collective>& c, Buffer& buf,
               bool pre = false) {
  const int P = comm.size();
  Signature mine{};
  auto* bp = dynamic_cast<BucketPlan*>(&plan);
  mine.w[0] = pre ? 2 : c.has_value();
  mine.w[1] = bp ? bp->numel() : kNoNumel;
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
      throw InvalidArgument(detail::cat("plan '", name, "': ranks disagree on the next collective: rank 0 asks for ",
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
