#!/usr/bin/env bash
# Installs the Debian packages ep_moe's build, tests and demo need, only when
# missing (quiet and fast when everything is present). Usage:
#   scripts/deps.sh [build|test]      (default: test, which is a superset)
set -euo pipefail
what=${1:-test}

build_pkgs=(cmake ninja-build g++ pkg-config nlohmann-json3-dev libopenmpi-dev openmpi-bin
            libdnnl-dev ocl-icd-opencl-dev)
test_pkgs=(catch2 doxygen clang clang-format libclang-rt-14-dev python3 python3-venv golang-go abigail-tools
           libopenblas-dev)
# libdnnl-dev: the matrix engine module (libep_moe_onednn.so) and the GEMM
# engine benchmark; ocl-icd-opencl-dev is only a Recommends of it, but
# Debian's dnnl-config.cmake needs OpenCL (find_package(OpenCL REQUIRED)),
# and --no-install-recommends leaves it out. libopenblas-dev: that
# benchmark only.

pkgs=("${build_pkgs[@]}")
if [ "$what" = test ]; then pkgs+=("${test_pkgs[@]}"); fi

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "ep_moe: installing missing packages: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "ep_moe: not root and no sudo: install ${missing[*]} yourself" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
