#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python suite against the newest torch 2.x from PyPI: every test file (the stage "newest" of
# tests/python/ci_stages.py; scripts/test.sh runs it after the torch-version-dependent files on
# Debian's torch 1.13, the oldest supported). gradcomp._C does not link libtorch (it
# takes tensors through DLPack / the buffer protocol), so the wheel built from the tree that
# scripts/test.sh just installed into .venv is installed here unchanged: one extension build for
# both torch versions.
#
# The venv (.venv-torch2, no system site packages) is made once and its torch upgraded when PyPI
# has a newer 2.x. The wheels are kept in a wheel directory between runs on the same machine
# (GRADCOMP_WHEELHOUSE, default ~/.cache/gradcomp/wheelhouse: torch 2.x with its CUDA libraries
# is about 3 GB); pip downloads only what is not there yet.
# Environment: GRADCOMP_VENV (the torch 1.13 venv that builds the wheel, default .venv),
# GRADCOMP_TORCH2_VENV (default .venv-torch2), GRADCOMP_TORCH2_SPEC (default "torch>=2,<3"),
# GRADCOMP_SKIP_TORCH2=1 skips this stage.
# Usage: test-torch2.sh [--packages-only | --skip-packages]: step 1 alone (scripts/test.sh runs it
# in the background while the C++ build runs: it is mostly download and unpacking), or steps 2
# and 3 alone (after it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build_env.sh  # (the settings scripts/test.sh built the wheel's tree with)
if [ "${GRADCOMP_SKIP_TORCH2:-0}" = "1" ]; then
  echo "test-torch2: skipped (GRADCOMP_SKIP_TORCH2=1)"
  exit 0
fi
t0=$SECONDS
venv=${GRADCOMP_VENV:-.venv}
venv2=${GRADCOMP_TORCH2_VENV:-.venv-torch2}
spec=${GRADCOMP_TORCH2_SPEC:-torch>=2,<3}
wheelhouse=${GRADCOMP_WHEELHOUSE:-$HOME/.cache/gradcomp/wheelhouse}
mkdir -p "$wheelhouse"

mode=${1:-all}
case "$mode" in all|--packages-only|--skip-packages) ;; *) echo "test-torch2: unknown argument $mode" >&2; exit 2 ;; esac

pip2=("$venv2/bin/pip" --disable-pip-version-check)

# 1. the venv and its packages: the newest matching versions from PyPI, each downloaded once
if [ "$mode" != "--skip-packages" ]; then
  [ -x "$venv2/bin/python" ] || /usr/bin/python3 -m venv "$venv2"
  deps=("$spec" numpy pytest matplotlib)  # matplotlib: the experiment report's plots
  if ! "${pip2[@]}" download -q --no-cache-dir -d "$wheelhouse" "${deps[@]}"; then
    # offline: the cached wheels still serve, if there are any
    ls "$wheelhouse"/torch-2.*.whl >/dev/null 2>&1 || { echo "test-torch2: no torch 2.x wheel" >&2; exit 1; }
    echo "test-torch2: PyPI unreachable, installing from the cached wheels in $wheelhouse" >&2
  fi
  "${pip2[@]}" install -q --no-index --find-links "$wheelhouse" --upgrade "${deps[@]}"
  echo "test-torch2: packages ready in $((SECONDS - t0)) s"
fi
[ "$mode" = "--packages-only" ] && exit 0

# 2. the same extension build as .venv's: a wheel from the tree scripts/test.sh built (scikit-build
# reuses build/py-<tag>, so this is a packaging step), installed without dependencies
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
GRADCOMP_CUDA=OFF "$venv/bin/pip" wheel -q --disable-pip-version-check --no-build-isolation \
  --no-deps -w "$dist" .
"${pip2[@]}" install -q --no-deps --force-reinstall "$dist"/gradcomp-*.whl
"$venv2/bin/python" - <<'EOF'
import sys, torch, gradcomp
major = int(torch.__version__.split(".")[0])
print(f"test-torch2: torch {torch.__version__}, gradcomp {gradcomp.__version__}, "
      f"Python {sys.version.split()[0]}")
if major < 2:
    sys.exit(f"test-torch2: expected torch 2.x, got {torch.__version__}")
EOF

# 3. the pytest suite: every file (--ci-stage=newest selects them all; the stage is named so that
# the run says so and checks that no test file is unassigned)
(cd tests/python && "../../$venv2/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
  --ci-stage=newest .)
echo "test-torch2: done in $((SECONDS - t0)) s"
