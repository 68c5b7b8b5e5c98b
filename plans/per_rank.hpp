// SPDX-License-Identifier: Apache-2.0
// What the top-k and random-k plans share: the compressor configuration of one rank.
#pragma once

namespace gradcomp::detail {

/// The compressor configuration of one rank: clip_norm becomes the rank's local threshold.
template <class Cfg>
Cfg per_rank(Cfg cfg, int world) {
  cfg.clip_norm = cfg.local_clip_norm(world);
  return cfg;
}

}  // namespace gradcomp::detail
