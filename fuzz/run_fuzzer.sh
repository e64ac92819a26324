#!/usr/bin/env bash
# run_fuzzer.sh FUZZER WORK_CORPUS SEED_CORPUS SECONDS
# Fuzzes for a fixed time from the seeds; new inputs go to WORK_CORPUS (the
# seed folder is never written). Fails on any crash, sanitizer report, leak,
# timeout or allocation above 64 MB.
set -euo pipefail
fuzzer=$1 work=$2 seeds=$3 seconds=$4
mkdir -p "$work"
exec "$fuzzer" -max_total_time="$seconds" -malloc_limit_mb=64 -rss_limit_mb=2048 -timeout=10 \
  -max_len=8192 -print_final_stats=1 "$work" "$seeds"
