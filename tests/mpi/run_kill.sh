#!/usr/bin/env bash
# run_kill.sh MPIEXEC NP PROGRAM: runs the SIGKILL test and checks that the
# job fails (non-zero) within 10 s and leaves no process behind.
set -u
mpiexec=$1 np=$2 prog=$3
start=$(date +%s.%N)
timeout 30 "$mpiexec" -np "$np" "$prog" >/tmp/ep_moe_mpi_kill.$$ 2>&1
rc=$?
end=$(date +%s.%N)
took=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
sleep 1
name=$(basename "$prog")
# Live processes only: a killed process may stay a zombie until its new
# parent reaps it, but it runs nothing.
left=$(ps -eo stat=,comm= | awk -v n="$name" '$2 == n && $1 !~ /^Z/' | wc -l)
echo "job exit code $rc after ${took}s; processes left: $left"
tail -5 /tmp/ep_moe_mpi_kill.$$; rm -f /tmp/ep_moe_mpi_kill.$$
[ "$rc" -ne 0 ] || { echo "FAIL: the job exited 0"; exit 1; }
[ "$rc" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout 30)"; exit 1; }
awk -v t="$took" 'BEGIN { exit !(t < 10) }' || { echo "FAIL: took ${took}s (limit 10 s)"; exit 1; }
[ "$left" -eq 0 ] || { echo "FAIL: processes left behind"; pkill -9 -x "$name"; exit 1; }
echo PASS
