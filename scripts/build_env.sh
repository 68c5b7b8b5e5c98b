# SPDX-License-Identifier: Apache-2.0
# Sourced by scripts/test.sh and scripts/test-torch2.sh: the build settings the C++ test build and
# the wheel's build tree (build/py-<tag>, which `pip install .` and `pip wheel .` reuse) must agree
# on. The library is compiled through ccache (GRADCOMP_CCACHE, read by CMake and, through
# pyproject.toml, by the wheel's build) under one compiler name (ccache keys on it), so that the
# wheel's compiles of the library's CPU sources are cache hits of the C++ build's (measured: the
# wheel 2 min 23 s alone, 59 s after the C++ build, 2026-11-28); a script that set them otherwise
# would make the other's next build reconfigure and compile everything again.
if command -v ccache >/dev/null; then
  export GRADCOMP_CCACHE=${GRADCOMP_CCACHE:-ON} CXX=${CXX:-c++}
fi
