#!/usr/bin/env bash
# stop 64's last call, for an H200 only (at most 486 s of device budget left): the H200 branch of stop 61's
# dev.sh (ab/dev.sh) to a 240 s deadline: the .cg/.ca/norule A/B and the profiled grid. On any other
# card it stops at once (the GPU suite's failures of this stop have passed on an H100 already).
# With DL=130 (the last try, 306 s of budget left) dev.sh reaches only its new tests and the profiled grid.
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: nothing to run"; exit 0; }
rm -rf /tmp/z && mkdir -p /tmp/z && tar -C /tmp/z -xf ab/head.tar && cp -r .whl ab /tmp/z/ && cd /tmp/z || exit 1
echo "tree $(cat ab/head.rev)"
DL=${DL:-240} bash ab/dev.sh
