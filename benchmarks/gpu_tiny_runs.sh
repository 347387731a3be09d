#!/usr/bin/env bash
# Train the tiny math model for a few steps through `egpo-trl train` on 1 GPU, and on 2 GPUs with DDP, DeepSpeed
# ZeRO-2 and ZeRO-3, then print a Markdown table: per-step time (median of TRL's step_time), final reward and the
# egpo/* metrics of the last step.
#
#   bash benchmarks/gpu_tiny_runs.sh OUT_DIR [MODEL] [--cpu]
#
# MODEL defaults to builtin:tiny-math-qwen2 (a local folder works too). Every run writes OUT_DIR/<setup>/train.log
# and OUT_DIR/<setup>/run/metrics.jsonl. STEPS (default 10) sets the number of steps, PYTHON the interpreter.
# The runs use `python -m egpo_trl.train` (the one-command path: a recipe field `accelerate_config` makes it run
# `accelerate launch`), so the package only needs to be importable (PYTHONPATH), not installed.
# --cpu: a check of this script without a GPU: one process, and DDP over 2 processes on CPU (gloo).
set -uo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: bash benchmarks/gpu_tiny_runs.sh OUT_DIR [MODEL] [--cpu]" >&2
    exit 2
fi
OUT=$1
MODEL=builtin:tiny-math-qwen2
CPU=0
for arg in "${@:2}"; do
    case $arg in
        --cpu) CPU=1 ;;
        *) MODEL=$arg ;;
    esac
done
PY=${PYTHON:-python3}
STEPS=${STEPS:-10}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# NVLink multicast off (it can take a shared host's GPUs out of service); nothing is downloaded.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

# The CPU demo recipe, shortened: 8 prompts x 8 completions = 64 completions per step on every setup.
COMMON=(recipes/demo_tiny_cpu.yaml --model_name_or_path "$MODEL" --max_steps "$STEPS" --eval_size 0
    --save_final_model false --plot false --report_to none --disable_tqdm true --seed 0)
if [[ $CPU == 1 ]]; then
    DEVICE=(--use_cpu true --bf16 false)
    # accelerate's DDP config without bf16 mixed precision, for gloo on CPU.
    sed -e "s/^mixed_precision: .*/mixed_precision: 'no'/" recipes/accelerate/ddp.yaml > "$OUT/ddp_cpu.yaml"
    SETUPS=("cpu-1proc" "cpu-ddp-2proc")
else
    DEVICE=(--use_cpu false --bf16 true)
    SETUPS=("1gpu" "ddp-2gpu" "zero2-2gpu" "zero3-2gpu")
fi

status=0
for setup in "${SETUPS[@]}"; do
    dir="$OUT/$setup"
    if [[ -e $dir ]]; then
        echo "$dir exists: choose a new OUT_DIR (earlier runs are kept)." >&2
        exit 1
    fi
    mkdir -p "$dir"
    case $setup in
        1gpu) env=(CUDA_VISIBLE_DEVICES=0); launch=(--accelerate_config none --per_device_train_batch_size 64) ;;
        cpu-1proc) env=(CUDA_VISIBLE_DEVICES=); launch=(--accelerate_config none --per_device_train_batch_size 64) ;;
        cpu-ddp-2proc) env=(CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1)
            launch=(--accelerate_config "$OUT/ddp_cpu.yaml" --num_processes 2 --per_device_train_batch_size 32) ;;
        ddp-2gpu) env=(CUDA_VISIBLE_DEVICES=0,1)
            launch=(--accelerate_config recipes/accelerate/ddp.yaml --num_processes 2 --per_device_train_batch_size 32) ;;
        zero2-2gpu) env=(CUDA_VISIBLE_DEVICES=0,1)
            launch=(--accelerate_config recipes/accelerate/zero2.yaml --num_processes 2 --per_device_train_batch_size 32) ;;
        zero3-2gpu) env=(CUDA_VISIBLE_DEVICES=0,1)
            launch=(--accelerate_config recipes/accelerate/zero3.yaml --num_processes 2 --per_device_train_batch_size 32) ;;
    esac
    command=(env "${env[@]}" "$PY" -m egpo_trl.train "${COMMON[@]}" "${DEVICE[@]}" "${launch[@]}" --output_dir "$dir/run")
    printf '%q ' "${command[@]}" > "$dir/command.txt"
    echo "== $setup: $(cat "$dir/command.txt")"
    start=$(date +%s)
    "${command[@]}" > "$dir/train.log" 2>&1
    rc=$?
    echo "$rc $(( $(date +%s) - start ))" > "$dir/exit_status"
    if [[ $rc != 0 ]]; then
        status=1
        echo "   failed (exit $rc); last lines of $dir/train.log:"
        tail -n 15 "$dir/train.log" | sed 's/^/   /'
    else
        echo "   done in $(( $(date +%s) - start ))s"
    fi
done

echo
"$PY" benchmarks/summarize_runs.py "$OUT" "${SETUPS[@]}"
exit $status
