#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build ep_moe in
# Release, and run the demo. Arguments are passed to ep_moe_demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
cmake --preset release >/dev/null
cmake --build --preset release --target ep_moe_demo
exec build/release/examples/ep_moe_demo "$@"
