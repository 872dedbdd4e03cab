#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one run, from a source checkout on a CUDA machine:
#   bash scripts/gpu_checks.sh [results-folder]              (default: gpu-results)
#   bash scripts/gpu_checks.sh --targets [results-folder]    (default: gpu-targets)
# Everything: 1. the gpu-marked tests, kernels compiled; 2. every codec's encode/decode against
# a device copy; 3. the max-min and QSGD kernels alone across tile geometries; 4. what each hook
# adds to a ResNet-50 and GPT-2 step on one rank over NCCL; 5. two ranks sharing the GPU over
# gloo; 6. Chrome traces of a few ResNet-50 steps per method, on one rank and on two sharing the
# GPU (where the two-rank step spends its time above the compute); 7. the GPU memory each method
# adds to fp32 DDP's on ResNet-50's gradient set.
# --targets, the targets at the end of docs/gpu.md in under ten minutes (every step
# time-limited): the gpu-marked tests and tests/frontends/test_cuda.py (DDP over NCCL, CUDA
# tensors over gloo); the GPU memory each method adds on ResNet-50's gradient set; the codecs
# whose statistics the row-statistics kernel makes, against a device copy; what each
# hook adds on one rank, four runs in fresh processes (the machine's speed drifts between runs:
# compare within one, and read the per-turn column), every other one with every DDP built with
# gradient_as_bucket_view=True (what the guide recommends on GPUs), the last two after two
# ranks sharing the GPU, ResNet-50, with and without them.
# Each step writes its log (and JSON) into the folder, packed as <folder>.tar.gz after each step,
# and the run goes on if one fails or runs past its limit.
set -u
targets=0
if [ "${1:-}" = "--targets" ]; then targets=1; shift; fi
out=${1:-$([ $targets = 1 ] && echo gpu-targets || echo gpu-results)}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
workers=$($py -c "import os; print(max(1, min(12, (os.cpu_count() or 2) - 2)))")
xdist=$($py -c "import xdist" 2>/dev/null && echo "-n $workers")
status=0
start=$(date +%s)
mem=fp32,torch-fp16,maxmin:bits=4,maxmin:bits=4:in_place=true,maxmin:bits=4:memory=residual,powersgd,powersgd:in_place=true,topk
step() {  # name, time limit (s), command...
    local name=$1 limit=$2; shift 2
    echo "== [$(( $(date +%s) - start ))s] $name: $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1 || { status=1; echo "   failed or timed out (see $out/$name.log)"; }
    # a test run's summary line, a table's rows (the lines with a step time or a ratio), or the error
    grep -E "(passed|failed|skipped).* in [0-9.]+s|^ .*[0-9] +[0-9.]+×|^ .* [+-][0-9]+\.[0-9]+ *$|no DDP|error:" "$out/$name.log" \
        | cut -c1-140 | tail -n 25
    tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
}
if [ $targets = 1 ]; then
    # (maxmin:bits=4:in_place=true: each DDP bucket averaged where it lies, no group buffer)
    one=fp32,torch-fp16,torch-powersgd,maxmin4,maxmin:bits=4,maxmin:bits=4:in_place=true,powersgd,powersgd:in_place=true
    two=fp32,maxmin:bits=4,maxmin4,maxmin:bits=4:in_place=true
    # (the steps' limits add up to more than ten minutes: the ones a short lease needs most come first)
    step tests 150 $py -m pytest -m gpu -q -p no:cacheprovider -rfE $xdist
    step cuda-frontends 120 $py -m pytest -q -p no:cacheprovider -rfE tests/frontends/test_cuda.py
    step memory 120 $py -m gradzip bench memory --device cuda --workers 1 --configs "$mem" --json "$out/memory.json"
    # the codecs whose scales or means the row-statistics kernel makes, against a device copy
    step codecs-row-stats 60 $py -m gradzip bench codecs --device cuda --numel 67108864 \
        --codecs onebit,efsignsgd,terngrad,u8bit,natural,maxmin --json "$out/codecs-row-stats.json"
    overhead() {  # run number
        step "overhead-$1" 75 $py -m gradzip bench overhead --device cuda --configs "$one" --json "$out/overhead-$1.json"
        step "overhead-bucket-view-$1" 75 $py -m gradzip bench overhead --device cuda --configs "$one" --bucket-view \
            --json "$out/overhead-bucket-view-$1.json"
    }
    overhead 1
    step overhead-2ranks 50 $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 --configs "$two" \
        --json "$out/overhead-2ranks.json"
    step overhead-2ranks-bucket-view 50 $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 \
        --configs "$two" --bucket-view --json "$out/overhead-2ranks-bucket-view.json"
    overhead 2
else
    step tests 600 $py -m pytest -m gpu -q -p no:cacheprovider -rfE $xdist
    step codecs 600 $py -m gradzip bench codecs --device cuda --numel 67108864 --json "$out/codecs.json"
    step geometry 600 $py scripts/kernel_geometry.py
    step overhead 600 $py -m gradzip bench overhead --device cuda --json "$out/overhead.json"
    step overhead-2ranks 600 $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 \
        --configs maxmin4,maxmin:bits=4 --json "$out/overhead-2ranks.json"
    # the codecs that take a group by its parts or were fused late: what each adds to a step
    step overhead-groups 600 $py -m gradzip bench overhead --device cuda --models resnet50 \
        --configs fp32,signsgd,tbq,efsignsgd,onebit,terngrad,natural,signum,topk,randomk \
        --json "$out/overhead-groups.json"
    step traces 600 $py -m gradzip bench overhead --device cuda --models resnet50 --configs fp32,maxmin4,powersgd,torch-powersgd \
        --steps 4 --trace "$out/traces"
    step traces-2ranks 600 $py -m gradzip bench overhead --device cuda --workers 2 --models resnet50 --configs fp32,maxmin:bits=4 \
        --steps 4 --trace "$out/traces-2ranks"
    step memory 600 $py -m gradzip bench memory --device cuda --workers 1 --configs "$mem" --json "$out/memory.json"
    # last (the earlier steps' results come back if the device time ends here): the sparsifiers
    # INCEPTIONN and SketchML, fused or taken by parts
    step overhead-sparse 600 $py -m gradzip bench overhead --device cuda --models resnet50 \
        --configs fp32,threshold,inceptionn,graddrop,dgc,adaq,sketchml,sketchml:ratio=0.01 --json "$out/overhead-sparse.json"
fi
echo "== [$(( $(date +%s) - start ))s] all of it in $out.tar.gz"
exit $status
