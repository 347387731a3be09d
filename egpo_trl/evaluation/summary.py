"""Pass@1 over ``k`` samples with its standard error, and summary tables laid out like the paper's Table 1."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from egpo_trl.evaluation.benchmarks import BENCHMARKS, PAPER_ORDER


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _mean(values: Sequence[float | None]) -> float:
    values = [value for value in values if not _missing(value)]
    return statistics.fmean(values) if values else float("nan")


def _stderr(values: Sequence[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


def pass_at_1(correct: dict[str, dict[int, bool]], num_samples: int) -> dict[str, float]:
    """Mean pass@1 (%) over problems from ``{problem_id: {sample: correct}}`` (samples ``>= num_samples`` ignored),
    with its standard error over the ``k`` trials and over problems."""
    per_problem = []
    per_trial: dict[int, list[float]] = defaultdict(list)
    for samples in correct.values():
        kept = {sample: bool(value) for sample, value in samples.items() if sample < num_samples}
        if not kept:
            continue
        per_problem.append(_mean([float(value) for value in kept.values()]))
        for sample, value in kept.items():
            per_trial[sample].append(float(value))
    trials = [_mean(values) for _, values in sorted(per_trial.items())]
    return {
        "pass@1": 100 * _mean(per_problem),
        "stderr_trials": 100 * _stderr(trials),
        "stderr_problems": 100 * _stderr(per_problem),
    }


def benchmark_stats(records: Iterable[dict[str, Any]], num_samples: int, num_problems: int) -> dict[str, Any]:
    """Summary numbers of one benchmark."""
    correct: dict[str, dict[int, bool]] = defaultdict(dict)
    by_level: dict[str, dict[str, dict[int, bool]]] = defaultdict(lambda: defaultdict(dict))
    lengths: list[int] = []
    finished = truncated = extracted = unreadable = unscored = 0
    for record in records:  # a sample without a verdict is left out of pass@1 and counted
        problem, sample, verdict = str(record["problem_id"]), int(record["sample"]), record["correct"]
        if sample >= num_samples:
            continue
        finished += 1
        unscored += verdict is None
        level = (record.get("meta") or {}).get("level")
        for table in (correct, by_level[str(level)] if level is not None else {}) if verdict is not None else ():
            table.setdefault(problem, {})[sample] = bool(verdict)
        extracted += record.get("extracted") is not None
        if record.get("finish_reason") == "prompt_too_long":
            unreadable += 1
            continue
        truncated += record.get("finish_reason") == "length"
        lengths.append(int(record.get("num_completion_tokens") or len(record.get("completion_ids") or [])))
    stats = pass_at_1(correct, num_samples)
    stats |= {"num_problems": num_problems, "num_samples": num_samples, "finished_samples": finished}
    stats |= {"unscored_samples": unscored, "complete": finished == num_problems * num_samples}
    stats["mean_completion_tokens"] = _mean(lengths)
    for key, count in (("truncated", truncated), ("answered", extracted), ("prompt_too_long", unreadable)):
        stats[f"{key}_percent"] = 100 * count / finished if finished else float("nan")
    if by_level:
        stats["pass@1_by_level"] = {
            level: pass_at_1(by_level[level], num_samples)["pass@1"]
            for level in sorted(by_level, key=lambda text: (len(text), text))
        }
    return {key: None if isinstance(value, float) and math.isnan(value) else value for key, value in stats.items()}


def _display_name(name: str, info: dict[str, Any]) -> str:
    return info.get("display_name") or (BENCHMARKS[name].display_name if name in BENCHMARKS else name)


def _ordered(names: Iterable[str]) -> list[str]:  # the paper's order first
    names = list(dict.fromkeys(names))
    known = [name for name in PAPER_ORDER if name in names]
    return known + [name for name in names if name not in known]


def _cell(value: float | None, digits: int = 2) -> str:
    return "n/a" if _missing(value) else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table with the first column left-aligned and the others centred."""
    lines = [header, ["---"] + [":---:"] * (len(header) - 1), *rows]
    return ["| " + " | ".join(cells) + " |" for cells in lines]


