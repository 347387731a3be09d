#!/usr/bin/env bash
# `egpo-trl eval` at the paper's protocol on one GPU: the vLLM backend on a MATH-500 slice, killed mid-run and
# resumed, then the transformers backend on a smaller slice of the same problems; prints wall time and completion
# tokens per second of each, and checks that the resumed run holds every (problem, sample) exactly once.
#
#   bash benchmarks/gpu_eval.sh OUT_DIR MODEL
#
# Environment: VLLM_LIMIT (64 problems), HF_LIMIT (2 problems; 0 skips it), KILL_AFTER (records written before the kill: 128),
# CHUNK (sequences between two writes of records with vLLM: 128), MAX_NEW_TOKENS (3072), PYTHON (python3),
# GPU_MEMORY_UTILIZATION (vLLM, 0.9; on a CPU build of vLLM a share of RAM such as 0.25).
# The protocol is the paper's: k = 8 samples, temperature 0.6, top-p 0.95, top-k 20.
set -uo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: bash benchmarks/gpu_eval.sh OUT_DIR MODEL" >&2
    exit 2
fi
OUT=$1
MODEL=$2
PY=${PYTHON:-python3}
VLLM_LIMIT=${VLLM_LIMIT:-64}
HF_LIMIT=${HF_LIMIT:-2}
KILL_AFTER=${KILL_AFTER:-128}
CHUNK=${CHUNK:-128}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-3072}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
COMMON=(--model "$MODEL" --benchmarks math500 --max-new-tokens "$MAX_NEW_TOKENS" --no-progress)

count() { [[ -f $1 ]] && wc -l < "$1" || echo 0; }

# 1. vLLM, killed once KILL_AFTER records are on disk, then resumed with the same command.
run_vllm=("$PY" -m egpo_trl.cli eval "${COMMON[@]}" --backend vllm --limit "$VLLM_LIMIT" --chunk-size "$CHUNK"
    --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.9}"
    --output-dir "$OUT/vllm")
records=$OUT/vllm/records/math500.jsonl
t0=$(date +%s.%N)
# In a session of its own, so that the kill takes vLLM's engine process too (as a lost node or job would).
setsid "${run_vllm[@]}" > "$OUT/vllm_first.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null && (( $(count "$records") < KILL_AFTER )); do sleep 1; done
sleep 5
kill -9 -- "-$pid" 2>/dev/null && killed=yes || killed=no
wait "$pid" 2>/dev/null
sleep 3
before=$(count "$records")
first=$(date +%s.%N)
"${run_vllm[@]}" > "$OUT/vllm_resume.log" 2>&1
rc_vllm=$?
second=$(date +%s.%N)

# 2. transformers on the first HF_LIMIT problems (0: skipped).
start=$(date +%s.%N)
rc_hf=skipped
if (( HF_LIMIT > 0 )); then
    "$PY" -m egpo_trl.cli eval "${COMMON[@]}" --backend transformers --limit "$HF_LIMIT" --batch-size 16 \
        --output-dir "$OUT/transformers" > "$OUT/transformers.log" 2>&1
    rc_hf=$?
fi
hf=$(date +%s.%N)

"$PY" - "$OUT" "$killed" "$before" "$t0" "$first" "$second" "$rc_vllm" "$start" "$hf" "$rc_hf" "$VLLM_LIMIT" "$HF_LIMIT" <<'EOF'
import json, sys
from collections import Counter
from pathlib import Path

out, killed, before, t0, t1, t2, rc_vllm, t3, t4, rc_hf, vllm_limit, hf_limit = sys.argv[1:]
first, second, hf = float(t1) - float(t0), float(t2) - float(t1), float(t4) - float(t3)
def load(path):
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []
vllm = load(f"{out}/vllm/records/math500.jsonl")
keys = Counter((r["problem_id"], r["sample"]) for r in vllm)
expected = int(vllm_limit) * 8
tokens = sum(r["num_completion_tokens"] for r in vllm)
hf_rows = load(f"{out}/transformers/records/math500.jsonl")
hf_tokens = sum(r["num_completion_tokens"] for r in hf_rows)
try:
    import torch
    card = torch.cuda.get_device_name(0)
except Exception:
    card = "?"
print(f"Card: {card}")
print("| backend | problems x k | completions | completion tokens | wall s | completion tok/s | exit |")
print("| --- | --- | --- | --- | --- | --- | --- |")
wall = float(first) + float(second)
print(f"| vllm (killed, resumed) | {vllm_limit} x 8 | {len(vllm)} | {tokens} | {wall:.0f} ({float(first):.0f} + {float(second):.0f}) | {tokens / wall:.0f} | {rc_vllm} |")
if hf_rows:
    print(f"| transformers | {hf_limit} x 8 | {len(hf_rows)} | {hf_tokens} | {hf:.0f} | {hf_tokens / hf:.0f} | {rc_hf} |")
print()
duplicates = sum(1 for c in keys.values() if c > 1)
print(f"kill: {killed}, records before the resume {before}; after: {len(vllm)} records, {len(keys)} distinct of "
      f"{expected} expected, {duplicates} duplicated -> {'OK' if len(keys) == expected == len(vllm) else 'MISMATCH'}")
EOF
