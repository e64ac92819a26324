#!/usr/bin/env bash
# The GPU check: builds the CUDA configuration (unless a build is given),
# runs the CUDA tests, runs compute-sanitizer (memcheck) on a small case, and
# runs the GPU benchmark. Prints a short table last; full results (JSON and
# logs) go to $OUT when it is set. Meant for one run on one GPU machine, in
# well under 8 minutes.
#
# usage: tests/gpu/run.sh            (builds build/gpu, Release, CUDA on)
#        EP_MOE_GPU_BUILD=DIR tests/gpu/run.sh   (uses an existing build there)
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
build=${EP_MOE_GPU_BUILD:-build/gpu}
out=${OUT:-}
log() { printf '\n== %s\n' "$*"; }
status=0
t0=$(date +%s)

if [ ! -x "$build/tests/cuda_layer_test" ] || [ ! -x "$build/bench/ep_moe_cuda_bench" ]; then
  log "building $build"
  # Debian/Ubuntu packages the build needs, when apt is there: deps.sh's build
  # set, plus catch2 for the tests (deps.sh installs it only with 'test').
  if command -v apt-get >/dev/null && command -v dpkg-query >/dev/null; then
    scripts/deps.sh build || exit 1
    dpkg-query -W catch2 >/dev/null 2>&1 || apt-get install -y -qq catch2 >/dev/null || exit 1
  fi
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEP_MOE_WITH_CUDA=ON -DEP_MOE_WITH_MPI=OFF \
    -DEP_MOE_BUILD_DOCS=OFF -DEP_MOE_BUILD_TESTS=ON >/dev/null || exit 1
  cmake --build "$build" --target cuda_layer_test nccl_test ep_moe_cuda_bench || exit 1
fi

# Where the CUDA libraries live on this machine (toolkit; NCCL may come
# with a Python wheel).
libs="$root/$build/src"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && libs="$libs:$d"; done
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$nccl_dir" ] && libs="$libs:$nccl_dir"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no NVIDIA GPU visible (nvidia-smi -L failed): the GPU check needs one" >&2
  exit 1
fi
log "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -3

run() {  # name, command...
  local name=$1
  shift
  log "$name"
  local f=/dev/null
  [ -n "$out" ] && f="$out/$name.log"
  "$@" 2>&1 | tee "$f"
  local rc=${PIPESTATUS[0]}
  local what="exit $rc"
  [ "$rc" -eq 77 ] && what="skipped: no CUDA device (nothing was checked)"
  echo "[$name] $what"
  results+=("$name: $what")
  [ "$rc" -eq 0 ] || status=1
}
results=()
run cuda_layer_test "$build/tests/cuda_layer_test"
run nccl_test "$build/tests/nccl_test"
if command -v compute-sanitizer >/dev/null; then
  EP_MOE_CUDA_QUICK=1 run sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/cuda_layer_test"
else
  results+=("sanitizer: compute-sanitizer not found")
  status=1
fi
run bench "$build/bench/ep_moe_cuda_bench"

log "summary ($(( $(date +%s) - t0 )) s)"
printf '%s\n' "${results[@]}"
[ -n "$out" ] && sed -n '/^preset (EP)/,$p' "$out/bench.log"
exit $status
