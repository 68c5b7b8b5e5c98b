// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the bindings: array -> TensorView without copies (DLPack via nanobind's
// ndarray: torch CPU/CUDA tensors, NumPy arrays), dtype names, and the registry of binders.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "gradcomp/make_plan.hpp"

namespace gradcomp::py {
namespace nb = nanobind;

/// An array argument as the caller passed it: any dtype, device and layout. Arguments are taken
/// with take_array(), never as an nb::ndarray<...> parameter with constraints: nanobind meets an
/// unmet constraint (c_contig, a dtype) by converting, i.e. by handing C++ a temporary copy, and a
/// write into that copy, or a plan that keeps its pointer past the call, is lost or freed.
using AnyArray = nb::ndarray<>;

/// The rule for array arguments, appended to the docstrings of the bindings that take arrays.
#define GC_ARRAY_RULE                                                                            \
  "\n\nArrays (NumPy, torch or anything with DLPack or the buffer protocol) are used in place, " \
  "never copied or converted: every array must be C-contiguous and aligned to its element "      \
  "size (ValueError otherwise: pass np.ascontiguousarray(x) or x.contiguous()), and an array "   \
  "gradcomp writes into must be writable (a read-only one is a ValueError)."

enum class Access { kRead, kWrite };

/// The array argument `h` (named `what` in errors) under GC_ARRAY_RULE: TypeError when it is no
/// array, ValueError when it is read-only but written (kWrite), not C-contiguous or misaligned.
inline AnyArray take_array(nb::handle h, Access access, const char* what) {
  AnyArray a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    nb::ndarray<nb::ro> ro;
    if (!nb::try_cast(h, ro, /*convert=*/false))
      throw nb::type_error(detail::cat(what,
                                       ": expected an array that shares its memory through "
                                       "DLPack or the buffer protocol (NumPy, torch; native byte "
                                       "order), got ",
                                       nb::inst_name(h).c_str())
                               .c_str());
    GC_CHECK_ARG(access == Access::kRead, what,
                 " is read-only, but gradcomp writes into it: pass a writable array");
    a = AnyArray(ro);
  }
  int64_t numel = 1;
  for (size_t i = 0; i < a.ndim(); ++i) numel *= static_cast<int64_t>(a.shape(i));
  bool contiguous = true;
  for (int64_t i = static_cast<int64_t>(a.ndim()) - 1, expect = 1; i >= 0 && numel > 1; --i) {
    contiguous &= a.shape(i) == 1 || a.stride(i) == expect;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  if (!contiguous) {
    std::string shape, strides;
    for (size_t i = 0; i < a.ndim(); ++i) {
      shape += detail::cat(i ? ", " : "", a.shape(i));
      strides += detail::cat(i ? ", " : "", a.stride(i));
    }
    throw InvalidArgument(detail::cat(
        what, " is not C-contiguous (shape [", shape, "], strides [", strides,
        "] in elements); gradcomp uses arrays in place and never copies one: pass "
        "np.ascontiguousarray(x) or x.contiguous() (and copy an output back yourself)"));
  }
  const size_t elem = std::max<size_t>(1, a.dtype().bits / 8);
  GC_CHECK_ARG(numel == 0 || reinterpret_cast<uintptr_t>(a.data()) % elem == 0, what,
               " is not aligned to its element size (", elem, " bytes)");
  return a;
}

/// The arrays of a plan's step, kept alive on the Python plan object (Plan is bound with
/// nb::dynamic_attr()) from begin() until next() returns None: the C++ plan keeps raw pointers
/// to them, and the caller may drop its last reference right after begin().
inline constexpr const char* kStepArrays = "_gradcomp_step_arrays";

/// Runs `begin` (the C++ plan's begin(), with the GIL released) holding `arrays` (a tuple) for
/// the step. While it runs, and after it throws, the previous step's arrays are held too: a
/// failed begin() may leave the plan bound to either.
template <class F>
void begin_holding(nb::handle plan, nb::object arrays, F&& begin) {
  nb::setattr(plan, kStepArrays,
              nb::make_tuple(nb::getattr(plan, kStepArrays, nb::none()), arrays));
  {
    nb::gil_scoped_release nogil;
    begin();
  }
  nb::setattr(plan, kStepArrays, arrays);
}

/// Views a contiguous array as a TensorView. `stream` is a cudaStream_t as an integer (torch:
/// torch.cuda.current_stream().cuda_stream); 0 = the legacy default stream.
inline TensorView to_view(const AnyArray& a, uintptr_t stream = 0, const char* what = "tensor") {
  DType t;
  const auto dt = a.dtype();
  if (dt == nb::dtype<float>())
    t = DType::kFloat32;
  else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16)
    t = DType::kFloat16;
  else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16)
    t = DType::kBFloat16;
  else
    throw InvalidArgument(detail::cat(what, ": unsupported dtype (code ", int(dt.code), ", ",
                                      int(dt.bits),
                                      " bits); expected float32, float16 or bfloat16"));
  Device dev;
  if (a.device_type() == nb::device::cpu::value)
    dev = Device::kCPU;
  else if (a.device_type() == nb::device::cuda::value)
    dev = Device::kCUDA;
  else
    throw InvalidArgument(detail::cat(what, ": unsupported device type ", a.device_type(),
                                      " (expected cpu or cuda)"));
  if (dev == Device::kCUDA && !built_with_cuda())
    throw_not_built_with_cuda(detail::cat(what, " on CUDA").c_str());
  std::vector<int64_t> shape(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) shape[i] = static_cast<int64_t>(a.shape(i));
  GC_CHECK_ARG(a.ndim() <= TensorView::kMaxDims, what, ": at most ", TensorView::kMaxDims,
               " dimensions, got ", a.ndim());
  return TensorView(a.data(), shape.data(), static_cast<int>(shape.size()), t, dev, a.device_id(),
                    reinterpret_cast<void*>(stream));
}

