#!/usr/bin/env bash
# The user's literal `accelerate launch recipes/RECIPE.yaml` on the random-weight Qwen2.5-1.5B shape, one process,
# the recipe's full per-GPU batch, a coin-flip reward: benchmarks/gpu_checks.sh with LAUNCH=accelerate.
#
#   QWEN_TIKTOKEN=/path/qwen.tiktoken [STEPS=3] bash benchmarks/literal_launch.sh RECIPE RESULTS
LAUNCH=accelerate STEPS=${STEPS:-3} exec bash "$(dirname "$0")/gpu_checks.sh" fullbatch "${2:?RESULTS}" "${1:?RECIPE}@0"
