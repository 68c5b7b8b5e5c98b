// SPDX-License-Identifier: Apache-2.0
// Seed corpus of the fuzz targets: valid payloads and states made by the library itself with the
// targets' configurations (fuzz_common.hpp, state_subjects.hpp).
//
//   make_fuzz_seeds write DIR   writes DIR/<target>/<seed> (tests/fuzz/corpus is made this way)
//   make_fuzz_seeds check DIR   checks that every seed under DIR/<target>/ is still accepted by
//                               its target's decoder or loader (run by ctest on the committed
//                               corpus: a format change that invalidates the seeds fails it)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"
#include "plans/quant_plan.hpp"
#include "state_subjects.hpp"

using namespace gradcomp;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<uint8_t>;
using Seeds = std::map<std::string, Bytes>;  // seed name -> bytes

const char* coding_name(uint8_t c) {
  switch (IndexCoding(c)) {
    case IndexCoding::kNone:
      return "none";
    case IndexCoding::kRaw32:
      return "raw32";
    case IndexCoding::kDeltaVarint:
      return "varint";
    case IndexCoding::kBitmap:
      return "bitmap";
  }
  return "unknown";
}

Bytes bytes_of(const Payload& p) { return Bytes(p.data(), p.data() + p.size()); }

Seeds topk_seeds() {
  Seeds s;
  struct Case {
    double ratio;
    DType dtype;
  };
  // densities that give each index coding (raw32 for a few, varint, bitmap when dense)
  for (auto c :
       {Case{0.001, DType::kFloat32}, Case{0.01, DType::kFloat32}, Case{0.05, DType::kFloat16},
        Case{0.3, DType::kBFloat16}, Case{1.0, DType::kFloat32}}) {
    TopKCompressor comp(fuzz::topk_config(c.ratio, c.dtype), fuzz::kNumel);
    Payload p;
    auto g = fuzz::gradient(fuzz::kNumel, 1);
    comp.encode(TensorView::cpu(g.data(), fuzz::kNumel), p);
    s["k" + std::to_string(p.header.count) + "_" + dtype_name(c.dtype) + "_" +
      coding_name(p.header.index_coding)] = bytes_of(p);
  }
  return s;
}

/// Coded values at densities that give each index coding, and a payload of one value.
Seeds topk_coded_seeds() {
  Seeds s;
  for (double ratio : {0.001, 0.01, 0.1, 0.5}) {
    TopKCompressor comp(fuzz::topk_coded_config(ratio), fuzz::kNumel);
    Payload p;
    auto g = fuzz::gradient(fuzz::kNumel, 1);
    comp.encode(TensorView::cpu(g.data(), fuzz::kNumel), p);
    s["k" + std::to_string(p.header.count) + "_2bit_" + coding_name(p.header.index_coding)] =
        bytes_of(p);
  }
  return s;
}

Seeds randomk_seeds() {
  Seeds s;
  for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    RandomKCompressor comp(fuzz::randomk_config(t), fuzz::kNumel);
    Payload p;
    // steps 0..5 cover both warm-up stages and the final density (fp32); one step of each
    // other dtype
    for (int step = 0; step < (t == DType::kFloat32 ? 6 : 1); ++step) {
      auto g = fuzz::gradient(fuzz::kNumel, 10 + step);
      comp.encode(TensorView::cpu(g.data(), fuzz::kNumel), p);
      s["step" + std::to_string(step) + "_" + dtype_name(t)] = bytes_of(p);
    }
  }
  return s;
}

Seeds onebit_seeds() {
  Seeds s;
  struct Case {
    const char* name;
    OneBitScaling scaling;
    int64_t chunk, rows, cols;
  };
  for (auto c : {Case{"columns25", OneBitScaling::kColumnMeans, 0, 40, 25},
                 Case{"columns1", OneBitScaling::kColumnMeans, 0, 1000, 1},
                 Case{"l1_whole", OneBitScaling::kSignL1, 0, 1000, 1},
                 Case{"l2_chunk32", OneBitScaling::kSignL2, 32, 1000, 1},
                 Case{"l1_chunk256", OneBitScaling::kSignL1, 256, 1000, 1}}) {
    OneBitCompressor comp(fuzz::onebit_config(c.scaling, c.chunk), c.rows, c.cols);
    Payload p;
    auto g = fuzz::gradient(fuzz::kNumel, 20);
    comp.encode(TensorView::cpu(g.data(), {c.rows, c.cols}), p);
    s[c.name] = bytes_of(p);
  }
  return s;
}

/// The chunks rank 1 of the multi-bit target's 2-rank job sends rank 0 in one step (its worker
/// chunk 0, then its averaged chunk), from a fresh job and from one whose rank 1 holds a NaN.
Seeds quant_chunk_seeds() {
  Seeds s;
  for (bool bad : {false, true}) {
    constexpr int64_t n = fuzz::kNumel;
    QuantPlan p0(fuzz::quant_config(), n, 2, 0), p1(fuzz::quant_config(), n, 2, 1);
    auto g0 = fuzz::gradient(n, 1), g1 = fuzz::gradient(n, 2);
    if (bad) g1[500] = std::numeric_limits<float>::quiet_NaN();
    p0.begin(TensorView::cpu(g0.data(), n));
    p1.begin(TensorView::cpu(g1.data(), n));
    const size_t B = p0.block_bytes();
    Bytes seed;
    for (int phase = 0; phase < 2; ++phase) {
      auto c0 = p0.next(), c1 = p1.next();
      auto* s0 = static_cast<const uint8_t*>(c0->send);
      auto* s1 = static_cast<const uint8_t*>(c1->send);
      auto* r0 = static_cast<uint8_t*>(c0->recv);
      auto* r1 = static_cast<uint8_t*>(c1->recv);
      // all-to-all: rank r gets block r of each rank; allgather: both get the one block of each
      const size_t to_rank1 = phase == 0 ? B : 0;
      std::memcpy(r0, s0, B);
      std::memcpy(r0 + B, s1, B);
      std::memcpy(r1, s0 + to_rank1, B);
      std::memcpy(r1 + B, s1 + to_rank1, B);
      seed.insert(seed.end(), s1, s1 + B);
    }
    (void)p0.next();
    (void)p1.next();
    s[bad ? "peer_nan" : "step0"] = seed;
  }
  return s;
}

