#!/usr/bin/env bash
# The GPU checks in one call, for a machine lent for minutes: the CUDA tests, then the GPU benchmarks, each step
# under a time limit, none started past the budget, every log and JSON written into OUT_DIR as it finishes.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [BUDGET_SECONDS] [STEP ...]
#
# Steps, in this order by default: tests (the CUDA tests and the routing and skinny kernels'), skinny (the kept
# experts' products at batch 1 in bf16: the skinny Triton kernel against torch's grouped GEMM and a copy of the same
# bytes, bench_latency.py --skinny), t3-compiled (Table 3 at batch 1 and 100 in bf16 with CUDA graphs), vit-train
# (a compiled bf16 training step of the Soft MoE ViT-S/16 against the dense one, bench_vit_train.py), t3-bf16 and
# t3-fp32 (Table 3 eager, bench_latency.py), layer-bf16 and layer-fp32 (bench_gpu.py's layer table), sweep-bf16 and
# sweep-fp32 (Algorithm 1 at every k < n against every expert, eager), selection-bf16 (bench_gpu.py's selection
# table at ViT-S batch 128, eager and compiled: about 3 minutes); on request also launches (bench_gpu_launches.py:
# kernels per eager call, the logits' and the routing kernel's A/B) and layer-compiled (the bf16 layer table at three
# shapes with the layer and the dense MLP compiled with CUDA graphs). The defaults take more than one call of the
# device's per-call limit: name the steps, or run the rest in a second call.
# The published peers are timed where they import (``make peers``, or a folder of them on PYTHONPATH).
# softmoe's native CPU kernels are not built (SOFTMOE_NATIVE=0): nothing here runs them.
set -u
usage="usage: gpu_check.sh OUT_DIR [BUDGET_SECONDS] [STEP ...]"
out=${1:?$usage}
budget=${2:-480}
if ! [[ $budget =~ ^[0-9]+$ ]]; then
    echo "gpu_check.sh: BUDGET_SECONDS must be a whole number, got '$budget'; $usage" >&2
    exit 2
fi
shift $(( $# >= 2 ? 2 : 1 ))
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests skinny t3-compiled vit-train t3-bf16 t3-fp32 layer-bf16 layer-fp32 sweep-bf16
    sweep-fp32 selection-bf16)
mkdir -p "$out" && out=$(cd "$out" && pwd) || { echo "gpu_check.sh: cannot write to $1" >&2; exit 2; }
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SOFTMOE_NATIVE=0
py=${PYTHON:-python3}
summary="$out/summary.txt"

# step NAME LIMIT_SECONDS COMMAND...: run COMMAND under the smaller of its limit and the budget left.
step() {
    local name=$1 limit=$2 left=$(( budget - SECONDS ))
    shift 2
    if (( left < 20 )); then
        echo "$name: skipped, ${left} s of the budget left" | tee -a "$summary"
        return
    fi
    (( limit > left )) && limit=$left
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc after $(( SECONDS - start )) s (limit $limit s)" | tee -a "$summary"
    tail -n 30 "$out/$name.txt"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    "$py" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())"
    lscpu | grep -m1 'Model name'
} 2>&1 | tee "$summary"

for name in "${steps[@]}"; do
    case $name in
        tests) step tests 150 "$py" -m pytest -q -p no:cacheprovider -m "not slow" -k "cuda or routing_softmaxes or skinny" \
            tests/test_devices.py tests/test_grouped_mm.py tests/test_topk.py tests/test_selection_plan.py \
            tests/test_layer.py tests/test_routing_softmaxes.py tests/test_skinny_grouped_mm.py ;;
        skinny) step skinny 120 "$py" benchmarks/bench_latency.py --skinny --device cuda --dtype bfloat16 \
            --json "$out/skinny.json" ;;
        launches) step launches 200 "$py" benchmarks/bench_gpu_launches.py ;;
        t3-bf16) step t3-bf16 120 "$py" benchmarks/bench_latency.py --device cuda --dtype bfloat16 --autotune \
            --json "$out/t3-bf16.json" ;;
        t3-fp32) step t3-fp32 150 "$py" benchmarks/bench_latency.py --device cuda --dtype float32 --autotune \
            --json "$out/t3-fp32.json" ;;
        t3-compiled) step t3-compiled 300 "$py" benchmarks/bench_latency.py --device cuda --dtype bfloat16 \
            --compile --batches 1 100 --json "$out/t3-compiled.json" ;;
        vit-train) step vit-train 240 "$py" benchmarks/bench_vit_train.py --device cuda --json "$out/vit-train.json" ;;
        sweep-bf16|sweep-fp32) step "$name" 120 "$py" benchmarks/bench_latency.py --sweep --device cuda --autotune \
            --dtype "$([ "$name" = sweep-bf16 ] && echo bfloat16 || echo float32)" --json "$out/$name.json" ;;
        layer-bf16|layer-fp32) step "$name" 120 "$py" benchmarks/bench_gpu.py --quick --tables layer \
            --dtypes "${name#layer-}" --json "$out/$name.json" ;;
        layer-compiled) step layer-compiled 300 "$py" benchmarks/bench_gpu.py --quick --tables layer \
            --dtypes bf16 --experts 8 128 --vit-batches 128 --compile --json "$out/layer-compiled.json" ;;
        selection-bf16) step selection-bf16 240 "$py" benchmarks/bench_gpu.py --quick --tables selection --autotune \
            --dtypes bf16 --vit-batches 128 --json "$out/selection-bf16.json" ;;
        *) echo "unknown step $name" | tee -a "$summary" ;;
    esac
done
echo "done after $SECONDS s" | tee -a "$summary"
