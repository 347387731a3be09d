#!/usr/bin/env bash
# Run paper recipes at their real shapes through the user's own command, a few optimizer steps each, and print a
# Markdown table: peak GPU memory, seconds per step split into generation / old log-probs / the rest, tokens per
# second and the importance-sampling metrics (benchmarks/summarize_recipe_runs.py).
#
#   bash benchmarks/gpu_recipes.sh OUT_DIR SHAPES_DIR JOB [JOB ...]
#
# JOB is RECIPE[@GPUS][:ACCUMULATION], e.g. egpo_qwen15b@0,1:1 or egpo_r1_distill_7b@0,1,2,3:4. Each job runs
#   CUDA_VISIBLE_DEVICES=GPUS egpo-trl train recipes/RECIPE.yaml --model_name_or_path SHAPES_DIR/<shape> \
#       --dataset_name DATASET --prompt_template "{problem}" --max_steps STEPS --num_processes <len(GPUS)> \
#       --gradient_accumulation_steps ACCUMULATION --output_dir OUT_DIR/RECIPE/run --report_to none
# so the recipe's lengths, per-device batch, sampling, precision, DeepSpeed stage and vLLM settings are its own;
# only the model (SHAPES_DIR/<shape>, e.g. from benchmarks/real_shapes.py), the data, the step count, the process
# count and the gradient accumulation (the completions per step) change; the recipe's per_device_train_batch_size is
# written into the command (unless EXTRA sets it), so that command.txt gives the completions per GPU. Jobs listed one
# after another run in sequence; run two invocations at once on disjoint GPUs (PORT differs per invocation) to share a machine.
#
# Environment: STEPS (2), DATASET (the vendored MATH training problems), PORT (29500), PYTHON (python3),
# EXTRA (more overrides, e.g. "--save_final_model false"), PYTORCH_CUDA_ALLOC_CONF (passed on), BALLAST_GIB (hold
# each job's GPUs down to this many free GiB with benchmarks/memory_ballast.py while it runs: an 80 GB card's memory
# on a larger one; also pass the vLLM share that gives the smaller card's size, in EXTRA: the recipe's share times the
# factor the ballast prints in ballast.txt; the driver's readings in gpu_memory.csv include the ballast, the summary's
# peak does not). Both are written into command.txt. Writes OUT_DIR/RECIPE/{command.txt,train.log,gpu_memory.csv,
# exit_status,run/metrics.jsonl} and, with a ballast, ballast.txt; an existing OUT_DIR/RECIPE is never overwritten.
set -uo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: bash benchmarks/gpu_recipes.sh OUT_DIR SHAPES_DIR RECIPE[@GPUS][:ACCUMULATION] ..." >&2
    exit 2
fi
OUT=$1
SHAPES=$2
shift 2
PY=${PYTHON:-python3}
STEPS=${STEPS:-2}
PORT=${PORT:-29500}
cd "$(dirname "$0")/.." || exit 1
DATASET=${DATASET:-egpo_trl/data/benchmarks/math_train/train.json}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

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
    if [[ ! -f recipes/$recipe.yaml ]]; then
        echo "no recipe recipes/$recipe.yaml" >&2
        exit 2
    fi
    shape=${recipe#*_}
    [[ $recipe == edge_grpo_* ]] && shape=${recipe#edge_grpo_}
    if [[ ! -f $SHAPES/$shape/config.json ]]; then
        echo "no model $SHAPES/$shape (build it: python benchmarks/real_shapes.py --output $SHAPES --shapes $shape)" >&2
        exit 2
    fi
    dir=$OUT/$recipe
    if [[ -e $dir ]]; then
        echo "$dir exists: choose a new OUT_DIR (earlier runs are kept)." >&2
        exit 1
    fi
    mkdir -p "$dir"
    processes=$(awk -F, '{print NF}' <<< "$gpus")
    command=(env)
    [[ -n ${PYTORCH_CUDA_ALLOC_CONF:-} ]] && command+=(PYTORCH_CUDA_ALLOC_CONF="$PYTORCH_CUDA_ALLOC_CONF")
    [[ -n ${BALLAST_GIB:-} ]] && command+=(BALLAST_GIB="$BALLAST_GIB")  # for the record: the run ignores it
    command+=(CUDA_VISIBLE_DEVICES="$gpus" "$PY" -m egpo_trl.train "recipes/$recipe.yaml"
        --model_name_or_path "$SHAPES/$shape" --dataset_name "$DATASET" --prompt_template "{problem}"
        --max_steps "$STEPS" --num_processes "$processes" --main_process_port "$PORT"
        --output_dir "$dir/run" --report_to none)
    [[ -n $accumulation ]] && command+=(--gradient_accumulation_steps "$accumulation")
    # shellcheck disable=SC2206
    [[ -n ${EXTRA:-} ]] && command+=(${EXTRA})
    # The per-device batch written out (the recipe's unless overridden), so that command.txt alone gives the run's
    # completions per GPU even after the recipe changes.
    given=""
    for item in "${command[@]}"; do
        [[ $item =~ ^--per[-_]device[-_]train[-_]batch[-_]size(=|$) ]] && given=1
    done
    if [[ -z $given ]]; then
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
        CUDA_VISIBLE_DEVICES="$gpus" "$PY" benchmarks/memory_ballast.py --leave-gib "$BALLAST_GIB" \
            > "$dir/ballast.txt" 2>&1 &
        ballast=$!
        for _ in $(seq 300); do
            grep -q '^ready' "$dir/ballast.txt" || ! kill -0 "$ballast" 2>/dev/null && break
            sleep 1
        done
        if ! grep -q '^ready' "$dir/ballast.txt"; then
            kill "$sampler" "$ballast" 2>/dev/null
            wait "$sampler" "$ballast" 2>/dev/null
            sampler="" ballast=""
            echo "ballast 0 $gpus" > "$dir/exit_status"
            status=1
            echo "   the ballast did not start, so the job did not run: $(cat "$dir/ballast.txt")" >&2
            names+=("$recipe")
            continue
        fi
    fi
    start=$(date +%s)
    "${command[@]}" > "$dir/train.log" 2>&1
    rc=$?
    kill "$sampler" $ballast 2>/dev/null
    wait "$sampler" $ballast 2>/dev/null
    sampler="" ballast=""
    echo "$rc $(( $(date +%s) - start )) $gpus" > "$dir/exit_status"
    if [[ $rc != 0 ]]; then
        status=1
        echo "   failed (exit $rc); last lines of $dir/train.log:"
        grep -v "^\s*$" "$dir/train.log" | tail -n 25 | sed 's/^/   /'
    else
        echo "   done in $(( $(date +%s) - start ))s"
    fi
    names+=("$recipe")
done

echo
"$PY" benchmarks/summarize_recipe_runs.py "$OUT" "${names[@]}"
exit $status
