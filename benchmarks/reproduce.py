"""A small reproduction of the paper's comparison (Tables 1 and 2) on the shipped tiny math model.

GRPO, DAPO, EDGE-GRPO, NSR and EGPO, plus the EGPO ablations C1-C6, each trained with the same budget
(the tiny CPU recipes: same model, data, steps and sampling; only the method's fields differ) for several
seeds, then scored on the synthetic task's held-out split. Every run goes through ``egpo-trl train``.

Usage::

    python benchmarks/reproduce.py --seeds 0 1 2 --parallel 12 --device cuda     # one GPU, runs share it
    python benchmarks/reproduce.py --methods GRPO EGPO --seeds 0 --parallel 2     # CPU, a subset

Writes each run's folder (metrics.jsonl, heldout.json, training_curves.png, log.txt) under
``--output`` and prints a Markdown table: held-out accuracy after training (mean, std over seeds), its
change from the starting model, the training-time entropy gap (mean of the last 10 logged steps of
``egpo/entropy_gap``: mean entropy of incorrect minus correct completions) and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
EGPO = "demo_tiny_cpu.yaml"

#: name -> (recipe, extra command-line overrides). Only the method's fields differ between rows.
METHODS: dict[str, tuple[str, list[str]]] = {
    "GRPO": ("tiny_cpu_grpo.yaml", []),
    "DAPO": ("tiny_cpu_dapo.yaml", []),
    "EDGE-GRPO": ("tiny_cpu_edge_grpo.yaml", []),
    "EDGE-GRPO no GEC": ("tiny_cpu_edge_grpo.yaml", ["--edge_gec", "false"]),
    "NSR": ("tiny_cpu_nsr.yaml", []),
    "EGPO": (EGPO, []),
    "C1 symmetric": (EGPO, ["--egpo_clamp", "symmetric"]),
    "C2 neg<=1 only": (EGPO, ["--egpo_clamp", "negative_only"]),
    "C3 pos>=1 only": (EGPO, ["--egpo_clamp", "positive_only"]),
    "C4 NSR w=1": (EGPO, ["--egpo_nsr_weighting", "unit"]),
    "C5 clamp->renorm": (EGPO, ["--egpo_renorm", "after_clamp"]),
    "C6 renorm->clamp": (EGPO, ["--egpo_renorm", "before_clamp"]),
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def run_one(method: str, seed: int, args, gpu: int | None = None) -> dict:
    recipe, overrides = METHODS[method]
    out = Path(args.output) / f"{slug(method)}-seed{seed}"
    if (out / "heldout.json").exists() and not args.rerun:
        return collect(method, seed, out, wall=None)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "egpo_trl.train", "--config", str(RECIPES / recipe), *overrides]
    command += ["--seed", str(seed), "--output_dir", str(out), "--overwrite_output_dir", "true"]
    command += ["--disable_tqdm", "true", "--save_final_model", "false"]
    if args.device == "cuda":
        command += ["--use_cpu", "false"]
    if args.max_steps:
        command += ["--max_steps", str(args.max_steps)]
    if args.eval_size is not None:
        command += ["--eval_size", str(args.eval_size)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    if gpu is not None:  # one process must see one GPU (several make Trainer wrap the model in DataParallel)
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    start = time.time()
    with open(out / "log.txt", "w") as log:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - start
    if result.returncode != 0:
        print(f"  FAILED {method} seed {seed} (exit {result.returncode}); see {out / 'log.txt'}", flush=True)
        return {"method": method, "seed": seed, "failed": True}
    record = collect(method, seed, out, wall)
    print(
        f"  {method:18s} seed {seed}: {record['before']:.1%} -> {record['after']:.1%}  gap {record['gap']:+.3f}  "
        f"({wall:.0f}s)",
        flush=True,
    )
    return record


def collect(method: str, seed: int, out: Path, wall: float | None) -> dict:
    heldout = json.loads((out / "heldout.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [r["egpo/entropy_gap"] for r in rows if "egpo/entropy_gap" in r][-10:]
    return {
        "method": method,
        "seed": seed,
        "before": heldout["before"]["accuracy"],
        "after": heldout["after"]["accuracy"],
        "gap": statistics.mean(gaps) if gaps else float("nan"),
        "wall_s": wall,
    }


def fmt(values: list[float], pct: bool = True) -> str:
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:.1f} ± {100 * std:.1f}" if pct else f"{mean:+.3f} ± {std:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-steps", type=int, default=None, help="override the recipes' max_steps")
    parser.add_argument("--eval-size", type=int, default=None, help="override the recipes' held-out problems")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "reproduce"))
    parser.add_argument("--rerun", action="store_true", help="rerun runs whose results already exist")
    args = parser.parse_args()

    jobs = [(m, s) for s in args.seeds for m in args.methods]
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("--device cuda but no GPU is visible.")
    print(f"{len(jobs)} runs, {args.parallel} at a time, on {args.device}", flush=True)
    start = time.time()
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        records = list(pool.map(lambda i: run_one(*jobs[i], args, gpu=i % gpus if gpus else None), range(len(jobs))))
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "summary.json").write_text(json.dumps(records, indent=2) + "\n")

    print(
        f"\nHeld-out accuracy of the tiny model after training, {len(args.seeds)} seeds ({time.time() - start:.0f}s)\n"
    )
    print("| method | held-out acc. before (%) | after (%) | change (points) | entropy gap (incorrect - correct) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for method in args.methods:
        ok = [r for r in records if r["method"] == method and not r.get("failed")]
        if not ok:
            print(f"| {method} | failed | | | |")
            continue
        before = [r["before"] for r in ok]
        after = [r["after"] for r in ok]
        delta = [a - b for a, b in zip(after, before)]
        gaps = [r["gap"] for r in ok if r["gap"] == r["gap"]]
        gap = fmt(gaps, pct=False) if gaps else "-"
        print(f"| {method} | {fmt(before)} | {fmt(after)} | {fmt(delta)} | {gap} |")
    paired_differences(records, args.methods)


def paired_differences(records: list[dict], methods: list[str], baseline: str = "GRPO") -> None:
    """Print each method's held-out accuracy after training minus the baseline's, seed by seed.

    A seed fixes the held-out samples' draw and the rollouts' random stream, so runs of two methods with the same
    seed start from the same accuracy: the paired difference removes that share of the seed-to-seed spread.
    """
    base = {r["seed"]: r["after"] for r in records if r["method"] == baseline and not r.get("failed")}
    if not base or len(methods) < 2:
        return
    print(f"\nPaired difference in held-out accuracy after training, each method minus {baseline}, same seeds:\n")
    print("| method | seeds | mean difference (points) | std | seeds ahead / behind / tied |")
    print("| --- | ---: | ---: | ---: | --- |")
    for method in methods:
        if method == baseline:
            continue
        diffs = [
            r["after"] - base[r["seed"]]
            for r in records
            if r["method"] == method and r["seed"] in base and not r.get("failed")
        ]
        diffs = [d for d in diffs if d == d]
        if not diffs:
            continue
        std = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        print(
            f"| {method} | {len(diffs)} | {100 * statistics.mean(diffs):+.1f} | {100 * std:.1f} | "
            f"{ahead} / {behind} / {len(diffs) - ahead - behind} |"
        )


if __name__ == "__main__":
    main()
