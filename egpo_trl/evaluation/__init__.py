"""Benchmark evaluation: pass@1 over ``k`` samples under the paper's protocol, resumable, with per-sample records.

The command line is ``egpo-trl eval`` (:mod:`egpo_trl.evaluation.cli`); the pieces are importable:

* :mod:`~egpo_trl.evaluation.benchmarks`: the benchmark registry, data loading and prompts;
* :mod:`~egpo_trl.evaluation.scoring`: answer extraction and comparison per benchmark;
* :mod:`~egpo_trl.evaluation.backends`: transformers and vLLM generation with per-token log-probs;
* :mod:`~egpo_trl.evaluation.records`: the append-only JSON-lines records;
* :mod:`~egpo_trl.evaluation.summary`: pass@1, standard errors, Table 1 style tables and comparisons;
* :mod:`~egpo_trl.evaluation.runner`: :func:`evaluate`, which ties them together.
"""

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

__all__ = [
    "BENCHMARKS",
    "BenchmarkSpec",
    "Generation",
    "Problem",
    "RecordStore",
    "SamplingSettings",
    "TransformersBackend",
    "VLLMBackend",
    "compare_runs",
    "default_max_new_tokens",
    "evaluate",
    "iter_records",
    "load_backend",
    "load_problems",
    "pass_at_1",
    "resolve_benchmark",
    "score_completion",
]
