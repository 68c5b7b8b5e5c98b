// SPDX-License-Identifier: Apache-2.0
// Umbrella header: everything a C++ user of gradcomp includes.
#pragma once

#include "gradcomp/comm.hpp"
#include "gradcomp/compressor.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/make_plan.hpp"
#include "gradcomp/onebit.hpp"
#include "gradcomp/plan.hpp"
#include "gradcomp/plan_config.hpp"
#include "gradcomp/powersgd.hpp"
#include "gradcomp/quant.hpp"
#include "gradcomp/rng.hpp"
#include "gradcomp/runtime.hpp"
#include "gradcomp/straggler.hpp"
#include "gradcomp/tensor.hpp"
#include "gradcomp/topk.hpp"
#include "gradcomp/wire.hpp"
#include "gradcomp/workspace.hpp"
