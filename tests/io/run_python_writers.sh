#!/usr/bin/env bash
# run_python_writers.sh PYTHON OUT_DIR [SCRIPT]: runs SCRIPT (default
# reference_writers.py, a file beside this one), or exits 77
# (skipped) when there is no usable Python; the script itself exits 77 when
# numpy/safetensors/gguf are missing.
py=${1:-}
out=$2
script=${3:-reference_writers.py}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$out"
if [ -z "$py" ] || ! "$py" -c "import sys" >/dev/null 2>&1; then
  echo "skipped: no Python interpreter for the reference writers"
  exit 77
fi
exec "$py" "$here/$script" "$out"
