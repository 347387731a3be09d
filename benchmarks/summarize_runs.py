"""Markdown tables of the runs of ``benchmarks/gpu_tiny_runs.sh``: per-step time, final reward, ``egpo/*`` metrics.

Usage::

    python benchmarks/summarize_runs.py OUT_DIR [SETUP ...]

Reads ``OUT_DIR/<setup>/run/metrics.jsonl`` and ``OUT_DIR/<setup>/exit_status`` of each setup (every folder of
``OUT_DIR`` when none is named). Uses only the standard library (and torch, when present, for the device name).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def device_name() -> str:
    """The first CUDA device's name and count, or ``CPU``."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()} visible, torch {torch.__version__}"
        return f"CPU, torch {torch.__version__}"
    except ImportError:
        return "unknown"


def summarize(folder: Path) -> dict:
    """Exit status, steps, median ``step_time``, last ``reward`` and the last ``egpo/*`` values of one setup."""
    status = (folder / "exit_status").read_text().split() if (folder / "exit_status").is_file() else ["?", "?"]
    row = {"exit": status[0], "wall_s": status[1] if len(status) > 1 else "?", "egpo": {}}
    metrics = folder / "run" / "metrics.jsonl"
    records = []
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward" in r]
    times = [r["step_time"] for r in train if isinstance(r.get("step_time"), (int, float))]
    row["steps"] = train[-1]["step"] if train else 0
    row["step_time"] = statistics.median(times) if times else None
    row["reward"] = train[-1]["reward"] if train else None
    row["accuracy"] = train[-1].get("accuracy") if train else None
    if train:
        row["egpo"] = {k: v for k, v in train[-1].items() if k.startswith("egpo/")}
    return row


def _fmt(value, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0])
    setups = argv[1:] or sorted(p.name for p in out.iterdir() if p.is_dir())
    rows = {setup: summarize(out / setup) for setup in setups}
    print(f"Device: {device_name()}")
    print()
    print("| setup | exit | steps | median step_time (s) | final reward | final accuracy | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for setup, row in rows.items():
        print(
            f"| {setup} | {row['exit']} | {row['steps']} | {_fmt(row['step_time'])} | {_fmt(row['reward'])} | "
            f"{_fmt(row['accuracy'])} | {row['wall_s']} |"
        )
    keys = sorted({k for row in rows.values() for k in row["egpo"]})
    if keys:
        print()
        print("egpo/* metrics of the last step:")
        print()
        print("| metric | " + " | ".join(rows) + " |")
        print("|---|" + "---|" * len(rows))
        for key in keys:
            print(f"| {key} | " + " | ".join(_fmt(row["egpo"].get(key)) for row in rows.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
