"""The statistics and tables of benchmarks/reproduce.py, on run records built here (no training)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import reproduce
finally:
    sys.path.pop(0)


def make_records(methods: dict[str, float], seeds: range, noise: float = 0.02) -> list[dict]:
    """Run records of the shape `collect` returns: `after` = the seed's start + the method's gain + noise."""
    rng = random.Random(0)
    records = []
    for seed in seeds:
        before = 0.2 + 0.01 * seed
        for method, gain in methods.items():
            after = before + gain + rng.uniform(-noise, noise)
            records.append(
                {
                    "method": method,
                    "seed": seed,
                    "accuracy_before": before,
                    "accuracy_after": after,
                    "accuracy_before_se": reproduce.sampling_error(before, 1200),
                    "accuracy_after_se": reproduce.sampling_error(after, 1200),
                    "frac_all_incorrect_start": 0.3 + 0.01 * seed,
                    "frac_uninformative_start": None,
                    "frac_at_lambda_min": 0.2 if method == "EGPO" else None,
                    "frac_at_lambda_max": 0.1 if method == "EGPO" else None,
                    "weight_correct": 1.4 if method == "EGPO" else 1.0,
                    "weight_incorrect": 0.9 if method == "EGPO" else 1.0,
                    "entropy_gap_start": 0.05,
                    "entropy_gap_end": 0.06,
                    "diagnostics_before": {"gap": 0.08, "auc_thinking": 0.7, "auc_answer": 0.75},
                    "diagnostics_after": {"gap": 0.1, "auc_thinking": 0.72, "auc_answer": 0.8},
                }
            )
    return records


def test_paired_differences_match_scipys_paired_t_test_and_an_exact_sign_test():
    records = make_records({"GRPO": 0.10, "EGPO": 0.13, "NSR": 0.05}, range(6))
    pair = reproduce.paired_against(records, "EGPO")
    grpo = [r["accuracy_after"] for r in records if r["method"] == "GRPO"]
    egpo = [r["accuracy_after"] for r in records if r["method"] == "EGPO"]
    expected = stats.ttest_rel(egpo, grpo)
    assert pair["seeds"] == 6
    assert pair["mean"] == pytest.approx(sum(e - g for e, g in zip(egpo, grpo)) / 6)
    assert pair["t"] == pytest.approx(expected.statistic) and pair["p_t"] == pytest.approx(expected.pvalue)
    ahead = sum(e > g for e, g in zip(egpo, grpo))
    assert (pair["ahead"], pair["behind"], pair["tied"]) == (ahead, 6 - ahead, 0)
    assert pair["p_sign"] == pytest.approx(stats.binomtest(ahead, 6).pvalue)


def test_sign_test_and_t_test_edge_cases():
    assert reproduce.sign_test(0, 0) == 1.0
    assert reproduce.sign_test(10, 0) == pytest.approx(2 / 2**10)
    assert reproduce.sign_test(9, 1) == pytest.approx(stats.binomtest(9, 10).pvalue)
    assert reproduce.paired_t_test([0.01]) == (None, None)
    assert reproduce.paired_t_test([0.0, 0.0]) == (0.0, 1.0)
    t, p = reproduce.paired_t_test([0.02, 0.02, 0.02])
    assert math.isinf(t) and t > 0 and p == 0.0


def test_a_failed_run_drops_only_its_seed_from_the_pairs():
    records = make_records({"GRPO": 0.1, "EGPO": 0.1}, range(3))
    index = next(i for i, r in enumerate(records) if r["method"] == "GRPO" and r["seed"] == 0)
    records[index] = {"method": "GRPO", "seed": 0, "failed": True}
    pair = reproduce.paired_against(records, "EGPO")
    assert pair["seeds"] == 2 and pair["ahead"] + pair["behind"] + pair["tied"] == 2


def test_tables_hold_every_method_and_the_mechanism_columns():
    records = make_records({"GRPO": 0.10, "EGPO": 0.13}, range(5))
    records.append({"method": "DAPO", "seed": 0, "failed": True})
    tables = reproduce.tables_markdown(records, ["GRPO", "DAPO", "EGPO"])
    rows = {line.split(" | ")[0]: line for line in tables.splitlines() if line.startswith("| ")}
    assert "| DAPO | 0 (1 failed) |" in tables
    assert "| EGPO | 5 |" in tables
    egpo_after = [100 * r["accuracy_after"] for r in records if r["method"] == "EGPO"]
    assert f"{sum(egpo_after) / 5:.1f} ± " in tables
    pair = reproduce.paired_against(records, "EGPO")
    assert f"| EGPO | 5 | {100 * pair['mean']:+.1f} |" in tables
    assert "| EGPO | 32.0 ± 1.6 | - | 20.0 ± 0.0 | 10.0 ± 0.0 | 1.400 ± 0.000 | 0.900 ± 0.000 |" in tables
    assert "+0.020 ± 0.000" in tables  # held-out gap change, after minus before
    assert set(rows) >= {"| GRPO", "| EGPO", "| DAPO"}


def test_collect_reads_a_run_folder(tmp_path):
    heldout = {
        "before": {"accuracy": 0.2, "num_problems": 150, "num_samples": 8, "by_level": {"4": 0.3}},
        "after": {"accuracy": 0.35, "num_problems": 150, "num_samples": 8, "by_level": {"4": 0.5}, "step": 12},
    }
    (tmp_path / "heldout.json").write_text(json.dumps(heldout))
    steps = [
        {
            "step": i,
            "egpo/frac_all_incorrect": 0.4 - 0.02 * i,
            "egpo/entropy_gap": 0.01 * i,
            "egpo/weight_correct": 1.5,
        }
        for i in range(1, 13)
    ]
    rows = [{"step": 0, "heldout/accuracy": 0.2}, *steps, {"step": 12, "train_runtime": 3.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = reproduce.collect("GRPO", 3, tmp_path, wall=None)
    assert record["steps"] == 12
    assert record["frac_all_incorrect_start"] == pytest.approx(sum(0.4 - 0.02 * i for i in range(1, 11)) / 10)
    assert record["entropy_gap_end"] == pytest.approx(sum(0.01 * i for i in range(3, 13)) / 10)
    assert record["accuracy_after_se"] == pytest.approx(math.sqrt(0.35 * 0.65 / 1200))
    assert record["frac_at_lambda_min"] is None and record["weight_correct"] == 1.5


def test_the_active_task_runs_five_seeds_of_the_main_methods_and_three_of_the_rest():
    jobs = reproduce.plan_jobs(reproduce.TASKS["active"], None, None)
    seeds = {m: sorted(s for mm, s in jobs if mm == m) for m in dict.fromkeys(m for m, _ in jobs)}
    for method in ("GRPO", "DAPO", "EDGE-GRPO GEC all-incorrect", "EDGE-GRPO no GEC", "EGPO"):
        assert seeds[method] == [0, 1, 2, 3, 4]
    for method in ("NSR", *reproduce.ABLATIONS):
        assert seeds[method] == [0, 1, 2]
    assert reproduce.METHODS["EDGE-GRPO GEC all-incorrect"][1] == ["--edge_gec_scope", "all_incorrect_groups"]
    assert reproduce.plan_jobs(reproduce.TASKS["active"], ["GRPO"], [7]) == [("GRPO", 7)]


@pytest.mark.slow
def test_one_active_run_end_to_end_writes_the_records_and_tables(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "benchmarks/reproduce.py", "--task", "active", "--methods", "GRPO", "--seeds", "0",
               "--max-steps", "1", "--eval-size", "3", "--eval-num-samples", "2", "--bootstrap", "10",
               "--parallel", "1", "--output", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = json.loads((tmp_path / "reproduction.json").read_text())
    heldout = json.loads((tmp_path / "grpo-seed0" / "heldout.json").read_text())
    assert (record["method"], record["seed"], record["task"]) == ("GRPO", 0, "active")
    assert record["accuracy_before"] == heldout["before"]["accuracy"]
    assert record["accuracy_after"] == heldout["after"]["accuracy"]
    assert set(heldout["after"]["by_level"]) == {"4", "5", "6"}
    assert 0.0 <= record["frac_all_incorrect_start"] <= 1.0 and record["card"].startswith("cpu")
    for stage in ("diagnostics_before", "diagnostics_after"):
        assert set(record[stage]) >= {"auc_thinking", "auc_answer", "gap"}, record
    assert "| GRPO | 1 |" in (tmp_path / "tables.md").read_text()


def test_headline_figure_plots_every_finished_method(tmp_path):
    records = make_records({"GRPO": 0.05, "EGPO": 0.08, "NSR": -0.02}, range(3))
    records.append({"method": "DAPO", "seed": 0, "failed": "exit status 1"})
    path = reproduce.headline_figure(records, ["GRPO", "DAPO", "EGPO", "NSR"], tmp_path / "headline.png")
    assert path == tmp_path / "headline.png" and path.stat().st_size > 10_000
    from PIL import Image

    width, height = Image.open(path).size
    assert width > 1000 and height > 200  # two panels side by side
    assert reproduce.headline_figure([records[-1]], ["DAPO"], tmp_path / "none.png") is None
