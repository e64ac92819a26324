#!/bin/sh
# with_fixture.sh PATH COMMAND [ARGS...]: runs COMMAND, or exits 77
# (skipped) when PATH is absent. For tests of files that a Python writer
# test makes (io.arch_writers, io.quant_writers): where numpy, safetensors
# or gguf could not be installed those writers report "skipped" and make
# nothing, so the tests of their files are skipped too, not failed. A
# writer that fails keeps its dependants from running at all (CTest
# fixtures), so a broken writer still fails the run.
path=$1
shift
if [ ! -e "$path" ]; then
  echo "skipped: $path is absent (its Python writer test was skipped: no numpy/safetensors/gguf)"
  exit 77
fi
exec "$@"