/// A Python option value as a PlanOption: bool, int, float, str, or a list/tuple of numbers.
inline PlanOption to_option(const std::string& name, const std::string& key, nb::handle v) {
  // a bound enum (gradcomp.TopKRoute.sparse, ...) stands for its name, tagged with its enum
  // (parse_enum refuses a member of another enum)
  if (nb::hasattr(v, "__gradcomp_option__"))
    return nb::cast<std::string>(v.attr("__gradcomp_option__")) + kEnumMemberSeparator +
           nb::cast<std::string>(v.attr("name"));
  if (nb::isinstance<nb::bool_>(v)) return nb::cast<bool>(v);
  {  // NumPy's bool is a bool (not 1 through __index__, nor a float as NumPy 2 would give)
    const std::string type = nb::inst_name(v).c_str();
    if (type == "numpy.bool_" || type == "numpy.bool") {
      const int t = PyObject_IsTrue(v.ptr());
      if (t < 0) throw nb::python_error();
      return t != 0;
    }
  }
  // a 0-d array or tensor (NumPy, torch): its one value
  if (!nb::isinstance<nb::str>(v) && nb::hasattr(v, "ndim") && nb::hasattr(v, "item")) {
    nb::object nd = v.attr("ndim");
    if (nb::isinstance<nb::int_>(nd) && nb::cast<int64_t>(nd) == 0)
      return to_option(name, key, v.attr("item")());
  }
  if (nb::isinstance<nb::str>(v)) return nb::cast<std::string>(v);
  // an integer: Python's, or any exact integer scalar (NumPy's) through __index__
  const bool sequence = !nb::isinstance<nb::bytes>(v) && PySequence_Check(v.ptr());
  if (nb::isinstance<nb::int_>(v) || (!sequence && nb::hasattr(v, "__index__"))) {
    nb::object i = nb::steal(PyNumber_Index(v.ptr()));
    if (!i.is_valid()) throw nb::python_error();
    int64_t out = 0;
    GC_CHECK_ARG(nb::try_cast(i, out), "invalid option for compressor '", name, "': ", key,
                 " does not fit a 64-bit integer");
    return out;
  }
  auto real = [&](nb::handle x, double* out) {  // Python's float or any type with __float__
    if (nb::isinstance<nb::bool_>(x) || nb::isinstance<nb::str>(x) ||
        (!nb::isinstance<nb::bytes>(x) && PySequence_Check(x.ptr())))
      return false;
    if (!nb::isinstance<nb::float_>(x) && !nb::isinstance<nb::int_>(x) &&
        !nb::hasattr(x, "__float__"))
      return false;
    *out = PyFloat_AsDouble(x.ptr());
    if (*out == -1.0 && PyErr_Occurred()) throw nb::python_error();
    return true;
  };
  double d = 0;
  if (real(v, &d)) return d;
  // a list of numbers: a list, a tuple or another sequence (a NumPy array), not a string
  if (sequence) {
    std::vector<double> out;
    for (nb::handle e : v) {
      GC_CHECK_ARG(real(e, &d), "invalid option for compressor '", name, "': ", key,
                   " must be a list of numbers, got an element of type ", nb::inst_name(e).c_str());
      out.push_back(d);
    }
    return out;
  }
  throw InvalidArgument(detail::cat("invalid option for compressor '", name, "': ", key,
                                    " has type ", nb::inst_name(v).c_str(),
                                    " (expected bool, int, float, str or a list of numbers)"));
}

