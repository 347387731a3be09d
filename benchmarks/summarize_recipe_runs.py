"""A Markdown table of the runs of ``benchmarks/gpu_checks.sh``, one row per recipe and optimizer step.

    python benchmarks/summarize_recipe_runs.py OUT_DIR [RECIPE ...]

Reads, per recipe, ``OUT_DIR/RECIPE/{command.txt,exit_status,gpu_memory.csv,run/metrics.jsonl}`` and the recipe
itself, and writes the rows to ``OUT_DIR/summary.json``. Per step: its seconds by the clock (``clock_s``) and as
TRL's ``step_time`` counts them, generation (``timing/generation_s``: vLLM's wake-up, weight sync and sampling), the
old-policy log-prob pass, Guided Error Correction (EDGE-GRPO), the rest (scoring, the loss's forward, backward and
optimizer step), completion tokens per second, the importance-sampling ratio, loss, gradient norm, DAPO's generation
rounds, and the peak GPU memory the driver reported (vLLM's pool included, less what ``memory_ballast.py`` held).

Compare steps by the clock: TRL's ``step_time`` adds up the host's time inside ``training_step`` calls, which return
once their work is queued on the GPU. Standard library plus PyYAML.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml


def step_clocks(records: list[dict]) -> dict[int, dict]:
    """Per logged optimizer step: ``step_time`` and the clock, the record's ``clock_s`` (seconds since the previous
    log, which ``egpo-trl train`` writes), or for files written before it did, the difference of ``time_s`` from the
    previous step record per step in between (the first record gets one only if it is step 1: a resumed run's first
    record has no previous one)."""
    out, previous_time, previous_step = {}, None, None
    for record in records:
        if not isinstance(record.get("step_time"), (int, float)) or not isinstance(record.get("step"), int):
            continue
        clock = record.get("clock_s") if isinstance(record.get("clock_s"), (int, float)) else None
        time_s = record.get("time_s")
        if clock is None and isinstance(time_s, (int, float)):
            if previous_step is None and record["step"] == 1:
                clock = time_s
            elif previous_step is not None and record["step"] > previous_step:
                clock = (time_s - previous_time) / (record["step"] - previous_step)
        if isinstance(time_s, (int, float)):
            previous_time, previous_step = time_s, record["step"]
        out[record["step"]] = {"step_time": record["step_time"], "clock": clock}
    return out


def _card() -> str:
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout.split("\n")
        return names[0].strip() or "?"
    except (OSError, subprocess.CalledProcessError):
        return "no GPU"


def _option(argv: list[str], name: str, default=None):
    value = default
    for index, item in enumerate(argv):
        if item == f"--{name}" and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(f"--{name}="):
            value = item.split("=", 1)[1]
    return value


def ballast_held_mib(folder: Path) -> dict[int, float]:
    """What ``benchmarks/memory_ballast.py`` held on each GPU of the run in ``folder`` (``ballast.txt``), in MiB, by
    the GPU's index as the driver numbers it (the run's ``CUDA_VISIBLE_DEVICES``, from ``exit_status``)."""
    path = folder / "ballast.txt"
    if not path.is_file():
        return {}
    status = (folder / "exit_status").read_text().split() if (folder / "exit_status").is_file() else []
    visible = [int(g) for g in status[2].split(",")] if len(status) > 2 else []
    held = {}
    for match in re.finditer(r"^cuda:(\d+) .*?\((\d+) bytes\)", path.read_text(), flags=re.M):
        index = int(match.group(1))
        held[visible[index] if index < len(visible) else index] = int(match.group(2)) / 1024**2
    return held


def peak_memory(path: Path, held: dict[int, float] | None = None) -> tuple[float | None, float | None]:
    """The highest ``memory.used`` of any GPU in the sampler's CSV, and that GPU's total, in GiB; less what a ballast
    held on that GPU (``held``, MiB by GPU index: see :func:`ballast_held_mib`)."""
    peak, total = None, None
    if not path.is_file():
        return peak, total
    held = held or {}
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            index = int(parts[1])
            used, capacity = (float(parts[2]) - held.get(index, 0.0)) / 1024, float(parts[3]) / 1024
        except ValueError:
            continue
        if peak is None or used > peak:
            peak, total = used, capacity
    return peak, total


def summarize(folder: Path) -> list[dict]:
    """One dict per logged optimizer step of the run in ``folder`` (one dict with the exit status if none)."""
    argv = shlex.split((folder / "command.txt").read_text()) if (folder / "command.txt").is_file() else []
    recipe_path = next((a for a in argv if a.endswith(".yaml") and a.startswith("recipes/")), None)
    recipe = yaml.safe_load(Path(recipe_path).read_text()) if recipe_path and Path(recipe_path).is_file() else {}
    processes = int(_option(argv, "num_processes", recipe.get("num_processes", 1)))
    accumulation = int(_option(argv, "gradient_accumulation_steps", recipe.get("gradient_accumulation_steps", 1)))
    per_device = int(_option(argv, "per_device_train_batch_size", recipe.get("per_device_train_batch_size", 1)))
    completions = processes * accumulation * per_device
    # The launch's accelerate config: an --accelerate_config override, else the recipe's ("none": one plain process).
    launch = _option(argv, "accelerate_config", recipe.get("accelerate_config"))
    launch = None if str(launch).lower() in ("none", "null", "") else launch
    if launch and not Path(launch).is_absolute():
        launch = Path(__file__).resolve().parents[1] / launch  # recipes name it from the repository's root
    accelerate = yaml.safe_load(Path(launch).read_text()) if launch else {}
    zero = (accelerate.get("deepspeed_config") or {}).get("zero_stage")
    status = (folder / "exit_status").read_text().split() if (folder / "exit_status").is_file() else ["?", "?"]
    held = ballast_held_mib(folder)
    peak, total = peak_memory(folder / "gpu_memory.csv", held)
    base = {
        "recipe": folder.name,
        "gpus": processes,
        "zero": f"ZeRO-{zero}" if zero else accelerate.get("distributed_type", "-"),
        "completions": completions,
        "length": _option(argv, "max_completion_length", recipe.get("max_completion_length")),
        "peak_gib": peak,
        "total_gib": total,
        "ballast_gib": max(held.values()) / 1024 if held else None,
        "exit": status[0],
        "wall_s": status[1] if len(status) > 1 else "?",
    }
    metrics = folder / "run" / "metrics.jsonl"
    metrics = metrics if metrics.is_file() else folder / "metrics.jsonl"  # the layout kept under benchmarks/results
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    )
    steps = [r for r in records if isinstance(r.get("step_time"), (int, float))]
    rows = []
    clocks = step_clocks(records)
    for record in steps:
        step_time = record["step_time"]
        clock = clocks.get(record.get("step"), {}).get("clock")
        generation = record.get("timing/generation_s")
        old_logps = record.get("timing/old_logps_s", 0.0)
        scored = record.get("timing/generate_and_score_s")
        mean_length = record.get("completions/mean_length")
        rows.append(
            dict(
                base,
                step=record.get("step"),
                step_s=step_time,
                clock_s=clock,
                generation_s=generation,
                old_logps_s=old_logps,
                gec_s=record.get("timing/gec_s"),
                gec_continuation_s=record.get("timing/gec_continuation_s"),
                gec_frac_reflect=record.get("gec/frac_reflect"),
                rest_s=step_time - scored if scored is not None else None,
                rest_clock_s=clock - scored if scored is not None and clock is not None else None,
                mean_length=mean_length,
                tokens_per_s=completions * mean_length / (clock or step_time) if mean_length else None,
                is_mean=record.get("sampling/importance_sampling_ratio/mean"),
                is_min=record.get("sampling/importance_sampling_ratio/min"),
                loss=record.get("loss"),
                grad_norm=record.get("grad_norm"),
                all_incorrect=record.get("egpo/frac_all_incorrect"),
                later_gib=record.get("egpo/gpu_memory_later_generations_gib"),
                rounds=record.get("dynamic_sampling/rounds"),
                generated_per_kept=record.get("dynamic_sampling/generated_per_kept"),
            )
        )
    return rows or [dict(base, step="-")]


COLUMNS = [
    ("recipe", "recipe", "{}"),
    ("gpus", "GPUs", "{}"),
    ("zero", "DeepSpeed", "{}"),
    ("completions", "completions/step", "{}"),
    ("length", "max completion", "{}"),
    ("peak_gib", "peak GiB/GPU", "{:.1f}"),
    ("step", "step", "{}"),
    ("clock_s", "step s (clock)", "{:.1f}"),
    ("step_s", "step s (TRL's step_time)", "{:.1f}"),
    ("generation_s", "generation s", "{:.1f}"),
    ("old_logps_s", "old log-probs s", "{:.2f}"),
    ("gec_s", "GEC s", "{:.1f}"),
    ("gec_continuation_s", "GEC continuations s", "{:.1f}"),
    ("rest_clock_s", "scoring + training s (clock)", "{:.1f}"),
    ("rest_s", "scoring + training s (step_time)", "{:.1f}"),
    ("mean_length", "mean length", "{:.0f}"),
    ("tokens_per_s", "completion tok/s", "{:.0f}"),
    ("is_mean", "IS ratio mean", "{:.3g}"),
    ("is_min", "IS ratio min", "{:.3g}"),
    ("loss", "loss", "{:.4g}"),
    ("grad_norm", "grad norm", "{:.3g}"),
    ("later_gib", "later generations GiB (trainer's estimate)", "{:.1f}"),
    ("rounds", "generation rounds", "{:.0f}"),
    ("generated_per_kept", "groups generated / kept", "{:.3g}"),
    ("exit", "exit", "{}"),
]


def markdown(rows: list[dict]) -> str:
    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        try:
            return fmt.format(value)
        except (ValueError, TypeError):
            return str(value)

    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row, key, fmt) for key, _, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0])
    names = argv[1:] or sorted(p.name for p in out.iterdir() if (p / "command.txt").is_file())
    rows = [row for name in names for row in summarize(out / name)]
    print(f"Card: {_card()}")
    print(markdown(rows))
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
