#!/usr/bin/env bash
# Regenerates everything derived from the public header and its ABI, after a
# deliberate change of ep_moe.h (see docs/abi.md):
#   - bindings/rust/ep-moe-sys/src/ffi.rs, layout_probe.c, tests/layout.rs
#   - src/capi/abi_layout.cpp (static_asserts on every public struct)
#   - tests/abi/libep_moe.abi (the abidw baseline; needs a built library)
# usage: tests/abi/update.sh [BUILD_DIR]   (default build/ci)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/ci}
hdr=include/ep_moe/ep_moe.h
gen=tools/header_model.py
python3 $gen rust-ffi $hdr > bindings/rust/ep-moe-sys/src/ffi.rs
python3 $gen layout-probe $hdr > bindings/rust/ep-moe-sys/layout_probe.c
python3 $gen rust-layout-test $hdr > bindings/rust/ep-moe-sys/tests/layout.rs
tmp=$(mktemp -d)
cc -std=c99 -Iinclude bindings/rust/ep-moe-sys/layout_probe.c -o "$tmp/probe"
"$tmp/probe" > "$tmp/layout.txt"
python3 $gen static-asserts $hdr "$tmp/layout.txt" > src/capi/abi_layout.cpp
rm -rf "$tmp"
if [ -f "$build/src/libep_moe.so" ]; then
  cmake --build "$build" --target ep_moe >/dev/null
  abidw --no-corpus-path --no-comp-dir-path --no-show-locs --headers-dir "$PWD/include/ep_moe" --drop-private-types \
    --exported-interfaces-only "$build/src/libep_moe.so" > tests/abi/libep_moe.abi
  echo "updated tests/abi/libep_moe.abi from $build/src/libep_moe.so"
else
  echo "no $build/src/libep_moe.so: the abidw baseline was not updated" >&2
fi
