#!/usr/bin/env bash
# stop 65's device call, run from a clean tree of HEAD (ab/head.tar + ab/head.rev).
# On an H200: the H200 branch of stop 61's dev.sh (ab/dev.sh: the .cg/.ca/norule A/B, the profiled grid,
# the split sweep, the deferred write) to the deadline DL (default 400 s), then the fused router's timing
# in what is left. On any other card: the new dispatch-benchmark GPU tests, then the fused router's timing
# (bench dispatch --route gate on the NVSHMEM path: the fused router beside torch's router then the same
# dispatch), then the plain dispatch grid (the stop-63 kernel has no dispatch figures yet).
set -uo pipefail
t0=$(date +%s); el() { echo "--- $1 at $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf /tmp/z && mkdir -p /tmp/z && tar -C /tmp/z -xf ab/head.tar && cp -r .whl ab /tmp/z/ && cd /tmp/z || exit 1
echo "tree $(cat ab/head.rev)"
ROUTE="--route gate --paths nvshmem"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  DL=${DL:-400} bash ab/dev.sh; el dev
  left=$(( 580 - $(date +%s) + t0 ))
  [ $left -gt 60 ] && DISPATCH_ARGS="$ROUTE --hidden 7168 --experts 256" T_DISPATCH=$(( left - 30 )) \
    bash benchmarks/gpu_session.sh "$OUT/route" dispatch; el route
else
  bash benchmarks/gpu_session.sh "$OUT" install >/dev/null 2>&1; el install
  export PYTHONPATH=/tmp/site ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 140 tests/test_bench_dispatch.py 2>&1 \
    | tail -8 | tee "$OUT/bench-dispatch-tests.txt"; el tests
  DISPATCH_ARGS="$ROUTE" T_DISPATCH=200 bash benchmarks/gpu_session.sh "$OUT/route" dispatch; el route
  left=$(( 575 - $(date +%s) + t0 ))
  [ $left -gt 60 ] && T_DISPATCH=$left bash benchmarks/gpu_session.sh "$OUT/given" dispatch; el given
fi
el end
