"""Benchmark evaluation: pass@1 over ``k`` samples under the paper's protocol, resumable, with per-sample records."""

from egpo_trl.evaluation.backends import (
    Generation,
    SamplingSettings,
    TransformersBackend,
    VLLMBackend,
    default_max_new_tokens,
    load_backend,
)
from egpo_trl.evaluation.benchmarks import BENCHMARKS, BenchmarkSpec, Problem, load_problems, resolve_benchmark
from egpo_trl.evaluation.records import RecordStore, iter_records
from egpo_trl.evaluation.runner import evaluate
from egpo_trl.evaluation.scoring import score_completion
from egpo_trl.evaluation.summary import compare_runs, pass_at_1

__all__ = ["BENCHMARKS", "BenchmarkSpec", "Generation", "Problem", "RecordStore", "SamplingSettings"]
__all__ += ["TransformersBackend", "VLLMBackend", "compare_runs", "default_max_new_tokens", "evaluate"]
__all__ += ["iter_records", "load_backend", "load_problems", "pass_at_1", "resolve_benchmark", "score_completion"]
