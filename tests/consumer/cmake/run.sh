#!/usr/bin/env bash
# Configures, builds and runs the find_package(ep_moe CONFIG) consumer.
set -euo pipefail
stage=$1 cmake=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
"$cmake" -S "$here" -B "$work" -DCMAKE_PREFIX_PATH="$stage" -DCMAKE_BUILD_TYPE=Release >/dev/null
"$cmake" --build "$work"
"$work/consumer"   # the imported target carries the library's full path (RPATH)
