#!/usr/bin/env bash
# Compares the built library's ABI with the committed baseline.
#  - New functions: pass (compatible additions; listed).
#  - A removed function, or a changed function or type reachable from one
#    (parameters, struct layout, enum values): fail.
# To accept a deliberate change: append-only struct growth handled through
# struct_size, or a break with EP_MOE_VERSION_MAJOR (the SOVERSION) bumped —
# then run tests/abi/update.sh and commit the new baseline (docs/abi.md).
set -u
lib=$1 baseline=$2 headers=$3
report=$(abidiff --no-show-locs --headers-dir2 "$headers" --drop-private-types --exported-interfaces-only \
  "$baseline" "$lib" 2>&1)
rc=$?
echo "$report"
# abidiff's exit code is a bit field: 1 error, 2 usage, 4 ABI change, 8 incompatible change.
if [ $((rc & 3)) -ne 0 ]; then echo "FAIL: abidiff could not compare (exit $rc)"; exit 1; fi
if [ $((rc & 12)) -eq 0 ]; then echo "ABI check passed: no change"; exit 0; fi
removed=$(echo "$report" | sed -n 's/.*changes summary: \([0-9]*\) Removed.*/\1/p' | awk '{s += $1} END {print s + 0}')
changed=$(echo "$report" | sed -n 's/.*Removed, \([0-9]*\) Changed.*/\1/p' | awk '{s += $1} END {print s + 0}')
if [ $((rc & 8)) -ne 0 ] || [ "$removed" -ne 0 ] || [ "$changed" -ne 0 ]; then
  echo "FAIL: the ABI changed against $baseline ($removed removed, $changed changed); see docs/abi.md"
  exit 1
fi
echo "ABI check passed: only additions (refresh the baseline with tests/abi/update.sh)"
