"""A reproduction of the paper's comparison (Tables 1-3) on the shipped tiny math model, every run through ``egpo-trl train``.

GRPO, DAPO (with dynamic sampling), EDGE-GRPO (with and without Guided Error Correction), NSR, EGPO and the EGPO
ablations C1-C6, each trained with the same budget (the tiny CPU recipes; only the method's fields differ) for several
seeds, then scored on the synthetic task's held-out ``test`` split. ``--task tiny`` (default) runs the tiny recipes
as they are, levels 1-5; ``--task active`` levels 4-6, where about a third of the groups are entirely incorrect, so
NSR and EGPO's clamp act (150 held-out problems x 8 samples; 5 seeds for GRPO, DAPO, both EDGE-GRPO variants and
EGPO, 3 for the rest), and each trained model is also sampled with ``egpo-trl eval`` and read by ``egpo-trl diagnose``
(the entropy's ROC-AUC and gap, Table 3) before and after training.

    python benchmarks/reproduce.py --task active --device cuda --parallel 46 --threads 1 --output /tmp/repro
    python benchmarks/reproduce.py --task active --methods GRPO EGPO --seeds 0 --max-steps 3 --eval-size 12 \\
        --parallel 1 --output /tmp/reproduce_smoke   # a CPU smoke run

With several visible GPUs, run i goes to card i % (number of cards). Writes each run's folder under ``--output``,
then ``reproduction.json`` (one object per run: accuracies before and after with their sampling errors, the
all-incorrect share, EGPO's clamp shares and weights, the entropy gap and AUCs, the card), ``summary.json`` (the
same), ``tables.md`` (per-method means over seeds, paired differences against GRPO with a paired t-test and a sign
test) and ``headline.png``. Finished runs are read back, not trained again (``--rerun`` retrains them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
EGPO = "demo_tiny_cpu.yaml"
EDGE = "tiny_cpu_edge_grpo.yaml"

#: name -> (recipe, extra command-line overrides). Only the method's fields differ between rows.
METHODS: dict[str, tuple[str, list[str]]] = {
    "GRPO": ("tiny_cpu_grpo.yaml", []),
    "DAPO": ("tiny_cpu_dapo.yaml", []),
    "EDGE-GRPO": (EDGE, []),
    "EDGE-GRPO GEC all-incorrect": (EDGE, ["--edge_gec_scope", "all_incorrect_groups"]),
    "EDGE-GRPO no GEC": (EDGE, ["--edge_gec", "false"]),
    "NSR": ("tiny_cpu_nsr.yaml", []),
    "EGPO": (EGPO, []),
    "C1 symmetric": (EGPO, ["--egpo_clamp", "symmetric"]),
    "C2 neg<=1 only": (EGPO, ["--egpo_clamp", "negative_only"]),
    "C3 pos>=1 only": (EGPO, ["--egpo_clamp", "positive_only"]),
    "C4 NSR w=1": (EGPO, ["--egpo_nsr_weighting", "unit"]),
    "C5 clamp->renorm": (EGPO, ["--egpo_renorm", "after_clamp"]),
    "C6 renorm->clamp": (EGPO, ["--egpo_renorm", "before_clamp"]),
}
ABLATIONS = [name for name in METHODS if name[:1] == "C" and name[1:2].isdigit()]


@dataclass(frozen=True)
class Task:
    """A task preset: flags added to every run, and which methods run with which seeds by default."""

    description: str
    overrides: list[str]
    levels: str
    eval_size: int
    eval_num_samples: int
    max_completion_length: int = 80
    #: methods run with ``core_seeds`` by default; the others in ``methods`` with ``other_seeds``.
    core_methods: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    core_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    other_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    diagnostics: bool = False


TASKS: dict[str, Task] = {
    "tiny": Task(
        description="the tiny recipes' task: synthetic arithmetic, levels 1-5",
        overrides=[],
        levels="1,2,3,4,5",
        eval_size=200,
        eval_num_samples=4,
        methods=[name for name in METHODS if name != "EDGE-GRPO GEC all-incorrect"],
    ),
    "active": Task(
        description="synthetic arithmetic, levels 4-6: right on about a fifth of samples, a third of groups "
        "entirely incorrect",
        overrides=["--synthetic_levels", "4,5,6", "--eval_size", "150", "--eval_num_samples", "8"],
        levels="4,5,6",
        eval_size=150,
        eval_num_samples=8,
        core_methods=["GRPO", "DAPO", "EDGE-GRPO GEC all-incorrect", "EDGE-GRPO no GEC", "EGPO"],
        methods=["GRPO", "DAPO", "EDGE-GRPO GEC all-incorrect", "EDGE-GRPO no GEC", "NSR", "EGPO", *ABLATIONS],
        core_seeds=[0, 1, 2, 3, 4],
        other_seeds=[0, 1, 2],
        diagnostics=True,
    ),
}

#: Steps over which the share of all-incorrect groups "at the start" is averaged.
START_STEPS = 10


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def plan_jobs(task: Task, methods: list[str] | None, seeds: list[int] | None) -> list[tuple[str, int]]:
    """The ``(method, seed)`` runs: the given seeds for every method, else the task's seeds per method."""
    methods = methods or task.methods
    if seeds is not None:
        return [(m, s) for s in seeds for m in methods]
    jobs = []
    for seed in sorted(set(task.core_seeds) | set(task.other_seeds)):
        for method in methods:
            if seed in (task.core_seeds if method in task.core_methods else task.other_seeds):
                jobs.append((method, seed))
    return jobs