def format_summary_markdown(summary: dict[str, Any]) -> str:
    """A run's summary as Markdown: a Table 1 style row (pass@1 ± SE over trials) and a detail table."""
    benchmarks = summary["benchmarks"]
    names = _ordered(benchmarks)
    header = ["Model"] + [_display_name(name, benchmarks[name]) for name in names]
    row = [summary.get("label") or summary.get("model", "model")]
    for name in names:
        info = benchmarks[name]
        se = info["stderr_trials"]
        cell = _cell(info["pass@1"]) + ("" if _missing(se) else f" ± {_cell(se)}")
        row.append(cell + ("" if info["complete"] else " (partial)"))
    if len(names) > 1:
        header.append("Average")
        row.append(_cell(_mean([benchmarks[name]["pass@1"] for name in names])))
    protocol = summary.get("protocol", {})
    lines = [
        f"## Pass@1 (%) of {row[0]}",
        "",
        *_table(header, [row]),
        "",
        f"Mean pass@1 over k = {protocol.get('num_samples', '?')} samples per problem ± its standard error over "
        f"the k trials; temperature {protocol.get('temperature')}, top-p {protocol.get('top_p')}, "
        f"top-k {protocol.get('top_k')}, at most {protocol.get('max_new_tokens')} new tokens, "
        f"backend {summary.get('backend', '?')}.",
        "",
        "| Benchmark | Problems | k | Pass@1 (%) | SE over trials | SE over problems | Boxed answer (%) "
        "| Truncated (%) | Prompt too long (%) | Mean tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        info = benchmarks[name]
        lines.append(
            f"| {_display_name(name, info)} | {info['num_problems']} | {info['num_samples']} | {_cell(info['pass@1'])} "
            f"| {_cell(info['stderr_trials'])} | {_cell(info['stderr_problems'])} | {_cell(info['answered_percent'], 1)} "
            f"| {_cell(info['truncated_percent'], 1)} | {_cell(info.get('prompt_too_long_percent'), 1)} "
            f"| {_cell(info['mean_completion_tokens'], 1)} |"
        )
    return "\n".join(lines) + "\n"


def compare_runs(summaries: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> str:
    """Two or more runs side by side in Markdown, each pass@1 with its delta to the first run; the average is over
    the benchmarks that every run has."""
    if len(summaries) < 2:
        raise ValueError("--compare needs at least two runs.")
    labels = labels or [
        summary.get("label") or summary.get("model", f"run {i}") for i, summary in enumerate(summaries)
    ]
    names = _ordered(name for summary in summaries for name in summary["benchmarks"])
    display = {}
    for name, info in ((name, info) for summary in summaries for name, info in summary["benchmarks"].items()):
        display.setdefault(name, _display_name(name, info))
    common = [name for name in names if all(name in summary["benchmarks"] for summary in summaries)]
    rows = []
    base = summaries[0]["benchmarks"]
    base_average = _mean([base[name]["pass@1"] for name in common])
    for index, (label, summary) in enumerate(zip(labels, summaries)):
        cells = [label + (" (baseline)" if index == 0 else "")]
        for name in names:
            info = summary["benchmarks"].get(name)
            if info is None:
                cells.append("n/a")
                continue
            cell = _cell(info["pass@1"])
            if index > 0 and name in base and not _missing(info["pass@1"]) and not _missing(base[name]["pass@1"]):
                cell += f" ({info['pass@1'] - base[name]['pass@1']:+.2f})"
            if not info.get("complete", True):
                cell += " (partial)"
            cells.append(cell)
        average = _mean([summary["benchmarks"][name]["pass@1"] for name in common])
        delta = index > 0 and not _missing(average) and not _missing(base_average)
        cells.append(_cell(average) + (f" ({average - base_average:+.2f})" if delta else ""))
        rows.append(cells)
    lines = _table(["Model"] + [display[name] for name in names] + ["Average"], rows)
    if len(common) < len(names):
        shared = ", ".join(display[name] for name in common) or "none"
        lines += ["", f"Average over the benchmarks that every run has: {shared}."]
    settings = {
        label: {key: summary.get("protocol", {}).get(key) for key in ("num_samples", "temperature", "top_p", "top_k")}
        for label, summary in zip(labels, summaries)
    }
    if len({json.dumps(value, sort_keys=True) for value in settings.values()}) > 1:
        lines += ["", "Warning: the runs used different sampling settings: " + json.dumps(settings)]
    return "\n".join(lines) + "\n"
