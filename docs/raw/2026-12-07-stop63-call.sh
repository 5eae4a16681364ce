#!/usr/bin/env bash
# stop 63: PLANNED, NOT RUN (no device machine could be started; then device loans were paused).
# Rebuild: ab/head.tar = git archive HEAD; ab/dev.sh = docs/raw/2026-12-07-stop61-dev-c2.sh (its new-tests
# step first, at most 150 s, then its H200 branch); ab/cg, ab/base, ab/norule as in stop 62's note.
# stop 63's device call, run from a clean tree of HEAD (ab/head.tar): on an H200, the H200 branch of
# stop 61's dev.sh (ab/dev.sh) then the GPU tests stop 62 could not run; on any other card, the whole GPU suite.
set -uo pipefail
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf /tmp/z && mkdir -p /tmp/z && tar -C /tmp/z -xf ab/head.tar && cp -r .whl ab /tmp/z/ && cd /tmp/z || exit 1
git_rev=$(cat ab/head.rev 2>/dev/null); echo "tree $git_rev"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  DL=420 bash ab/dev.sh
  export PYTHONPATH=/tmp/site ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
  left=$(( 585 - $(date +%s) + t0 ))
  timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 tests/test_metrics_cuda.py \
    tests/test_dispatch_gpu.py tests/test_engine_gpu.py -k "not test_engine_gpu or tiny_moe_checkpoints" 2>&1 | tail -30 | tee "$OUT/targeted-tests.txt"
else
  T_TESTS=$(( 585 - $(date +%s) + t0 - 40 )) bash benchmarks/gpu_session.sh "$OUT" tests
fi
echo "--- end at $(( $(date +%s) - t0 )) s"
