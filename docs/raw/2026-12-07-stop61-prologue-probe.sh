#!/usr/bin/env bash
# written in stop 61, not run (no device time left): a probe of the B = 1 prologue with the kernel's code fetched from DRAM (flush only)
# against fetched into L2 first (--warm-code), two rounds alternating.
set -uo pipefail
o=$OUT; bash benchmarks/gpu_session.sh "$o" install >/dev/null 2>&1
export PYTHONPATH=/tmp/site ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1 PYTHONUNBUFFERED=1
T="python3 benchmarks/attention_timeline.py --batches 1 --lengths 131072 --json"
for r in 1 2; do
  timeout 60 $T >>"$o/tl.txt" 2>&1; timeout 60 $T --warm-code >>"$o/tl.txt" 2>&1
done
grep -E "code warm|^# |prologue|first stage|main loop|last done" "$o/tl.txt" | grep -v '^{'