Seeds state_seeds(const std::string& kind) {
  Seeds s;
  auto subject = test::make_state_subject(kind);
  s["after0"] = subject->save();  // fresh: zero residuals, step 0
  subject->step(100);
  s["after1"] = subject->save();
  subject->step(101);
  subject->step(102);
  s["after3"] = subject->save();
  return s;
}

std::string state_target(std::string kind) {
  for (auto& ch : kind)
    if (ch == '-') ch = '_';
  return "fuzz_state_" + kind;
}

/// Every target's seeds, by target name (= the fuzzer's executable and corpus directory).
std::map<std::string, Seeds> all_seeds() {
  std::map<std::string, Seeds> t;
  t["fuzz_topk_decode"] = topk_seeds();
  t["fuzz_topk_coded_decode"] = topk_coded_seeds();
  t["fuzz_randomk_decode"] = randomk_seeds();
  t["fuzz_onebit_decode"] = onebit_seeds();
  for (const auto* src :
       {&t["fuzz_topk_decode"], &t["fuzz_randomk_decode"], &t["fuzz_onebit_decode"]})
    for (const auto& [name, b] : *src) t["fuzz_wire"][name] = b;
  t["fuzz_quant_chunks"] = quant_chunk_seeds();
  for (const auto& kind : test::state_kinds()) t[state_target(kind)] = state_seeds(kind);
  return t;
}

/// Throws (InvalidArgument) unless `target` accepts `b` as a valid input.
void accept(const std::string& target, const Bytes& b) {
  const fuzz::Aligned in(b.data(), b.size());
  std::vector<float> dense(fuzz::kNumel, 0.0f);
  if (target == "fuzz_wire") {
    (void)parse_header(in.data(), in.size);
  } else if (target == "fuzz_topk_decode") {
    TopKCompressor c(fuzz::topk_config(), fuzz::kNumel);
    c.decode_add(in.data(), in.size, TensorView::cpu(dense.data(), fuzz::kNumel));
  } else if (target == "fuzz_topk_coded_decode") {
    TopKCompressor c(fuzz::topk_coded_config(), fuzz::kNumel);
    c.decode_add(in.data(), in.size, TensorView::cpu(dense.data(), fuzz::kNumel));
  } else if (target == "fuzz_randomk_decode") {
    RandomKCompressor c(fuzz::randomk_config(), fuzz::kNumel);
    c.decode_add(in.data(), in.size, TensorView::cpu(dense.data(), fuzz::kNumel));
  } else if (target == "fuzz_onebit_decode") {
    OneBitCompressor c(fuzz::onebit_config(), fuzz::kOneBitRows, fuzz::kOneBitCols);
    c.decode_add(in.data(), in.size,
                 TensorView::cpu(dense.data(), {fuzz::kOneBitRows, fuzz::kOneBitCols}));
  } else if (target == "fuzz_quant_chunks") {
    QuantPlan plan(fuzz::quant_config(), fuzz::kNumel, 2, 0);
    std::vector<float> g;
    fuzz::quant_step_with_peer(plan, b.data(), b.size(), g);
  } else {
    for (const auto& kind : test::state_kinds())
      if (target == state_target(kind)) {
        test::make_state_subject(kind)->load(b.data(), b.size());
        return;
      }
    throw InvalidArgument("unknown fuzz target " + target);
  }
}

int write(const fs::path& dir) {
  for (const auto& [target, seeds] : all_seeds()) {
    fs::create_directories(dir / target);
    for (const auto& [name, b] : seeds) {
      accept(target, b);  // what is written must pass `check`
      std::ofstream(dir / target / name, std::ios::binary)
          .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    std::printf("%s: %zu seeds\n", target.c_str(), seeds.size());
  }
  return 0;
}

int check(const fs::path& dir) {
  int bad = 0;
  for (const auto& [target, seeds] : all_seeds()) {
    size_t n = 0;
    if (!fs::is_directory(dir / target)) {
      std::printf("FAIL %s: no corpus directory\n", target.c_str());
      ++bad;
      continue;
    }
    for (const auto& e : fs::directory_iterator(dir / target)) {
      std::ifstream f(e.path(), std::ios::binary);
      const Bytes b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      try {
        accept(target, b);
        ++n;
      } catch (const Error& ex) {
        std::printf("FAIL %s: %s rejected: %s\n", target.c_str(), e.path().c_str(), ex.what());
        ++bad;
      }
    }
    if (n < seeds.size()) {
      std::printf("FAIL %s: %zu valid seeds, the generator makes %zu\n", target.c_str(), n,
                  seeds.size());
      ++bad;
    } else {
      std::printf("%s: %zu seeds accepted\n", target.c_str(), n);
    }
  }
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode == "write") return write(argv[2]);
  if (mode == "check") return check(argv[2]);
  std::fprintf(stderr, "usage: %s write|check DIR\n", argv[0]);
  return 2;
}
