#!/usr/bin/env bash
# stop 64's device call, from a clean tree of HEAD (ab/head.tar): on an H200, the H200 branch of stop 61's
# dev.sh (ab/dev.sh, deadline DL) first; on any card, the NVSHMEM engine tests that failed at 2cec7c5
# (their PE context lacked all_gather_object), then the rest of tests/test_engine_gpu.py.
set -uo pipefail
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf /tmp/z && mkdir -p /tmp/z && tar -C /tmp/z -xf ab/head.tar && cp -r .whl ab /tmp/z/ && cd /tmp/z || exit 1
echo "tree $(cat ab/head.rev)"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  DL=300 bash ab/dev.sh
else
  bash benchmarks/gpu_session.sh "$OUT" install >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
left=$(( 585 - $(date +%s) + t0 ))
timeout $left python3 -m pytest -q -s -m gpu -p no:cacheprovider --timeout 240 tests/test_engine_gpu.py \
  -k nvshmem > "$OUT/nvshmem-engine-tests.txt" 2>&1; tail -25 "$OUT/nvshmem-engine-tests.txt"
echo "--- end at $(( $(date +%s) - t0 )) s"
