#!/usr/bin/env bash
# Every C and C++ source in the tree is formatted as .clang-format says.
#   check.sh SOURCE_DIR
set -euo pipefail
src=$1
command -v clang-format >/dev/null 2>&1 || { echo "skipped: no clang-format"; exit 77; }
git -C "$src" rev-parse >/dev/null 2>&1 || { echo "skipped: not a git checkout"; exit 77; }
cd "$src"
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.c' '*.cu' '*.cuh' '*.inc' | grep -v '^bindings/')
clang-format --dry-run --Werror "${files[@]}"
echo "${#files[@]} files formatted as .clang-format says"
