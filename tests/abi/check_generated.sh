#!/usr/bin/env bash
# Fails when a file generated from ep_moe.h is out of date (run
# tests/abi/update.sh after changing the header).
set -euo pipefail
cd "$(dirname "$0")/../.."
hdr=include/ep_moe/ep_moe.h
gen=tools/header_model.py
status=0
check() {
  if ! diff -q <(python3 $gen "$1" $hdr) "$2" >/dev/null; then
    echo "out of date: $2 (run tests/abi/update.sh)"
    status=1
  fi
}
check rust-ffi bindings/rust/ep-moe-sys/src/ffi.rs
check layout-probe bindings/rust/ep-moe-sys/layout_probe.c
check rust-layout-test bindings/rust/ep-moe-sys/tests/layout.rs
tmp=$(mktemp -d)
cc -std=c99 -Iinclude bindings/rust/ep-moe-sys/layout_probe.c -o "$tmp/probe"
"$tmp/probe" > "$tmp/layout.txt"
if ! diff -q <(python3 $gen static-asserts $hdr "$tmp/layout.txt") src/capi/abi_layout.cpp >/dev/null; then
  echo "out of date: src/capi/abi_layout.cpp (run tests/abi/update.sh)"
  status=1
fi
rm -rf "$tmp"
[ $status -eq 0 ] && echo "generated files are current"
exit $status
