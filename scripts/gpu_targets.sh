#!/usr/bin/env bash
# The GPU targets of docs/gpu.md in under ten minutes (every step time-limited), from a source checkout on a CUDA machine:
#   bash scripts/gpu_targets.sh [results-folder]        (default: gpu-targets)
# 1. the gpu-marked tests, kernels compiled, and DDP over NCCL and CUDA tensors over gloo
# (tests/frontends/test_cuda.py); 2. what each hook adds to a ResNet-50 and GPT-2 step on one
# rank over NCCL, three runs in fresh processes (the machine's speed drifts between runs: compare
# within one), then once with every DDP built with gradient_as_bucket_view=True; 3. two ranks
# sharing the GPU over gloo, ResNet-50, with and without bucket views. Each step writes its log
# and JSON into the folder (packed as <folder>.tar.gz after each step) and the run goes on if one
# fails or runs past its time limit. For profiles and kernel geometry: scripts/gpu_checks.sh.
set -u
out=${1:-gpu-targets}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
workers=$($py -c "import os; print(max(1, min(12, (os.cpu_count() or 2) - 2)))")
xdist=$($py -c "import xdist" 2>/dev/null && echo "-n $workers")
status=0
start=$(date +%s)
step() {  # name, time limit (s), command...
    local name=$1 limit=$2; shift 2
    echo "== [$(( $(date +%s) - start ))s] $name: $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1 || { status=1; echo "   failed or timed out (see $out/$name.log)"; }
    # a test run's summary line, a table's rows (the lines with a step time), or the error
    grep -E "(passed|failed|skipped).* in [0-9.]+s|^ .*[0-9] +[0-9.]+×|no DDP|error:" "$out/$name.log" | cut -c1-110 | tail -n 16
    tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
}
one=fp32,torch-fp16,torch-powersgd,maxmin4,maxmin:bits=4,powersgd
two=fp32,maxmin:bits=4,maxmin4
step tests 100 $py -m pytest -m gpu -q -p no:cacheprovider -rfE $xdist
step cuda-frontends 60 $py -m pytest -q -p no:cacheprovider -rfE tests/frontends/test_cuda.py
for i in 1 2 3; do
    step "overhead-$i" 75 $py -m gradzip bench overhead --device cuda --configs "$one" --json "$out/overhead-$i.json"
done
step overhead-bucket-view 75 $py -m gradzip bench overhead --device cuda --configs "$one" --bucket-view \
    --json "$out/overhead-bucket-view.json"
step overhead-2ranks 50 $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 --configs "$two" \
    --json "$out/overhead-2ranks.json"
step overhead-2ranks-bucket-view 50 $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 \
    --configs "$two" --bucket-view --json "$out/overhead-2ranks-bucket-view.json"
echo "== [$(( $(date +%s) - start ))s] all of it in $out.tar.gz"
exit $status
