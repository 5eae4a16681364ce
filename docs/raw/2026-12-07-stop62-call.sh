#!/usr/bin/env bash
# stop 62's device call: the prologue probe on any GPU; on an H200, then the H200 branch of ab/dev.sh.
set -uo pipefail
t0=$(date +%s)
timeout 200 bash ab/probe.sh
echo "--- probe done at $(( $(date +%s) - t0 )) s"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  DL=$(( ${DL:-580} - $(date +%s) + t0 )) bash ab/dev.sh
fi
