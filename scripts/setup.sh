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
