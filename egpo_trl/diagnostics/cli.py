"""``egpo-trl diagnose RUN``: entropy of correct vs incorrect completions in ``egpo-trl eval`` records (ROC-AUC,
entropy gap, bootstrap intervals, figures)."""

from __future__ import annotations

import argparse
import csv
import glob
import json
import logging
import math
import os
import sys
from typing import Any

import numpy as np

from egpo_trl.diagnostics.metrics import SCOPES, EntropyTable, entropy_table, nan_to_none, roc_auc, scope_report
from egpo_trl.evaluation.records import iter_records
from egpo_trl.segments import DEFAULT_THINK_END, DEFAULT_THINK_START

FIGURES = ("entropy_density", "roc_thinking_vs_answer", "answer_length_vs_entropy", "thinking_vs_answer_entropy")
CSV_COLUMNS = "benchmark problem_id sample correct entropy_completion entropy_thinking entropy_answer thinking_tokens"
CSV_COLUMNS += " answer_tokens"
OUTPUT_FILES = ("diagnostics.md", "diagnostics.json", "entropies.csv", *(f"{name}.png" for name in FIGURES))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egpo-trl diagnose",
        description="Entropy diagnostics of evaluation records: ROC-AUC (Table 3), entropy gap, plots.",
    )
    parser.add_argument("records", nargs="+", help="`egpo-trl eval` run folders or records .jsonl files")
    parser.add_argument("--output-dir", help="where to write (default: <run>/diagnostics for a single run folder)")
    parser.add_argument("--benchmarks", help="comma-separated benchmark names to keep (default: all)")
    parser.add_argument("--tokenizer", help="recompute the thinking/answer split from token ids with this tokenizer")
    parser.add_argument("--think-start", default=DEFAULT_THINK_START, help="opening tag (with --tokenizer)")
    parser.add_argument("--think-end", default=DEFAULT_THINK_END, help="closing tag (with --tokenizer)")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of problems (default: 1000)")
    parser.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals (default: 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    parser.add_argument("--label", help="model name in the tables and plots (default: from the run)")
    parser.add_argument("--note", help="a line printed at the foot of every figure (machine, command)")
    parser.add_argument("--overwrite", action="store_true", help="replace earlier diagnostics in --output-dir")
    return parser


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _interval(bounds: list[float | None], digits: int = 3) -> str:
    return "" if bounds[0] is None else f" [{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]"


def format_markdown(report: dict[str, Any]) -> str:
    """The diagnostics as Markdown: a Table 3 style row, then per-scope details and per-benchmark AUCs."""
    scopes = report["scopes"]
    level = int(round(100 * report["level"]))
    lines = [
        f"## Entropy diagnostics of {report['label']}",
        "",
        f"{report['num_completions']} completions of {report['num_problems']} problems "
        f"({', '.join(report['benchmarks'])}); {report['num_incorrect']} incorrect "
        f"({_fmt(100 * report['num_incorrect'] / max(report['num_completions'], 1), 1)}%). "
        f"{report['num_with_answer_segment']} completions close their reasoning with `</think>`.",
        "",
        "ROC-AUC of the entropy proxy for predicting an incorrect answer (higher is better, 0.5 = chance):",
        "",
        "| Model | TE (thinking) | AE (answer) | Whole completion |",
        "| --- | :---: | :---: | :---: |",
        f"| {report['label']} | {_fmt(scopes['thinking']['auc_incorrect'])} | {_fmt(scopes['answer']['auc_incorrect'])} "
        f"| {_fmt(scopes['completion']['auc_incorrect'])} |",
        "",
        f"| Scope | Completions | AUC [{level}% CI] | Mean entropy, correct | Mean entropy, incorrect "
        f"| Gap (incorrect - correct) [{level}% CI] |",
        "| --- | ---: | :---: | ---: | ---: | :---: |",
    ]
    for scope in SCOPES:
        info = scopes[scope]
        lines.append(
            f"| {scope} | {info['num_completions']} ({info['num_incorrect']} incorrect) "
            f"| {_fmt(info['auc_incorrect'])}{_interval(info['auc_interval'])} "
            f"| {_fmt(info['mean_entropy_correct'], 4)} | {_fmt(info['mean_entropy_incorrect'], 4)} "
            f"| {_fmt(info['gap'], 4)}{_interval(info['gap_interval'], 4)} |"
        )
    lines += [
        "",
        f"Intervals: {report['num_resamples']} bootstrap resamples of problems (all samples of a drawn problem kept). "
        "A completion without `</think>` has no answer segment and is left out of the answer row.",
    ]
    if len(report["by_benchmark"]) > 1:
        lines += ["", "| Benchmark | Completions | Incorrect | AUC completion | AUC thinking | AUC answer |"]
        lines += ["| --- | ---: | ---: | :---: | :---: | :---: |"]
        for name, info in report["by_benchmark"].items():
            lines.append(
                f"| {name} | {info['num_completions']} | {info['num_incorrect']} | {_fmt(info['completion'])} "
                f"| {_fmt(info['thinking'])} | {_fmt(info['answer'])} |"
            )
    return "\n".join(lines) + "\n"


def diagnose(
    table: EntropyTable, label: str, num_resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
    """All numbers of the diagnostics for an :class:`EntropyTable`, ready for JSON."""
    benchmarks = list(dict.fromkeys(table.benchmark))
    by_benchmark = {}
    for name in benchmarks:
        part = np.asarray([bench == name for bench in table.benchmark])
        incorrect = ~table.correct[part]
        by_benchmark[name] = {
            "num_completions": int(part.sum()),
            "num_incorrect": int(incorrect.sum()),
            **{scope: nan_to_none(roc_auc(getattr(table, scope)[part], incorrect)) for scope in SCOPES},
        }
    report = {"label": label, "benchmarks": benchmarks, "num_completions": len(table)}
    report |= {"num_problems": int(len(np.unique(table.group))), "num_incorrect": int((~table.correct).sum())}
    report |= {"num_with_answer_segment": int((~np.isnan(table.answer)).sum()), "level": level}
    scopes = {scope: scope_report(table, scope, num_resamples, seed, level) for scope in SCOPES}
    return report | {"num_resamples": num_resamples, "scopes": scopes, "by_benchmark": by_benchmark}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not 0 < args.level < 1:
        parser.error(f"--level must be between 0 and 1, got {args.level}.")
    output_dir = args.output_dir
    try:
        files, run_label = [], None
        for path in args.records:
            if os.path.isfile(path):
                files.append(path)
                continue
            found = sorted(glob.glob(os.path.join(path, "records", "*.jsonl")) or glob.glob(f"{path}/*.jsonl"))
            if not os.path.isdir(path) or not found:
                raise FileNotFoundError(f"{path}: no records (records/*.jsonl); give an `egpo-trl eval` run folder.")
            files += found
            if run_label is None and os.path.exists(os.path.join(path, "run.json")):
                with open(os.path.join(path, "run.json"), encoding="utf-8") as handle:
                    run_label = json.load(handle).get("label")
        if output_dir is None:
            if len(args.records) != 1 or not os.path.isdir(args.records[0]):
                parser.error("--output-dir is required unless a single run folder is given.")
            output_dir = os.path.join(args.records[0], "diagnostics")
        existing = [name for name in OUTPUT_FILES if os.path.exists(os.path.join(output_dir, name))]
        if existing and not args.overwrite:
            raise ValueError(f"{output_dir} already holds {', '.join(existing)}; pass --overwrite.")
        wanted = {name.strip() for name in args.benchmarks.split(",")} if args.benchmarks else None
        records = [r for path in files for r in iter_records(path) if wanted is None or r.get("benchmark") in wanted]
        if not records:
            raise ValueError(f"no records found in {', '.join(files)}.")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else None
        table = entropy_table(records, tokenizer, args.think_start, args.think_end)
    except (FileNotFoundError, ValueError) as error:
        print(f"egpo-trl diagnose: {error}", file=sys.stderr)
        return 2
    label = args.label or run_label or "model"
    report = diagnose(table, label, args.bootstrap, args.seed, args.level)
    os.makedirs(output_dir, exist_ok=True)
    markdown = format_markdown(report)
    with open(os.path.join(output_dir, "diagnostics.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    with open(os.path.join(output_dir, "diagnostics.md"), "w", encoding="utf-8") as handle:
        handle.write(markdown)
    with open(os.path.join(output_dir, "entropies.csv"), "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS.split())
        writer.writerows(
            [table.benchmark[i], table.problem_id[i], table.sample[i], int(table.correct[i])]
            + [_fmt(float(getattr(table, scope)[i]), 6) for scope in SCOPES]
            + [int(table.thinking_tokens[i]), int(table.answer_tokens[i])]
            for i in range(len(table))
        )
    from egpo_trl.diagnostics.plots import plot_all

    plot_all(table, output_dir, title=label, note=args.note)
    print(markdown)
    print(f"Diagnostics and figures in {output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
