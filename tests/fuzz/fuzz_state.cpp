// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: load_state_dict of one state kind (fuzz::state_kind, a name from
// tests/state_subjects.hpp; one binary per kind: this file is compiled once, and each binary adds
// the one-line definition of its kind that tests/fuzz/CMakeLists.txt generates). Each input is
// loaded twice into a subject that has taken a step (so that "unchanged" means something):
//  1. as given: almost every mutation breaks the CRC-32C trailer and must be rejected;
//  2. with the trailer recomputed over the mutated fields, which takes the mutation past the
//     checksum to the field parser.
// Properties: a load throws InvalidArgument and leaves the saved state byte for byte as it was,
// or it succeeds, saving again gives back exactly the loaded bytes, and a training step from the
// loaded state runs (a state the loader accepts must be one the object can use). Each input is
// also resharded (reshard_state) beside a good state of the same kind, for 1 to 3 ranks: it is
// refused with InvalidArgument or gives a state whose header and checksum read back.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/crc32c.hpp"
#include "core/state_io.hpp"
#include "fuzz_common.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/make_plan.hpp"
#include "state_subjects.hpp"

namespace gradcomp::fuzz {
extern const char* const state_kind;  // defined by each binary
}  // namespace gradcomp::fuzz

using namespace gradcomp;

namespace {

void load_and_check(test::StateSubject& s, const uint8_t* data, size_t size) {
  const std::vector<uint8_t> before = s.save();
  try {
    s.load(data, size);
  } catch (const InvalidArgument&) {
    fuzz::require(s.save() == before, "a rejected state changed the object");
    return;
  }
  fuzz::require(s.save() == std::vector<uint8_t>(data, data + size),
                "saving a just-loaded state does not give back the loaded bytes");
  try {
    s.step(3);
  } catch (const Error&) {
    fuzz::fail("a training step after an accepted load threw");
  }
}

void reshard_check(const std::vector<uint8_t>& fuzzed, const std::vector<uint8_t>& good) {
  for (const auto& states : {std::vector<std::vector<uint8_t>>{good, fuzzed},
                             std::vector<std::vector<uint8_t>>{fuzzed, good}})
    for (int world = 1; world <= 3; ++world) {
      std::vector<uint8_t> out;
      try {
        out = reshard_state(states, world, world - 1);
      } catch (const InvalidArgument&) {
        continue;
      }
      try {
        detail::StateReader check(out.data(), out.size());
      } catch (const InvalidArgument&) {
        fuzz::fail("reshard_state accepted its input but wrote an unreadable state");
      }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto subject = test::make_state_subject(fuzz::state_kind);
  subject->step(1);
  load_and_check(*subject, data, size);
  if (size >= sizeof(uint32_t)) {
    std::vector<uint8_t> fixed(data, data + size);
    const uint32_t crc = detail::crc32c(fixed.data(), size - sizeof(uint32_t));
    std::memcpy(fixed.data() + size - sizeof(uint32_t), &crc, sizeof crc);
    load_and_check(*subject, fixed.data(), fixed.size());
    reshard_check(fixed, subject->save());
  }
  return 0;
}
