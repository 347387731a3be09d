"""``egpo-trl eval``: pass@1 of a model on math benchmarks under the paper's protocol, or a comparison of runs; an
interrupted run continues in the same ``--output-dir``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from egpo_trl.evaluation.backends import BACKENDS, SamplingSettings, default_max_new_tokens, load_backend
from egpo_trl.evaluation.benchmarks import BENCHMARKS, is_builtin, resolve_benchmark
from egpo_trl.evaluation.runner import evaluate
from egpo_trl.evaluation.scoring import ANSWER_FORMATS
from egpo_trl.evaluation.summary import compare_runs, format_summary_markdown

DEFAULT_BENCHMARKS = "math500,aime24,mmlu_stem,minerva,gsm8k"


def build_parser() -> argparse.ArgumentParser:
    description = "Mean pass@1 over k samples per problem, with per-sample records and entropy log-probs."
    parser = argparse.ArgumentParser(prog="egpo-trl eval", description=description)
    parser.add_argument("--model", help="model name on the Hub or local folder")
    benchmarks = f"comma-separated built-ins ({', '.join(BENCHMARKS)}), local files or Hub dataset names"
    parser.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS, help=benchmarks)
    parser.add_argument("--output-dir", help="run folder (records, summary); an existing run there is resumed")
    parser.add_argument("--name", help="the model's name in summary tables (default: the model folder name)")
    compare = "print two or more runs side by side (run folders or summary.json)"
    parser.add_argument("--compare", nargs="+", metavar="RUN", help=compare)
    parser.add_argument("--compare-names", nargs="+", metavar="NAME", help="labels of the --compare runs")

    protocol = parser.add_argument_group("protocol (defaults: the paper's)")
    protocol.add_argument("--num-samples", "-k", type=int, default=8, help="samples per problem (default: 8)")
    protocol.add_argument("--temperature", type=float, default=0.6, help="default 0.6; 0 for greedy decoding")
    protocol.add_argument("--top-p", type=float, default=0.95, help="default 0.95")
    protocol.add_argument("--top-k", type=int, default=20, help="default 20; 0 disables it")
    budget = "generation budget (default: 16384 when the model's chat template writes <think> tags or its name is "
    budget += "R1-Distill, else 3072 as for Qwen2.5-Math; the choice is printed)"
    protocol.add_argument("--max-new-tokens", type=int, help=budget)
    protocol.add_argument("--limit", type=int, help="only the first N problems of each benchmark")
    protocol.add_argument("--seed", type=int, default=0, help="run seed (default: 0)")
    template = "auto: when the tokenizer has one"
    protocol.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto", help=template)
    protocol.add_argument("--system-prompt", help="an optional system message")

    data = parser.add_argument_group("custom benchmarks (local files and Hub datasets; built-ins ignore these)")
    data.add_argument("--question-field", help="column with the question (or chat messages)")
    data.add_argument("--answer-field", help="column with the reference answer")
    data.add_argument("--answer-format", choices=ANSWER_FORMATS, help="how to read and compare answers")
    data.add_argument("--choices-field", help="column with the choices (multiple choice)")
    data.add_argument("--id-field", help="column with a stable problem id")
    data.add_argument("--split", help="dataset split (Hub datasets; 'test' / 'validation' for synthetic)")
    data.add_argument("--subset", help="dataset configuration (Hub datasets)")

    engine = parser.add_argument_group("backend")
    engine.add_argument("--backend", choices=BACKENDS, default="auto", help="auto (default): vLLM when installed")
    engine.add_argument("--batch-size", type=int, default=16, help="sequences per generate call (transformers; 16)")
    engine.add_argument("--chunk-size", type=int, help="sequences between two writes of records")
    engine.add_argument("--device", help="transformers device (default: cuda when available)")
    dtypes = ("auto", "bfloat16", "float16", "float32")
    engine.add_argument("--dtype", default="auto", choices=dtypes, help="auto: float32 on CPU")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM (default: 0.9)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM (default: 1)")
    engine.add_argument("--max-model-len", type=int, help="vLLM context length")
    engine.add_argument("--trust-remote-code", action="store_true")
    engine.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if args.compare:
        try:
            summaries = []
            for run in args.compare:
                path = os.path.join(run, "summary.json") if os.path.isdir(run) else run
                if not os.path.exists(path):
                    raise FileNotFoundError(
                        f"No summary at {path}; give an `egpo-trl eval` output folder or its summary.json."
                    )
                with open(path, encoding="utf-8") as handle:
                    summaries.append(json.load(handle))
            if args.compare_names and len(args.compare_names) != len(args.compare):
                parser.error(f"--compare-names got {len(args.compare_names)} names for {len(args.compare)} runs.")
            print(compare_runs(summaries, args.compare_names))
        except (FileNotFoundError, ValueError) as error:
            print(f"egpo-trl eval: {error}", file=sys.stderr)
            return 2
        return 0

    if not args.model or not args.output_dir:
        parser.error("--model and --output-dir are required (or use --compare RUN RUN ...).")
    from egpo_trl.script.resolve import check_model_exists

    model = check_model_exists(args.model, trust_remote_code=args.trust_remote_code, prog="egpo-trl eval")
    model = os.path.abspath(model) if os.path.isdir(model) else model
    # Field options describe custom data; built-ins keep their own fields (only a non-vendored split can change).
    fields = ("question_field", "answer_field", "answer_format", "choices_field", "id_field", "subset")
    try:
        specs = []
        for name in filter(None, (name.strip() for name in args.benchmarks.split(","))):
            options = {} if is_builtin(name) else {field: getattr(args, field) for field in fields}
            spec = resolve_benchmark(name, **options)
            if args.split and not spec.source.startswith("package:"):
                spec = resolve_benchmark(name, split=args.split, **options)
            specs.append(spec)
        settings = SamplingSettings(
            args.temperature, args.top_p, args.top_k, 1 if args.max_new_tokens is None else args.max_new_tokens
        )
    except ValueError as error:
        print(f"egpo-trl eval: {error}", file=sys.stderr)
        return 2
    if not specs:
        parser.error("--benchmarks is empty.")
    backend = load_backend(
        args.backend,
        model,
        **{k: getattr(args, k) for k in ("device", "dtype", "batch_size", "gpu_memory_utilization", "seed")},
        **{k: getattr(args, k) for k in ("tensor_parallel_size", "max_model_len", "trust_remote_code")},
    )
    if args.max_new_tokens is None:
        max_new_tokens, reason = default_max_new_tokens(model, getattr(backend, "tokenizer", None))
        print(f"egpo-trl eval: max_new_tokens={max_new_tokens} ({reason}); set --max-new-tokens.", file=sys.stderr)
        settings = dataclasses.replace(settings, max_new_tokens=max_new_tokens)
    try:
        options = ("num_samples", "limit", "seed", "chat_template", "system_prompt", "chunk_size")
        options = {key: getattr(args, key) for key in options} | {"label": args.name, "progress": not args.no_progress}
        summary = evaluate(backend, model, specs, args.output_dir, settings, **options)
    except (ValueError, KeyError) as error:
        print(f"egpo-trl eval: {error}", file=sys.stderr)
        return 2
    print(format_summary_markdown(summary))
    print(f"Records and summary in {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
