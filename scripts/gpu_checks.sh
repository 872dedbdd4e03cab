#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one run, from a source checkout on a CUDA machine:
#   bash scripts/gpu_checks.sh [results-folder]        (default: gpu-results)
# 1. the gpu-marked tests, kernels compiled; 2. every codec's encode/decode against a device
# copy; 3. the max-min and QSGD kernels alone across tile geometries; 4. what each hook adds to
# a ResNet-50 and GPT-2 step on one rank over NCCL; 5. two ranks sharing the GPU over gloo;
# 6. Chrome traces of a few ResNet-50 steps per method, on one rank and on two sharing the GPU
# (where the two-rank step spends its time above the compute). The folder is also packed as <folder>.tar.gz.
# Each step writes its log (and JSON) into the folder and the run goes on if one fails.
set -u
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
workers=$($py -c "import os; print(max(1, min(12, (os.cpu_count() or 2) - 2)))")
xdist=$($py -c "import xdist" 2>/dev/null && echo "-n $workers")
status=0
step() {  # name, command...
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$out/$name.log" 2>&1 || { status=1; echo "   failed (see $out/$name.log)"; }
    tail -n 25 "$out/$name.log"
}
step tests $py -m pytest -m gpu -q -p no:cacheprovider -rfE $xdist
step codecs $py -m gradzip bench codecs --device cuda --numel 67108864 --json "$out/codecs.json"
step geometry $py scripts/kernel_geometry.py
step overhead $py -m gradzip bench overhead --device cuda --json "$out/overhead.json"
step overhead-2ranks $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 \
    --configs maxmin4,maxmin:bits=4 --json "$out/overhead-2ranks.json"
step traces $py -m gradzip bench overhead --device cuda --models resnet50 --configs fp32,maxmin4,powersgd,torch-powersgd \
    --steps 4 --trace "$out/traces"
step traces-2ranks $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 --configs fp32,maxmin:bits=4 \
    --steps 4 --trace "$out/traces-2ranks"
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "== all of it in $out.tar.gz"
exit $status
