#!/usr/bin/env bash
# Installs everything dflash needs to build and test, from Debian packages (run as root or with sudo).
set -euo pipefail
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
PKGS=(g++ cmake ninja-build pkg-config git python3 python3-pip
      nlohmann-json3-dev libcli11-dev libfmt-dev libopenblas-dev libgtest-dev libgmock-dev
      libpcre2-dev libutf8proc-dev clang)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: CUDA toolkit found: the CUDA backend will be built"
  if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: no GPU visible here: configure with -DDFLASH_CUDA=OFF for a faster CPU-only build (README: Quick start; docs/building.md)"
  fi
else
  echo "setup: no nvcc found: building the CPU backend only"
fi
echo "setup: done"