/// Keyword arguments (or an options dict) as make_plan options of family `name` (make_plan.hpp:
/// one table of names, types and defaults for the plans, the hooks and the per-tensor codecs).
inline PlanOptions to_options(const std::string& name, const nb::dict& kw) {
  PlanOptions o;
  for (auto [k, v] : kw) {
    const std::string key = nb::cast<std::string>(nb::str(k));
    o[key] = to_option(name, key, v);
  }
  return o;
}

/// A state_dict() as Python bytes (a copy: the bytes object owns its memory).
inline nb::bytes to_bytes(const std::vector<uint8_t>& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

inline void dict_put(nb::dict&) {}
template <class V, class... Rest>
void dict_put(nb::dict& d, const char* key, const V& value, const Rest&... rest) {
  d[key] = value;
  dict_put(d, rest...);
}

/// A dict of key, value, key, value, ... in that order (the statistics and results the bindings
/// hand to Python as dicts). Example: dict_of("step", s.step, "count", s.count).
template <class... KeyValues>
nb::dict dict_of(const KeyValues&... kv) {
  static_assert(sizeof...(kv) % 2 == 0, "dict_of takes keys and values in pairs");
  nb::dict d;
  dict_put(d, kv...);
  return d;
}

inline nb::dict stats_dict(const CompressionStats& s) {
  return dict_of("step", s.step, "numel", s.numel, "count", s.count, "dense_bytes", s.dense_bytes,
                 "payload_bytes", s.payload_bytes, "compression_ratio", s.compression_ratio());
}

/// The methods every single-payload compressor (gradcomp::Compressor) has in Python: encode,
/// decode_add (GIL released), state_dict / load_state_dict (bytes), step, numel, last_stats.
template <class C>
void def_compressor_methods(nb::class_<C>& cls) {
  cls.def(
         "encode",
         [](C& c, nb::handle g, Payload* out, uintptr_t stream) {
           const TensorView v = to_view(take_array(g, Access::kRead, "grad"), stream, "grad");
           nb::gil_scoped_release nogil;
           c.encode(v, *out);
         },
         nb::arg("grad"), nb::arg("out"), nb::arg("stream") = 0,
         "Compresses grad into out (updates the error-feedback state, advances the step). grad "
         "is only read (read-only arrays are fine)." GC_ARRAY_RULE)
      .def(
          "decode_add",
          [](C& c, nb::handle payload, nb::handle dense, float scale, uintptr_t stream) {
            const AnyArray p = take_array(payload, Access::kRead, "payload");
            GC_CHECK_ARG(p.ndim() == 1 && p.dtype() == nb::dtype<uint8_t>(),
                         "payload must be a 1-D uint8 array (Payload.array()), got ", p.ndim(),
                         "-D with dtype code ", int(p.dtype().code), ", ", int(p.dtype().bits),
                         " bits");
            GC_CHECK_ARG(reinterpret_cast<uintptr_t>(p.data()) % 8 == 0,
                         "payload must start at an 8-byte aligned address (its sections are "
                         "8-byte aligned)");
            const TensorView d =
                to_view(take_array(dense, Access::kWrite, "dense"), stream, "dense");
            nb::gil_scoped_release nogil;
            c.decode_add(p.data(), p.shape(0), d, scale);
          },
          nb::arg("payload"), nb::arg("dense"), nb::arg("scale") = 1.0f, nb::arg("stream") = 0,
          "dense += scale * decode(payload); the payload (1-D uint8, 8-byte aligned, e.g. "
          "Payload.array() or bytes) is validated first, dense (fp32) is written in "
          "place." GC_ARRAY_RULE)
      .def("state_dict", [](const C& c) { return to_bytes(c.state_dict()); })
      .def("load_state_dict",
           [](C& c, nb::bytes b) {
             c.load_state_dict(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
           })
      .def_prop_ro("step", [](const C& c) { return c.step(); })
      .def_prop_ro("numel", [](const C& c) { return c.numel(); })
      .def_prop_ro("last_stats", [](const C& c) { return stats_dict(c.last_stats()); });
}

/// A NumPy array owning a host copy of n floats on `dev` (for diagnostics: an explicit copy).
inline nb::object host_copy(const float* src, int64_t n, Device dev) {
  auto* v = new std::vector<float>(static_cast<size_t>(n));
  if (n > 0) device_copy(v->data(), Device::kCPU, src, dev, v->size() * sizeof(float), nullptr);
  nb::capsule owner(v, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  size_t shape[1] = {v->size()};
  return nb::cast(nb::ndarray<nb::numpy, float>(v->data(), 1, shape, owner));
}

/// Each bind_*.cpp registers its binder; module.cpp runs them all (no central list to edit).
using Binder = std::function<void(nb::module_&)>;
inline std::vector<std::pair<int, Binder>>& binders() {
  static std::vector<std::pair<int, Binder>> b;
  return b;
}
struct Register {
  Register(int order, Binder f) { binders().emplace_back(order, std::move(f)); }
};

}  // namespace gradcomp::py
