// SPDX-License-Identifier: Apache-2.0
#include <algorithm>

#include "common.hpp"

namespace nb = nanobind;

NB_MODULE(_C, m) {
  m.doc() = "gradcomp native extension: compressors, plans and straggler tools (see gradcomp)";
  // gradcomp's InvalidArgument / CorruptPayload -> ValueError; other gradcomp errors -> RuntimeError
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const gradcomp::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const gradcomp::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  auto& bs = gradcomp::py::binders();
  std::stable_sort(bs.begin(), bs.end(), [](auto& a, auto& b) { return a.first < b.first; });
  for (auto& [order, f] : bs) f(m);
}
