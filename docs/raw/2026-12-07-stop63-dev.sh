#!/usr/bin/env bash
# stop 63: PLANNED, NOT RUN. The H200 branch of docs/raw/2026-12-07-stop61-dev-c2.sh without its new-tests step (ab/dev63.sh).
set -uo pipefail
o=$OUT/w; mkdir -p "$o" ab/base
trap 'tar -C "$OUT" -czf "$OUT/w.tgz" w && rm -rf "$OUT/w"' EXIT
t0=$(date +%s); el() { echo "--- $1 at $(( $(date +%s) - t0 )) s"; }
# room N: true while the call's deadline DL (seconds from the start) leaves N seconds for the next step
room() { [ $(( $(date +%s) - t0 + $1 )) -le ${DL:-580} ]; }
bash benchmarks/gpu_session.sh "$o" install >/dev/null 2>&1
export PYTHONPATH=/tmp/site ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1 PYTHONUNBUFFERED=1
find ab -name __pycache__ -prune -exec rm -rf {} +
cat "$o/machine.txt" | head -3; el install
A="python3 benchmarks/attention.py --json"
GRID="--batches 1,8,32 --lengths 8192,32768,131072"
WIRE="python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 240 tests/test_engine_gpu.py -k fp8_rows_over_nvshmem"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo CARD H200
  room 170 && timeout 170 benchmarks/ab.sh "$o/ab" "$A --no-defer --no-fp16 --reps 20 $GRID --splits 0" ab/cg ab/base ab/norule >/dev/null; el ab
  python3 benchmarks/ab_report.py "$o/ab/ab.jsonl"
  room 40 && timeout 40 $A --no-defer --reps 20 $GRID --profile >"$o/grid1.txt" 2>&1; el grid1
  room 40 && timeout 40 $A --no-defer --reps 20 --batches 32,8,1 --lengths 131072,32768,8192 --profile >"$o/grid2.txt" 2>&1; el grid2
  mkdir -p "$o/tables" && cp runtime/attention/split_tables/* "$o/tables/"
  room 120 && timeout 120 python3 benchmarks/split_table.py --sweep 2 --batches 1,8,32 --out "$o/sweep" --write --dir "$o/tables" >"$o/sweep.txt" 2>&1; el sweep
  tail -30 "$o/sweep.txt"
  room 45 && timeout 45 $A --no-fp16 --batches 1,8 --lengths 32768,131072 >"$o/defer-default.txt" 2>&1; el defer1
  room 45 && timeout 45 $A --no-fp16 --batches 1,8 --lengths 32768,131072 --write-kv fp2:fb=1,fbblk=32,tail=1,window=47 >"$o/defer-fbblk32.txt" 2>&1; el defer2
  grep -v '^{' "$o/grid1.txt" | tail -14; grep -v '^{' "$o/defer-default.txt" | tail -6
fi
el end
