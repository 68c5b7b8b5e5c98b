#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what gradcomp needs, idempotently: Debian packages from scripts/apt-packages.txt
# (only the missing ones, so a second run costs nothing), then the Python venv when asked.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t pkgs < <(grep -vE '^\s*(#|$)' scripts/apt-packages.txt)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: system packages ready"

# Python: a venv on Debian's python3 that sees Debian's torch 1.13 and numpy 1.x
# (--system-site-packages); build tools and pytest from PyPI.
if [ "${GRADCOMP_SKIP_PYTHON:-0}" != "1" ]; then
  venv=${GRADCOMP_VENV:-.venv}
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -c "import nanobind, scikit_build_core, pytest" 2>/dev/null ||
    "$venv/bin/pip" install -q --disable-pip-version-check "nanobind>=2.0" "scikit-build-core>=0.10" pytest
  echo "setup: python venv ready ($venv)"
fi
