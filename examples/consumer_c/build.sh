#!/usr/bin/env bash
# Builds and runs the C example against an installed ep_moe found through
# pkg-config (set PKG_CONFIG_PATH for a non-system prefix).
#   examples/consumer_c/build.sh [OUT_DIR] [CC]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$PWD}
cc=${2:-cc}
mkdir -p "$out"
flags=$(pkg-config --cflags --libs ep_moe)
echo "pkg-config --cflags --libs ep_moe: $flags"
"$cc" -std=c99 -Wall -Wextra -pedantic -Werror "$here/main.c" -o "$out/ep_moe_consumer_c" $flags -lm
LD_LIBRARY_PATH="$(pkg-config --variable=libdir ep_moe)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$out/ep_moe_consumer_c"
