#!/usr/bin/env bash
# cargo test --offline of bindings/rust against a staged install.
#   run_rust.sh STAGE_PREFIX LIBDIR_NAME TARGET_DIR
set -euo pipefail
stage=$1 libdir=$2 target=$3
here=$(cd "$(dirname "$0")/../.." && pwd)
if ! command -v cargo >/dev/null 2>&1; then echo "skipped: no cargo"; exit 77; fi
export PKG_CONFIG_PATH="$stage/$libdir/pkgconfig"
export CARGO_TARGET_DIR="$target"
cd "$here/bindings/rust"
cargo test --offline --quiet 2>&1
