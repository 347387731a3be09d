#!/usr/bin/env bash
# Build a 25M-parameter math model with the tiny model's recipe on a GPU, then execute the quickstart notebook on it
# (GRPO and EGPO side by side) and keep the executed notebook, its figures and its summary table.
#
#   bash notebooks/gpu_quickstart.sh OUT_DIR [notebook parameter overrides, name=value ...]
#
# For a machine without access to the Hugging Face Hub: the notebook's default model (Qwen2.5-0.5B-Instruct) cannot
# be downloaded there, so this script builds the largest model of the project's own recipe that trains in minutes
# (hidden size 512, 8 layers; `python -m egpo_trl.tiny_model.build`), and trains on the task it was built for
# (dataset synthetic:arithmetic). With Hub access, run the notebook with its defaults instead.
# Writes OUT_DIR/build.log, OUT_DIR/small-math-qwen2/ (the built model), OUT_DIR/notebook/ (executed notebook, figures/, run/).
# PYTHON sets the interpreter (default python3). BUILD=0 reuses OUT_DIR/small-math-qwen2 from an earlier run.
set -uo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: bash notebooks/gpu_quickstart.sh OUT_DIR [name=value ...]" >&2
    exit 2
fi
OUT=$1
shift
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

if [[ ${BUILD:-1} != 0 ]]; then
    echo "building the model into $OUT/small-math-qwen2 (log: $OUT/build.log)"
    "$PY" -m egpo_trl.tiny_model.build --output "$OUT/small-math-qwen2" --device cuda \
        --hidden-size 512 --intermediate-size 1536 --num-hidden-layers 8 --num-attention-heads 8 \
        --num-key-value-heads 2 --learning-rate 1e-3 >"$OUT/build.log" 2>&1 || {
        tail -20 "$OUT/build.log"
        exit 1
    }
    tail -1 "$OUT/build.log"
fi

# The notebook's own parameters, apart from the model and dataset (see above), full fine-tuning instead of LoRA
# (the model is small enough; LoRA at the notebook's 2e-5 barely moves it in 50 steps) at the learning rate of the
# tiny recipes, and a larger held-out slice (500 problems x 4 samples) so that the before/after numbers are less noisy.
PARAMS=(
    -p "model_name_or_path=$OUT/small-math-qwen2"
    -p "dataset=synthetic:arithmetic"
    -p "use_peft=False"
    -p "learning_rate=1e-4"
    -p "num_eval_problems=500"
    -p "eval_num_samples=4"
    -p "eval_batch_size=256"
    -p "output_dir=$OUT/notebook/run"
)
for override in "$@"; do
    PARAMS+=(-p "$override")
done
echo "executing notebooks/01_quickstart.ipynb: ${PARAMS[*]}"
"$PY" notebooks/run_notebook.py notebooks/01_quickstart.ipynb --out "$OUT/notebook" "${PARAMS[@]}"
