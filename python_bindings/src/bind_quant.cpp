// SPDX-License-Identifier: Apache-2.0
// The multi-bit family's plan, for the Python driver's hooks and for standalone use.
#include "common.hpp"
#include "plans/quant_plan.hpp"

namespace gradcomp::py {
namespace {

void bind(nb::module_& m) {
  nb::class_<QuantPlan, BucketPlan>(
      m, "QuantPlan",
      "Multi-bit (2/4/8) plan (one rank): the two-phase compressed allreduce (make_plan('quant', "
      "...)) or its reduce-scatter / allgather form (make_shard_plan('quant', ...)); `form` says "
      "which.")
      .def_prop_ro("step", &QuantPlan::step)
      .def_prop_ro("bytes_sent", &QuantPlan::bytes_sent)
      .def_prop_ro("chunk_elems", &QuantPlan::chunk_elems)
      .def_prop_ro("bits", [](const QuantPlan& p) { return p.config().bits; })
      .def_prop_ro("block_size", [](const QuantPlan& p) { return p.config().block_size; })
      .def_prop_ro("rotate", [](const QuantPlan& p) { return p.config().rotate; })
      .def(
          "worker_error",
          [](const QuantPlan& p) {
            return host_copy(p.worker_error(), p.worker_error_elems(), p.device());
          },
          "A copy (NumPy, fp32) of the worker error-feedback memory, for diagnostics (empty for "
          "the allgather form).")
      .def(
          "server_error",
          [](const QuantPlan& p) {
            return host_copy(p.server_error(), p.server_error_elems(), p.device());
          },
          "A copy (NumPy, fp32) of this rank's server error (chunk_elems floats; empty for the "
          "reduce-scatter and allgather forms).");
  m.def(
      "quant_bits_per_value",
      [](int bits, int64_t block_size, const std::string& scale, const std::string& scale_dtype) {
        QuantConfig c;
        c.bits = bits;
        c.block_size = block_size;
        c.scale = parse_enum<QuantScale>(scale);
        c.scale_dtype = parse_enum<DType>(scale_dtype);
        c.validate();
        return quant_bits_per_value(c);
      },
      nb::arg("bits") = 4, nb::arg("block_size") = 128, nb::arg("scale") = "symmetric",
      nb::arg("scale_dtype") = "float32",
      "Bits on the wire per value for these options (scales included; chunk headers aside).");
}

Register reg(35, bind);

}  // namespace
}  // namespace gradcomp::py
