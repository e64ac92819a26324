#!/usr/bin/env bash
# Configures, builds and runs the C++ example against an installed ep_moe.
#   examples/consumer_cpp/build.sh PREFIX [BUILD_DIR] [CMAKE]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=$1
work=${2:-$PWD/build-consumer-cpp}
cmake=${3:-cmake}
rm -rf "$work"
"$cmake" -S "$here" -B "$work" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
"$cmake" --build "$work"
"$work/ep_moe_consumer_cpp"   # the imported target carries the library's path (RPATH)
