#!/usr/bin/env bash
# Builds consumer.c with only `pkg-config --cflags --libs ep_moe` against a
# staged install, as C99 with warnings as errors, and runs it.
set -euo pipefail
stage=$1 cc=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
pcdir=$(dirname "$(find "$stage" -name ep_moe.pc | head -n1)")
export PKG_CONFIG_PATH="$pcdir"
flags=$(pkg-config --cflags --libs ep_moe)
echo "pkg-config: $flags"
"$cc" -std=c99 -Wall -Wextra -pedantic -Werror "$here/../consumer.c" -o "$work/consumer" $flags
libdir=$(pkg-config --variable=libdir ep_moe)
LD_LIBRARY_PATH="$libdir" "$work/consumer"
