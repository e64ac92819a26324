#!/usr/bin/env bash
# Every test on a fresh machine: install what is missing, build the CI
# configuration (warnings are errors) and run the whole test suite, run the
# CPU suites again under ASan+UBSan and TSan, then build the parser fuzzers
# (clang, ASan+UBSan) and fuzz each for a fixed time.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test

# The reference Python writers (numpy, safetensors, gguf, ml_dtypes from PyPI) in a venv
# under build/; where they cannot be installed their tests report "skipped".
venv=build/pyref-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import numpy, safetensors, gguf, ml_dtypes" 2>/dev/null; then
  mkdir -p build
  if python3 -m venv "$venv" >/dev/null 2>&1 &&
     "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy safetensors gguf ml_dtypes >/dev/null 2>&1; then
    :
  else
    echo "note: numpy/safetensors/gguf/ml_dtypes could not be installed; the reference-writer tests will be skipped" >&2
  fi
fi
python_arg=()
[ -x "$venv/bin/python" ] && python_arg=(-DEP_MOE_PYTHON="$PWD/$venv/bin/python")

cmake --preset ci "${python_arg[@]}"
cmake --build --preset ci
ctest --preset ci

# The library and its CPU suites again under ASan+UBSan (LeakSanitizer on)
# and under TSan; any report fails the run (the presets set halt_on_error
# and build with -fno-sanitize-recover=all). Left out there: the labels
# that build or load something else (docs, header, abi, consumer, bindings,
# smoke) and MPI, whose OpenMPI runtime is not instrumented.
for san in asan tsan; do
  cmake --preset "$san" "${python_arg[@]}"
  cmake --build --preset "$san"
  ctest --preset "$san"
done

cmake --preset fuzz -DEP_MOE_FUZZ_SECONDS="${EP_MOE_FUZZ_SECONDS:-20}"
cmake --build --preset fuzz
ctest --preset fuzz
