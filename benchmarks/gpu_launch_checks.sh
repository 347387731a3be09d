#!/usr/bin/env bash
# Check, on one multi-GPU host, the launch routes of a paper recipe with a small model: `accelerate launch
# recipes/<recipe>.yaml` (no accelerate options: the recipe's accelerate config is used), and a launch over two
# "machines" (two `egpo-trl train` commands on one host, each with its own GPUs, --machine_rank 0 and 1).
#
#   bash benchmarks/gpu_launch_checks.sh OUT_DIR [RECIPE]
#
# RECIPE defaults to recipes/egpo_qwen15b.yaml (DeepSpeed ZeRO-2). MODEL (default builtin:tiny-math-qwen2, a local
# folder works too) replaces the recipe's model and the synthetic task its dataset, so nothing is downloaded.
# GPUS_PER_MACHINE (default 1; 2 on a 4-GPU host) sets each simulated machine's GPUs, USE_VLLM (default false) the
# generation path, STEPS (default 2) the steps, PYTHON the interpreter. Each check writes OUT_DIR/<check>/*.log and
# OUT_DIR/<check>/run/metrics.jsonl; the script ends with one line per check.
set -uo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: bash benchmarks/gpu_launch_checks.sh OUT_DIR [RECIPE]" >&2
    exit 2
fi
OUT=$1
RECIPE=${2:-recipes/egpo_qwen15b.yaml}
PY=${PYTHON:-python3}
MODEL=${MODEL:-builtin:tiny-math-qwen2}
PER=${GPUS_PER_MACHINE:-1}
STEPS=${STEPS:-2}
USE_VLLM=${USE_VLLM:-false}
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

# The recipe at a toy size: 8 completions per device, groups of 8, no held-out check, nothing saved.
SMALL=(--model_name_or_path "$MODEL" --dataset_name synthetic:arithmetic --dataset_test_split test
    --synthetic_train_size 256 --max_prompt_length 128 --max_completion_length 64
    --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --num_generations 8 --max_steps "$STEPS"
    --eval_size 0 --report_to none --save_strategy no --save_final_model false --plot false --log_completions false
    --disable_tqdm true --use_vllm "$USE_VLLM" --vllm_max_model_length 256 --vllm_gpu_memory_utilization 0.3)
gpus() {  # gpus FIRST COUNT -> "FIRST,FIRST+1,..."
    seq -s, "$1" $(($1 + $2 - 1))
}
steps_of() {
    "$PY" -c "import json,sys; print(sum(1 for l in open(sys.argv[1]) if '\"reward\"' in l))" "$1" 2>/dev/null || echo 0
}
summary=()

# 1. accelerate launch RECIPE, no accelerate options, on 2 x PER GPUs: the recipe's accelerate config is used.
dir=$OUT/accelerate-launch-recipe
mkdir -p "$dir"
CUDA_VISIBLE_DEVICES=$(gpus 0 $((2 * PER))) "$PY" -m accelerate.commands.launch "$RECIPE" "${SMALL[@]}" \
    --num_processes $((2 * PER)) --output_dir "$dir/run" >"$dir/train.log" 2>&1
code=$?
summary+=("accelerate launch $RECIPE: exit $code, $(steps_of "$dir/run/metrics.jsonl") step(s); $(grep -m1 -o "using the recipe's.*\|Training with the launch's.*" "$dir/train.log")")

# 2. Two machines on one host: rank 0 on GPUs 0..PER-1, rank 1 on the next PER, rendezvous on 127.0.0.1.
dir=$OUT/two-machines
mkdir -p "$dir"
port=$((29600 + RANDOM % 300))
for rank in 0 1; do
    CUDA_VISIBLE_DEVICES=$(gpus $((rank * PER)) "$PER") "$PY" -m egpo_trl.train "$RECIPE" "${SMALL[@]}" \
        --num_processes $((2 * PER)) --num_machines 2 --machine_rank "$rank" --main_process_ip 127.0.0.1 \
        --main_process_port "$port" --output_dir "$dir/run" >"$dir/machine$rank.log" 2>&1 &
    pids[rank]=$!
done
wait "${pids[0]}"; code0=$?
wait "${pids[1]}"; code1=$?
summary+=("two machines ($PER GPU(s) each): exit $code0 / $code1, $(steps_of "$dir/run/metrics.jsonl") step(s)")

printf '%s\n' "${summary[@]}"
