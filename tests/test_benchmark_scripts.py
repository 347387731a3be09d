"""The benchmark scripts run end to end on CPU at toy sizes (their numbers are for BENCHMARKS.md, not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(*args: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_advantage_math_checks_the_loop_and_prints_a_row_per_size_and_thread_count():
    out = run("benchmarks/advantage_math.py", "--sizes", "1024", "4096", "--devices", "cpu", "--threads", "1", "2",
              "--repeats", "3")  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| 1,024 |") or line.startswith("| 4,096 |")]
    assert len(rows) == 4, out  # 2 sizes x 2 thread counts; the script asserts agreement with the loop itself
    assert all("| cpu |" in row for row in rows)


@pytest.mark.slow
def test_reproduce_trains_each_method_then_collects_without_rerunning(tmp_path):
    args = ["benchmarks/reproduce.py", "--methods", "GRPO", "EGPO", "--seeds", "0", "--max-steps", "2",
            "--eval-size", "4", "--parallel", "2", "--output", str(tmp_path)]  # fmt: skip
    out = run(*args)
    assert "| GRPO |" in out and "| EGPO |" in out and "Paired difference" in out, out
    heldout = json.loads((tmp_path / "egpo-seed0" / "heldout.json").read_text())
    assert heldout["after"]["step"] == 2 and heldout["after"]["num_problems"] == 4
    stamp = (tmp_path / "egpo-seed0" / "metrics.jsonl").stat().st_mtime_ns
    again = run(*args)  # finished runs are read back, not trained again
    assert (tmp_path / "egpo-seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp
    assert (
        again.split("Held-out accuracy of the tiny model")[1].splitlines()[3:]
        == out.split("Held-out accuracy of the tiny model")[1].splitlines()[3:]
    )


@pytest.mark.slow
def test_step_cost_times_both_trainers_and_the_extra_pass(tmp_path):
    out = run("benchmarks/step_cost.py", "--hidden", "32", "--layers", "1", "--steps", "3", "--warmup", "1",
              "--repeats", "1", "--completion-length", "8", "--batch", "8", "--tokenizer", "char",
              "--json", str(tmp_path / "cost.json"))  # fmt: skip
    raw = json.loads((tmp_path / "cost.json").read_text())["raw"]
    assert len(raw["reuse"]["grpo"]) == len(raw["reuse"]["egpo"]) == 1
    assert raw["reuse"]["extra_pass"] == []  # log-probs reused: no extra pass
    assert len(raw["extra"]["extra_pass"]) == 2  # one per timed step (3 steps, 1 warm-up)
    assert "| extra pass (num_iterations=1) |" in out
