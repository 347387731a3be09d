"""The 2 x 2 factorial of BENCHMARKS.md ("Which part of EGPO helps"): NSR x entropy weights on the active task.

Arms: GRPO; GRPO + NSR (EGPO with every weight 1); the entropy weights without NSR (``egpo_nsr: false``); EGPO.
Every run is the tiny recipe on the active task (levels 4-6) through ``egpo-trl train``, then its saved model is
sampled with ``egpo-trl eval`` and read by ``egpo-trl diagnose``.

* ``sweep``: each arm at each learning rate on seeds 0-9, scored on 500 ``validation`` problems x 8 samples.
* ``confirm``: each arm at its best sweep rate (highest mean validation accuracy; a tie goes to the lower rate) on
  seeds 100-147, scored on 1,000 ``test`` problems x 8 samples; the starting model is scored once per seed.
* ``report``: the tables (``tables.md``), the plot (``factorial.png``) and the numbers (``report.json``).

One line per finished run is appended to ``OUTPUT/runs.jsonl.gz``, with each problem's count of correct samples as
a string of digits in the problems' order. That file is all the report reads, and what makes a stage resumable: a
run that has its line is not run again.

    python benchmarks/factorial.py sweep --device cuda --parallel 16
    python benchmarks/factorial.py confirm --device cuda --parallel 16
    python benchmarks/factorial.py report
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import statistics
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import RECIPES, ROOT, _call, _diagnostic_numbers, _env, _metric_means, card_name  # noqa: E402

EGPO = (RECIPES / "demo_tiny_cpu.yaml", [])
ARMS = {
    "GRPO": (RECIPES / "tiny_cpu_grpo.yaml", []),
    "GRPO + NSR": (EGPO[0], ["--egpo_lambda_min", "1", "--egpo_lambda_max", "1"]),
    "weights, no NSR": (EGPO[0], ["--egpo_nsr", "false"]),
    "EGPO": EGPO,
}
RATES = ["5e-5", "1e-4", "2e-4"]
STAGES = {"sweep": ("validation", 500, range(10)), "confirm": ("test", 1000, range(100, 148))}
SAMPLES, LEVELS, MAX_TOKENS = 8, "4,5,6", 80
_lock = threading.Lock()


def problems_file(out: Path, split: str, size: int) -> Path:
    from egpo_trl.data.synthetic import make_arithmetic_dataset

    path = out / f"{split}_{size}.jsonl"
    if not path.exists():
        rows = make_arithmetic_dataset(split=split, num_problems=size, levels=LEVELS, seed=0)
        path.write_text(
            "".join(json.dumps({c: r[c] for c in ("prompt", "answer", "level", "id")}) + "\n" for r in rows)
        )
    return path


def load_runs(out: Path) -> dict[str, dict]:
    path = out / "runs.jsonl.gz"
    if not path.exists():
        return {}
    with gzip.open(path, "rt") as handle:
        return {r["key"]: r for r in map(json.loads, handle) if r}


def score(model: str, problems: Path, work: Path, seed: int, args, gpu, diagnose: bool) -> dict:
    """Sample ``problems`` with ``model`` and return per-problem counts, accuracy and (optionally) diagnostics."""
    python = [sys.executable, "-m", "egpo_trl.cli"]
    command = python + ["eval", "--model", model, "--benchmarks", str(problems), "--output-dir", str(work / "eval")]
    command += ["--question-field", "prompt", "--answer-field", "answer", "--id-field", "id", "--no-progress"]
    command += ["--num-samples", str(SAMPLES), "--temperature", "1.0", "--top-p", "1.0", "--top-k", "0"]
    command += ["--max-new-tokens", str(MAX_TOKENS), "--seed", str(seed), "--backend", "transformers"]
    command += ["--device", args.device, "--batch-size", "256"]
    if _call(command, work / "eval_log.txt", _env(args, gpu)) != 0:
        raise RuntimeError(f"egpo-trl eval failed; see {work / 'eval_log.txt'}")
    ids = [json.loads(line)["id"] for line in problems.read_text().splitlines()]
    correct, unscored = dict.fromkeys(ids, 0), 0
    for line in (work / "eval" / "records" / f"{problems.stem}.jsonl").read_text().splitlines():
        record = json.loads(line)
        unscored += record["correct"] is None
        correct[record["problem_id"]] += bool(record["correct"])
    result = {"counts": "".join(str(correct[i]) for i in ids), "unscored": unscored}
    result["accuracy"] = sum(correct.values()) / (len(ids) * SAMPLES)
    if diagnose:
        command = python + ["diagnose", str(work / "eval"), "--output-dir", str(work / "diag"), "--overwrite"]
        if _call(command + ["--bootstrap", "100", "--seed", str(seed)], work / "diag_log.txt", _env(args, gpu)):
            raise RuntimeError(f"egpo-trl diagnose failed; see {work / 'diag_log.txt'}")
        result["diagnostics"] = _diagnostic_numbers(json.loads((work / "diag" / "diagnostics.json").read_text()))
    return result


def run(key: str, job: tuple, problems: Path, args, gpu) -> None:
    """Train (unless the job is the starting model), score, append the record, remove the work folder."""
    stage, arm, rate, seed = job
    work = Path(args.work) / key.replace("/", "_").replace(" ", "").replace(",", "")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    record = {"key": key, "stage": stage, "arm": arm, "lr": rate, "seed": seed, "card": card_name(args.device, gpu)}
    try:
        if arm == "start":
            from egpo_trl.tiny_model import tiny_model_path

            model = str(tiny_model_path())
        else:
            recipe, overrides = ARMS[arm]
            command = [sys.executable, "-m", "egpo_trl.train", "--config", str(recipe), *overrides]
            command += ["--synthetic_levels", LEVELS, "--eval_size", "0", "--learning_rate", rate, "--seed", str(seed)]
            command += ["--output_dir", str(work / "run"), "--disable_tqdm", "true", "--save_final_model", "true"]
            command += ["--use_cpu", str(args.device == "cpu").lower()]
            command += ["--max_steps", str(args.max_steps)] if args.max_steps else []
            if _call(command, work / "train_log.txt", _env(args, gpu)) != 0:
                raise RuntimeError(f"egpo-trl train failed; see {work / 'train_log.txt'}")
            model = str(work / "run")
            steps = [json.loads(s) for s in (work / "run" / "metrics.jsonl").read_text().splitlines() if s.strip()]
            steps = [s for s in steps if "egpo/frac_all_incorrect" in s or "reward" in s]
            for name in ("reward", "egpo/frac_all_incorrect", "egpo/weight_correct", "egpo/weight_incorrect"):
                record[name.split("/")[-1] + "_mean"] = _metric_means(steps, name)
        record.update(score(model, problems, work, seed, args, gpu, diagnose=stage == "confirm"))
    except Exception as error:  # a failed run is reported and left to the next invocation
        print(f"  FAILED {key}: {error}", flush=True)
        return
    with _lock, gzip.open(Path(args.output) / "runs.jsonl.gz", "at") as handle:
        handle.write(json.dumps(record) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print(f"  {key}: {record['accuracy']:.1%}", flush=True)


def best_rates(runs: dict[str, dict]) -> dict[str, str]:
    """Each arm's learning rate with the highest mean validation accuracy over the sweep's seeds (ties: lower)."""
    best = {}
    for arm in ARMS:
        means = {r: _mean([x["accuracy"] for x in runs.values() if x["stage"] == "sweep" and x["arm"] == arm
                            and x["lr"] == r]) for r in RATES}  # fmt: skip
        if any(m is None for m in means.values()):
            raise SystemExit(f"the sweep of {arm!r} is unfinished: run `factorial.py sweep` first.")
        best[arm] = max(RATES, key=lambda r: (means[r], -float(r)))
    return best


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def interval(diffs: list[float]) -> tuple[float, float, float, float]:
    """Mean, 95% t-interval and two-sided p of a one-sample t-test against 0."""
    from scipy import stats

    mean, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    if se == 0:  # every difference equal: no spread to test against
        return mean, mean, mean, float(mean == 0)
    half = stats.t.ppf(0.975, len(diffs) - 1) * se
    return mean, mean - half, mean + half, float(2 * stats.t.sf(abs(mean / se), len(diffs) - 1))


def report(out: Path) -> None:
    runs = load_runs(out)
    rates = best_rates(runs)
    lines = ["Sweep: mean validation accuracy (%) over seeds 0-9, 500 problems x 8 samples", ""]
    lines += ["| arm | " + " | ".join(f"lr {r}" for r in RATES) + " | chosen |", "| --- |" + " ---: |" * 4]
    for arm in ARMS:
        cells = [[x["accuracy"] for x in runs.values() if x["stage"] == "sweep" and x["arm"] == arm and x["lr"] == r]
                 for r in RATES]  # fmt: skip
        lines.append(
            f"| {arm} | " + " | ".join(f"{100 * _mean(c):.1f} (n={len(c)})" for c in cells) + f" | {rates[arm]} |"
        )
    start = {x["seed"]: x for x in runs.values() if x["arm"] == "start"}
    after = {arm: {x["seed"]: x for x in runs.values() if x["stage"] == "confirm" and x["arm"] == arm and
                   x["lr"] == rates[arm]} for arm in ARMS}  # fmt: skip
    seeds = sorted(set(start).intersection(*after.values()))
    if len(seeds) < 2:
        raise SystemExit(f"{len(seeds)} seeds have every confirm run: run `factorial.py confirm` first.")
    acc = {arm: [after[arm][s]["accuracy"] for s in seeds] for arm in ARMS}
    base = [start[s]["accuracy"] for s in seeds]
    g, n, w, e = (acc[a] for a in ARMS)
    contrasts = {
        "EGPO minus GRPO (primary)": [y - x for x, y in zip(g, e)],
        "NSR main effect": [((b - a) + (d - c)) / 2 for a, b, c, d in zip(g, n, w, e)],
        "weights main effect": [((c - a) + (d - b)) / 2 for a, b, c, d in zip(g, n, w, e)],
        "interaction": [(d - c) - (b - a) for a, b, c, d in zip(g, n, w, e)],
    }
    results = {name: interval(d) for name, d in contrasts.items()}
    secondary = sorted(list(contrasts)[1:], key=lambda k: results[k][3])  # Holm over the three secondary tests
    holm, running = {}, 0.0
    for i, name in enumerate(secondary):
        running = max(running, min(1.0, (len(secondary) - i) * results[name][3]))
        holm[name] = running
    lines += ["", f"Test: 1,000 problems x 8 samples, seeds 100-147 with every run finished (n = {len(seeds)})", ""]
    lines += [
        "| arm | lr | before (%) | after (%) | change (points, 95% CI) | gap before -> after | TE AUC | AE AUC |"
    ]
    lines += ["| --- | --- | ---: | ---: | --- | --- | --- | --- |"]
    for arm in ARMS:
        mean, low, high, _ = interval([a - b for a, b in zip(acc[arm], base)])
        diag = {k: (_mean([start[s]["diagnostics"][k] for s in seeds]), _mean([after[arm][s]["diagnostics"][k]
                for s in seeds])) for k in ("gap", "auc_thinking", "auc_answer")}  # fmt: skip
        lines.append(f"| {arm} | {rates[arm]} | {100 * _mean(base):.1f} | {100 * _mean(acc[arm]):.1f} | "
                     f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] | "
                     + " | ".join(f"{b:.3f} -> {a:.3f}" for b, a in diag.values()) + " |")  # fmt: skip
    lines += ["", "| contrast (points) | mean | 95% CI | p | p, Holm |", "| --- | ---: | --- | ---: | ---: |"]
    for name, (mean, low, high, p) in results.items():
        lines.append(f"| {name} | {100 * mean:+.2f} | [{100 * low:+.2f}, {100 * high:+.2f}] | {p:.3g} | "
                     f"{'-' if name not in holm else f'{holm[name]:.3g}'} |")  # fmt: skip
    by_problem = [statistics.mean(int(after["EGPO"][s]["counts"][i]) - int(after["GRPO"][s]["counts"][i])
                  for s in seeds) / SAMPLES for i in range(len(start[seeds[0]]["counts"]))]  # fmt: skip
    mean, low, high, p = interval(by_problem)
    lines += ["", f"Paired by problem (EGPO minus GRPO, per-problem accuracy averaged over the seeds, n = "
              f"{len(by_problem)} problems): {100 * mean:+.2f} points [{100 * low:+.2f}, {100 * high:+.2f}], p = {p:.3g}"]  # fmt: skip
    card = sorted({x["card"] for x in runs.values()})
    (out / "tables.md").write_text("\n".join(lines) + f"\n\nCards: {', '.join(card)}\n")
    (out / "report.json").write_text(json.dumps({"rates": rates, "seeds": seeds, "contrasts": results}, indent=1))
    plot(acc, base, results, rates, out / "factorial.png")
    print("\n".join(lines))


def plot(acc: dict, base: list[float], results: dict, rates: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2))
    for y, arm in enumerate(ARMS):
        change = [100 * (a - b) for a, b in zip(acc[arm], base)]
        left.scatter(change, [y] * len(change), s=8, color="0.6")
        mean, low, high, _ = interval([c / 100 for c in change])
        left.errorbar(
            100 * mean, y, xerr=[[100 * (mean - low)], [100 * (high - mean)]], fmt="o", color="C3", capsize=3
        )
    left.set_yticks(range(len(ARMS)), [f"{a} (lr {rates[a]})" for a in ARMS])
    left.set_xlabel("test accuracy change (points; dots: seeds; bar: 95% CI)")
    for y, (mean, low, high, _) in enumerate(results.values()):
        right.errorbar(100 * mean, y, xerr=[[100 * (mean - low)], [100 * (high - mean)]], fmt="o", capsize=3)
    right.set_yticks(range(len(results)), list(results))
    right.set_xlabel("points (95% CI over seeds)")
    for ax in (left, right):
        ax.axvline(0, color="0.3", lw=0.8)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["sweep", "confirm", "report"])
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "factorial"))
    parser.add_argument("--work", default="/tmp/egpo_factorial", help="runs' folders, removed once recorded")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--seeds", type=int, nargs="+", help="a subset of the stage's seeds (a smoke run)")
    parser.add_argument("--max-steps", type=int, help="fewer training steps (a smoke run)")
    parser.add_argument("--size", type=int, help="fewer problems (a smoke run)")
    args = parser.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage == "report":
        return report(out)
    split, size, seeds = STAGES[args.stage]
    problems = problems_file(out, split, args.size or size)
    seeds = args.seeds or list(seeds)
    if args.stage == "sweep":
        jobs = [("sweep", arm, rate, s) for s in seeds for rate in RATES for arm in ARMS]
    else:
        rates = best_rates(load_runs(out))
        jobs = [("confirm", "start", "-", s) for s in seeds] + [
            ("confirm", a, rates[a], s) for s in seeds for a in ARMS
        ]
    done = load_runs(out)
    todo = {"/".join(map(str, job)): job for job in jobs if "/".join(map(str, job)) not in done}
    print(f"{args.stage}: {len(jobs) - len(todo)} of {len(jobs)} runs recorded, {len(todo)} to run", flush=True)
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    with ThreadPoolExecutor(args.parallel) as pool:
        for i, (key, job) in enumerate(todo.items()):
            pool.submit(run, key, job, problems, args, i % gpus if gpus else None)


if __name__ == "__main__":
    main()
