#!/usr/bin/env bash
# Every test on a fresh machine: install what is missing, build the CI
# configuration (warnings are errors) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
cmake --preset ci
cmake --build --preset ci
ctest --preset ci
