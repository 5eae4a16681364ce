#!/usr/bin/env bash
# stop 65's second device call, from a clean tree of HEAD (ab/head.tar + ab/head.rev): the gate logits
# by one GEMM before the send kernel. The dispatch GPU tests (fused router against `route`, graphs,
# edge rows), the benchmark's GPU tests, the NVSHMEM engine tests; then bench dispatch --route gate and
# the plain grid (NVSHMEM path). On an H200 the A/B and grid of stop 61's dev.sh first (DL, default 300 s).
set -uo pipefail
t0=$(date +%s); el() { echo "--- $1 at $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rm -rf /tmp/z && mkdir -p /tmp/z && tar -C /tmp/z -xf ab/head.tar && cp -r .whl ab /tmp/z/ && cd /tmp/z || exit 1
echo "tree $(cat ab/head.rev)"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then DL=${DL:-300} bash ab/dev.sh; el dev; fi
bash benchmarks/gpu_session.sh "$OUT" install >/dev/null 2>&1; el install
export PYTHONPATH=/tmp/site ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
python3 -c "import torch; a=torch.randn(3,64,device='cuda').bfloat16(); print('mm out_dtype:', torch.mm(a, a.t(), out_dtype=torch.float32).dtype)"
DISPATCH_ARGS="--route gate --paths nvshmem" T_DISPATCH=90 bash benchmarks/gpu_session.sh "$OUT/route" dispatch 2>&1 | tail -16; el route
DISPATCH_ARGS="--paths nvshmem" T_DISPATCH=60 bash benchmarks/gpu_session.sh "$OUT/given" dispatch 2>&1 | tail -16; el given
left=$(( ${END:-585} - $(date +%s) + t0 ))
timeout $left python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 tests/test_dispatch_gpu.py \
  tests/test_bench_dispatch.py tests/test_engine_gpu.py -k "not test_engine_gpu or nvshmem" 2>&1 | tail -30 | tee "$OUT/tests.txt"
el end