def _env(args, gpu: int | None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if gpu is not None:  # one process must see one GPU (several make Trainer wrap the model in DataParallel)
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def _call(command: list[str], log_path: Path, env: dict[str, str], mode: str = "w") -> int:
    with open(log_path, mode) as log:
        return subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def heldout_file(task: Task, args) -> Path:
    """Write the task's held-out problems (the ``test`` split the runs evaluate on) as JSON lines, once."""
    from egpo_trl.data.synthetic import make_arithmetic_dataset

    size = args.eval_size if args.eval_size is not None else task.eval_size
    path = Path(args.output) / f"heldout_problems_{task.levels.replace(',', '-')}_{size}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = make_arithmetic_dataset(split="test", num_problems=size, levels=task.levels, seed=0)
        columns = ("prompt", "answer", "level", "id")
        path.write_text("".join(json.dumps({c: row[c] for c in columns}) + "\n" for row in rows))
    return path


def diagnose_model(model: str, seed: int, out: Path, problems: Path, task: Task, args, gpu: int | None) -> dict:
    """Sample the held-out problems with ``egpo-trl eval`` and read the entropies with ``egpo-trl diagnose``.

    Returns the numbers of ``diagnostics.json`` this comparison reports (or ``{"failed": True}``).
    """
    report = out / "diagnostics" / "diagnostics.json"
    if report.exists() and not args.rerun:
        return _diagnostic_numbers(json.loads(report.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    samples = args.eval_num_samples or task.eval_num_samples
    python = [sys.executable, "-m", "egpo_trl.cli"]
    evaluate = python + ["eval", "--model", model, "--benchmarks", str(problems), "--output-dir", str(out / "eval")]
    evaluate += ["--question-field", "prompt", "--answer-field", "answer", "--id-field", "id"]
    evaluate += ["--num-samples", str(samples), "--temperature", "1.0", "--top-p", "1.0", "--top-k", "0"]
    evaluate += ["--max-new-tokens", str(task.max_completion_length), "--seed", str(seed), "--no-progress"]
    evaluate += ["--backend", "transformers", "--device", args.device, "--batch-size", "256"]
    diagnose = python + ["diagnose", str(out / "eval"), "--output-dir", str(out / "diagnostics"), "--overwrite"]
    diagnose += ["--bootstrap", str(args.bootstrap), "--seed", str(seed)]
    env = _env(args, gpu)
    log = out / "diagnostics_log.txt"
    if _call(evaluate, log, env) != 0 or _call(diagnose, log, env, mode="a") != 0:
        print(f"  FAILED diagnostics of {model} (seed {seed}); see {log}", flush=True)
        return {"failed": True}
    return _diagnostic_numbers(json.loads(report.read_text()))


def _diagnostic_numbers(report: dict) -> dict:
    scopes = report["scopes"]
    return {
        "auc_thinking": scopes["thinking"]["auc_incorrect"],
        "auc_answer": scopes["answer"]["auc_incorrect"],
        "auc_completion": scopes["completion"]["auc_incorrect"],
        "gap": scopes["completion"]["gap"],
        "gap_thinking": scopes["thinking"]["gap"],
        "gap_answer": scopes["answer"]["gap"],
        "accuracy": 1 - report["num_incorrect"] / max(report["num_completions"], 1),
    }


def run_one(method: str, seed: int, task: Task, args, gpu: int | None = None, card: str = "cpu") -> dict:
    """Train one (method, seed) with ``egpo-trl train`` (unless its results exist) and collect its record."""
    recipe, overrides = METHODS[method]
    out = Path(args.output) / f"{slug(method)}-seed{seed}"
    diagnostics = task.diagnostics and not args.no_diagnostics
    wall = None
    if not (out / "heldout.json").exists() or args.rerun:
        out.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "egpo_trl.train", "--config", str(RECIPES / recipe), *overrides]
        command += task.overrides
        command += ["--seed", str(seed), "--output_dir", str(out), "--overwrite_output_dir", "true"]
        command += ["--disable_tqdm", "true", "--save_final_model", "true" if diagnostics else "false"]
        if args.device == "cuda":
            command += ["--use_cpu", "false"]
        if args.max_steps:
            command += ["--max_steps", str(args.max_steps)]
        if args.eval_size is not None:
            command += ["--eval_size", str(args.eval_size)]
        if args.eval_num_samples is not None:
            command += ["--eval_num_samples", str(args.eval_num_samples)]
        start = time.time()
        returncode = _call(command, out / "log.txt", _env(args, gpu))
        wall = time.time() - start
        if returncode != 0:
            print(f"  FAILED {method} seed {seed} (exit {returncode}); see {out / 'log.txt'}", flush=True)
            return {"method": method, "seed": seed, "failed": True, "card": card}
        (out / "run_info.json").write_text(json.dumps({"card": card, "wall_s": wall, "command": command}) + "\n")
    elif (out / "run_info.json").exists():
        info = json.loads((out / "run_info.json").read_text())
        card, wall = info.get("card", card), info.get("wall_s")
    record = collect(method, seed, out, wall)
    record["card"] = card
    if diagnostics:
        record["diagnostics_after"] = diagnose_model(str(out), seed, out, heldout_file(task, args), task, args, gpu)
    print(
        f"  {method:28s} seed {seed}: {record['before']:.1%} -> {record['after']:.1%}  "
        f"all-incorrect at start {_fmt_opt(record['frac_all_incorrect_start'], pct=True)}",
        flush=True,
    )
    return record


def _metric_means(rows: list[dict], key: str, first: int | None = None, last: int | None = None) -> float | None:
    values = [r[key] for r in rows if key in r and r[key] is not None]
    if first is not None:
        values = values[:first]
    if last is not None:
        values = values[-last:]
    return statistics.mean(values) if values else None


def sampling_error(accuracy: float, num_samples: int) -> float:
    """Binomial standard error of an accuracy measured on ``num_samples`` samples."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / max(num_samples, 1))


def collect(method: str, seed: int, out: Path, wall: float | None) -> dict:
    """One run's record from its ``heldout.json`` and ``metrics.jsonl``."""
    heldout = json.loads((out / "heldout.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "heldout/accuracy" not in r and "train_runtime" not in r]  # training steps only
    before, after = heldout["before"], heldout["after"]
    n_before = before["num_problems"] * before["num_samples"]
    n_after = after["num_problems"] * after["num_samples"]
    gap_end = _metric_means(steps, "egpo/entropy_gap", last=10)
    informative = _metric_means(steps, "dynamic_sampling/frac_informative", first=START_STEPS)
    return {
        "method": method,
        "seed": seed,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "accuracy_before_se": sampling_error(before["accuracy"], n_before),
        "accuracy_after_se": sampling_error(after["accuracy"], n_after),
        "accuracy_before_by_level": before.get("by_level", {}),
        "accuracy_after_by_level": after.get("by_level", {}),
        "heldout_problems": after["num_problems"],
        "heldout_samples": after["num_samples"],
        "steps": len(steps),
        "frac_all_incorrect_start": _metric_means(steps, "egpo/frac_all_incorrect", first=START_STEPS),
        "frac_all_incorrect_mean": _metric_means(steps, "egpo/frac_all_incorrect"),
        "frac_uninformative_start": None if informative is None else 1 - informative,
        "frac_at_lambda_min": _metric_means(steps, "egpo/frac_at_lambda_min"),
        "frac_at_lambda_max": _metric_means(steps, "egpo/frac_at_lambda_max"),
        "weight_correct": _metric_means(steps, "egpo/weight_correct"),
        "weight_incorrect": _metric_means(steps, "egpo/weight_incorrect"),
        "entropy_gap_start": _metric_means(steps, "egpo/entropy_gap", first=10),
        "entropy_gap_end": gap_end,
        "wall_s": wall,
        # names of the tiny table, kept for older readers of summary.json
        "before": before["accuracy"],
        "after": after["accuracy"],
        "gap": gap_end if gap_end is not None else float("nan"),
    }


# --- statistics over seeds -------------------------------------------------------------------------------------


def sign_test(ahead: int, behind: int) -> float:
    """Two-sided exact sign test: the probability of a split at least this uneven when ahead and behind are equally
    likely (ties left out). ``1.0`` with no untied pair."""
    n = ahead + behind
    if n == 0:
        return 1.0
    k = min(ahead, behind)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_t_test(diffs: list[float]) -> tuple[float | None, float | None]:
    """``(t, two-sided p)`` of a one-sample t-test of the paired differences against 0; ``None`` for fewer than two
    differences. All-equal nonzero differences give an infinite t and p = 0."""
    if len(diffs) < 2:
        return None, None
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    if std == 0:
        return (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / (std / math.sqrt(len(diffs)))
    from scipy import stats

    return t, float(2 * stats.t.sf(abs(t), df=len(diffs) - 1))


def paired_against(records: list[dict], method: str, baseline: str = "GRPO", key: str = "accuracy_after") -> dict:
    """Paired comparison of ``method`` against ``baseline`` on ``key``, over the seeds both finished.

    A seed fixes the held-out samples' draw and the rollouts' random stream, so runs of two methods with the same
    seed start from the same accuracy: the paired difference removes that share of the seed-to-seed spread.
    """
    base = {r["seed"]: r[key] for r in records if r["method"] == baseline and not r.get("failed")}
    diffs = [
        r[key] - base[r["seed"]]
        for r in sorted(records, key=lambda r: r["seed"])
        if r["method"] == method and r["seed"] in base and not r.get("failed") and r.get(key) is not None
    ]
    ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    t, p = paired_t_test(diffs)
    return {
        "method": method,
        "baseline": baseline,
        "seeds": len(diffs),
        "mean": statistics.mean(diffs) if diffs else None,
        "std": statistics.stdev(diffs) if len(diffs) > 1 else None,
        "ahead": ahead,
        "behind": behind,
        "tied": len(diffs) - ahead - behind,
        "t": t,
        "p_t": p,
        "p_sign": sign_test(ahead, behind),
    }


def _values(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None and r[key] == r[key]]


def _diag(rows: list[dict], stage: str, key: str) -> list[float]:
    return [r[stage][key] for r in rows if isinstance(r.get(stage), dict) and r[stage].get(key) is not None]


def _fmt_opt(value: float | None, pct: bool = False, digits: int = 3) -> str:
    if value is None or value != value:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.{digits}f}"


def fmt(values: list[float], pct: bool = True, signed: bool = False, digits: int = 3) -> str:
    """``mean ± std`` of ``values`` (in points when ``pct``); ``-`` when empty."""
    if not values:
        return "-"
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    if pct:
        return f"{100 * mean:+.1f} ± {100 * std:.1f}" if signed else f"{100 * mean:.1f} ± {100 * std:.1f}"
    return f"{mean:+.{digits}f} ± {std:.{digits}f}" if signed else f"{mean:.{digits}f} ± {std:.{digits}f}"


def tables_markdown(records: list[dict], methods: list[str], baseline: str = "GRPO") -> str:
    """The comparison's tables as Markdown: accuracy, paired differences, the mechanisms at work, entropy."""
    ok = {m: [r for r in records if r["method"] == m and not r.get("failed")] for m in methods}
    lines = [
        "Held-out accuracy (mean ± std over seeds; the error of one run's accuracy is its binomial sampling error)",
        "",
        "| method | seeds | before (%) | after (%) | change (points) | sampling error of one run (points) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method in methods:
        rows = ok[method]
        failed = sum(r["method"] == method and bool(r.get("failed")) for r in records)
        if not rows:
            lines.append(f"| {method} | 0 ({failed} failed) | | | | |")
            continue
        change = [r["accuracy_after"] - r["accuracy_before"] for r in rows]
        se = statistics.mean(r["accuracy_after_se"] for r in rows)
        seeds = f"{len(rows)}" + (f" ({failed} failed)" if failed else "")
        lines.append(
            f"| {method} | {seeds} | {fmt(_values(rows, 'accuracy_before'))} | {fmt(_values(rows, 'accuracy_after'))} "
            f"| {fmt(change, signed=True)} | {100 * se:.1f} |"
        )
    if ok.get(baseline):
        lines += [
            "",
            f"Paired difference in held-out accuracy after training, each method minus {baseline}, same seeds "
            "(paired t-test and two-sided sign test):",
            "",
            "| method | seeds | mean difference (points) | std | ahead / behind / tied | t | p (t-test) | p (sign test) |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for method in methods:
            if method == baseline:
                continue
            pair = paired_against(records, method, baseline)
            if not pair["seeds"]:
                continue
            std = "-" if pair["std"] is None else f"{100 * pair['std']:.1f}"
            lines.append(
                f"| {method} | {pair['seeds']} | {100 * pair['mean']:+.1f} | {std} | {pair['ahead']} / "
                f"{pair['behind']} / {pair['tied']} | {_fmt_opt(pair['t'], digits=2)} | {_fmt_opt(pair['p_t'])} "
                f"| {pair['p_sign']:.3f} |"
            )
    lines += [
        "",
        f"The mechanisms at work during training (means over steps, then over seeds; all-incorrect groups over the "
        f"first {START_STEPS} steps; for DAPO the groups it trains on are the informative ones, so its uninformative "
        "share is given too; EGPO weights at a clamp bound: raw weights at or beyond lambda_min / lambda_max):",
        "",
        "| method | all-incorrect groups, first steps (%) | uninformative groups, first steps (%) | at lambda_min (%) "
        "| at lambda_max (%) | weight of correct | weight of incorrect |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method in methods:
        rows = ok[method]
        if rows:
            lines.append(
                f"| {method} | {fmt(_values(rows, 'frac_all_incorrect_start'))} "
                f"| {fmt(_values(rows, 'frac_uninformative_start'))} | {fmt(_values(rows, 'frac_at_lambda_min'))} "
                f"| {fmt(_values(rows, 'frac_at_lambda_max'))} | {fmt(_values(rows, 'weight_correct'), pct=False)} "
                f"| {fmt(_values(rows, 'weight_incorrect'), pct=False)} |"
            )
    lines += [
        "",
        "Entropy (per-token NLL) of incorrect minus correct completions, and the ROC-AUC of the entropy for "
        "predicting an incorrect answer in the thinking (TE) and in the answer (AE), as `egpo-trl diagnose` computes "
        "them on fresh held-out samples, before (the starting model) and after training; the training-time gap is "
        "`egpo/entropy_gap` over the first and last 10 steps:",
        "",
        "| method | training gap, first -> last steps | held-out gap before | after | change | TE AUC before | after "
        "| AE AUC before | after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method in methods:
        rows = ok[method]
        if not rows:
            continue
        change = [
            r["diagnostics_after"]["gap"] - r["diagnostics_before"]["gap"]
            for r in rows
            if all(isinstance(r.get(s), dict) and r[s].get("gap") is not None for s in ("diagnostics_before",
                                                                                        "diagnostics_after"))
        ]  # fmt: skip
        lines.append(
            f"| {method} | {fmt(_values(rows, 'entropy_gap_start'), pct=False, signed=True)} -> "
            f"{fmt(_values(rows, 'entropy_gap_end'), pct=False, signed=True)} "
            f"| {fmt(_diag(rows, 'diagnostics_before', 'gap'), pct=False, signed=True)} "
            f"| {fmt(_diag(rows, 'diagnostics_after', 'gap'), pct=False, signed=True)} "
            f"| {fmt(change, pct=False, signed=True)} "
            f"| {fmt(_diag(rows, 'diagnostics_before', 'auc_thinking'), pct=False)} "
            f"| {fmt(_diag(rows, 'diagnostics_after', 'auc_thinking'), pct=False)} "
            f"| {fmt(_diag(rows, 'diagnostics_before', 'auc_answer'), pct=False)} "
            f"| {fmt(_diag(rows, 'diagnostics_after', 'auc_answer'), pct=False)} |"
        )
    return "\n".join(lines) + "\n"


def headline_figure(records: list[dict], methods: list[str], path: Path, baseline: str = "GRPO") -> Path | None:
    """The headline comparison as a PNG: each method's held-out accuracy change (every seed, and the mean with its
    standard deviation), and its paired difference against ``baseline`` after training (same seeds). ``None`` when
    no run finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {m: [r for r in records if r["method"] == m and not r.get("failed")] for m in methods}
    shown = [m for m in methods if rows[m]]
    if not shown:
        return None
    paired = [m for m in shown if m != baseline and rows.get(baseline)]
    fig, axes = plt.subplots(1, 2 if paired else 1, figsize=(12 if paired else 6.5, 0.45 * len(shown) + 1.8))
    axes = list(axes) if paired else [axes]

    def panel(ax, names, values_of, title, xlabel):
        for y, name in enumerate(names):
            values = [100 * v for v in values_of(name)]
            ax.scatter(values, [y] * len(values), s=14, color="0.55", zorder=2)
            if values:
                mean = statistics.mean(values)
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                ax.errorbar(mean, y, xerr=std, fmt="o", color="C3" if name == "EGPO" else "C0", capsize=3, zorder=3)
        ax.axvline(0, color="0.3", lw=0.8)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)

    panel(
        axes[0],
        shown,
        lambda m: [r["accuracy_after"] - r["accuracy_before"] for r in rows[m]],
        "Held-out accuracy change (dots: seeds; bar: mean ± std)",
        "points",
    )
    if paired:
        base = {r["seed"]: r["accuracy_after"] for r in rows[baseline]}
        panel(
            axes[1],
            paired,
            lambda m: [r["accuracy_after"] - base[r["seed"]] for r in rows[m] if r["seed"] in base],
            f"After training, minus {baseline} (same seed)",
            "points",
        )
    card = next((r.get("card") for r in records if r.get("card")), None)
    if card:
        counts = sorted({len(runs) for runs in rows.values() if runs})
        seeds = " or ".join(str(n) for n in counts)
        fig.suptitle(f"{seeds} seeds per method (dots); {card}", fontsize=9, y=0.995)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def card_name(device: str, gpu: int | None) -> str:
    """The card a run used, for the records (the CPU's kind on CPU)."""
    if device == "cuda" and gpu is not None:
        import torch

        return torch.cuda.get_device_name(gpu)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="tiny", help="task preset (see above)")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS), metavar="METHOD")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the task's seeds per method")
    parser.add_argument("--parallel", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-steps", type=int, default=None, help="override the recipes' max_steps")
    parser.add_argument("--eval-size", type=int, default=None, help="override the task's held-out problems")
    parser.add_argument("--eval-num-samples", type=int, default=None, help="override the samples per problem")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples of the diagnostics")
    parser.add_argument("--no-diagnostics", action="store_true", help="skip the entropy diagnostics (active task)")
    parser.add_argument("--output", default=None, help="default: benchmarks/results/reproduce[_<task>]")
    parser.add_argument("--rerun", action="store_true", help="rerun runs whose results already exist")
    args = parser.parse_args(argv)
    task = TASKS[args.task]
    if args.output is None:
        args.output = str(
            ROOT / "benchmarks" / "results" / ("reproduce" if args.task == "tiny" else f"reproduce_{args.task}")
        )
    if args.parallel < 1:
        parser.error("--parallel must be at least 1.")
    jobs = plan_jobs(task, args.methods, args.seeds)
    methods = list(dict.fromkeys(m for m, _ in jobs))
    seeds = sorted({s for _, s in jobs})
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("--device cuda but no GPU is visible; run on a GPU machine or pass --device cpu.")
    diagnostics = task.diagnostics and not args.no_diagnostics
    print(f"{len(jobs)} runs on the {args.task} task ({task.description}), {args.parallel} at a time, on "
          f"{args.device}", flush=True)  # fmt: skip
    start = time.time()
    Path(args.output).mkdir(parents=True, exist_ok=True)

    def gpu_of(i: int) -> int | None:
        return i % gpus if gpus else None

    starting: dict[int, dict] = {}
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        if diagnostics:  # the starting model, once per seed, beside the runs
            from egpo_trl.tiny_model import tiny_model_path

            problems = heldout_file(task, args)
            futures = {
                seed: pool.submit(
                    diagnose_model,
                    str(tiny_model_path()),
                    seed,
                    Path(args.output) / f"start-seed{seed}",
                    problems,
                    task,
                    args,
                    gpu_of(i),
                )  # fmt: skip
                for i, seed in enumerate(seeds)
            }
        records = list(
            pool.map(
                lambda i: run_one(*jobs[i], task, args, gpu=gpu_of(i), card=card_name(args.device, gpu_of(i))),
                range(len(jobs)),
            )
        )
        if diagnostics:
            starting = {seed: future.result() for seed, future in futures.items()}
    for record in records:
        record["task"] = args.task
        if diagnostics and not record.get("failed"):
            record["diagnostics_before"] = starting.get(record["seed"])
    output = Path(args.output)
    (output / "summary.json").write_text(json.dumps(records, indent=2) + "\n")
    (output / "reproduction.json").write_text(json.dumps(records, indent=2) + "\n")
    tables = tables_markdown(records, methods)
    (output / "tables.md").write_text(
        f"# Reproduction on the {args.task} task ({task.description})\n\n"
        f"Command: `python benchmarks/reproduce.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{tables}"
    )

    print(f"\nHeld-out accuracy of the tiny model after training, {len(seeds)} seeds ({time.time() - start:.0f}s)\n")
    print("| method | held-out acc. before (%) | after (%) | change (points) | entropy gap (incorrect - correct) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for method in methods:
        ok = [r for r in records if r["method"] == method and not r.get("failed")]
        if not ok:
            print(f"| {method} | failed | | | |")
            continue
        before = [r["before"] for r in ok]
        after = [r["after"] for r in ok]
        delta = [a - b for a, b in zip(after, before)]
        gaps = [r["gap"] for r in ok if r["gap"] == r["gap"]]
        gap = fmt(gaps, pct=False, signed=True) if gaps else "-"
        print(f"| {method} | {fmt(before)} | {fmt(after)} | {fmt(delta, signed=True)} | {gap} |")
    print("\nPaired difference in held-out accuracy after training, each method minus GRPO, same seeds:\n")
    print(tables.split("Paired difference", 1)[1].split("\n\n", 2)[1] if "Paired difference" in tables else "-")
    figure = headline_figure(records, methods, output / "headline.png")
    print(f"\nAll tables: {output / 'tables.md'}; one record per run: {output / 'reproduction.json'}")
    if figure is not None:
        print(f"The headline comparison as a plot: {figure}")


if __name__ == "__main__":
    main()
