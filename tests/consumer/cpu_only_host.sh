#!/usr/bin/env bash
# A CPU-only host: libep_moe.so must not need the CUDA, NCCL or MPI
# libraries, and must load and run its CPU path where the backend modules
# are missing, or present but their libraries are not.
#   cpu_only_host.sh STAGE_LIBDIR CONSUMER_BINARY WORK_DIR
set -euo pipefail
libdir=$1 consumer=$2 work=$3
needed=$(readelf -d "$libdir/libep_moe.so" | grep NEEDED || true)
if echo "$needed" | grep -Eq 'cuda|cublas|nccl|mpi'; then
  echo "libep_moe.so needs a backend library:"; echo "$needed"; exit 1
fi
echo "libep_moe.so needs only: $(echo "$needed" | sed 's/.*\[\(.*\)\]/\1/' | tr '\n' ' ')"
rm -rf "$work" && mkdir -p "$work/no_modules" "$work/broken_modules" "$work/fake"
cp -P "$libdir"/libep_moe.so* "$work/no_modules/"
cp -P "$libdir"/libep_moe.so* "$work/broken_modules/"
# Modules that need a library this host does not have (as libcudart.so.13
# or libmpi.so.40 on a machine without CUDA or MPI).
echo 'int ep_moe_fake_dep(void) { return 1; }' > "$work/fake/dep.c"
echo 'int ep_moe_fake_dep(void); int ep_moe_cuda_module_v1(void) { return ep_moe_fake_dep(); }' > "$work/fake/mod.c"
cc -shared -fPIC "$work/fake/dep.c" -o "$work/fake/libep_moe_fake_dep.so"
for m in libep_moe_cuda.so libep_moe_mpi.so; do
  cc -shared -fPIC "$work/fake/mod.c" -L"$work/fake" -lep_moe_fake_dep -o "$work/broken_modules/$m"
done
rm "$work/fake/libep_moe_fake_dep.so"
for d in no_modules broken_modules; do
  echo "--- $d"
  out=$(env -u EP_MOE_BACKEND_DIR LD_LIBRARY_PATH="$work/$d" EP_MOE_LOG_LEVEL=info "$consumer" 2>&1)
  echo "$out"
  echo "$out" | grep -q "backends: cuda=0 nccl=0 mpi=0" || { echo "FAIL: a backend counted as present"; exit 1; }
  echo "$out" | grep -q "max |difference|" || { echo "FAIL: the CPU layer did not run"; exit 1; }
done
echo "$out" | grep -q "libep_moe_fake_dep.so: cannot open shared object file" ||
  { echo "FAIL: the loader's reason was not logged"; exit 1; }
echo "PASS: the CPU path runs without the backends"
