"""``egpo-trl train <recipe>``: the accelerate launch over one or several machines, the dry run, and wandb."""

from __future__ import annotations

import glob
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from egpo_trl.launch import launch_command, normalize_argv, plan_launch
from egpo_trl.train import main, read_metrics

REPO = Path(__file__).resolve().parents[1]
# A short run of the CPU demo recipe on the tiny test model: 2 steps of 2 prompts x 4 completions.
TINY_RUN = [
    "--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
    "--max_completion_length", "16", "--eval_size", "0", "--synthetic_train_size", "64", "--plot", "false",
    "--disable_tqdm", "true",
]  # fmt: skip


def test_positional_recipe_and_dry_run_flag():
    assert normalize_argv(["recipes/egpo_qwen15b.yaml", "--seed", "1"]) == (
        ["--config", "recipes/egpo_qwen15b.yaml", "--seed", "1"],
        False,
    )
    assert normalize_argv(["--config", "r.yaml", "--dry-run"]) == (["--config", "r.yaml"], True)
    with pytest.raises(SystemExit, match="give the recipe once"):
        normalize_argv(["a.yaml", "--config", "b.yaml"])


def _wandb_records(run_file: str):
    """The records of an offline wandb run file (a LevelDB-style log of protobuf ``Record`` messages)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 2:
            pending = chunk
            continue
        if kind == 3:
            pending += chunk
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + chunk if kind == 4 else chunk)
        pending = b""
        yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_the_egpo_metrics_and_completions(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", WANDB_SILENT="true")
    command = [sys.executable, "-m", "egpo_trl.train", "recipes/demo_tiny_cpu.yaml", *TINY_RUN]
    command += ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--save_final_model", "false"]
    command += ["--report_to", "wandb", "--project", "egpo-tests", "--run_name", "tiny-offline"]
    command += ["--log_completions", "true"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

    runs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert len(runs) == 1, "the offline run lands in <output_dir>/wandb"
    (run_file,) = glob.glob(f"{runs[0]}/run-*.wandb")
    keys, names, steps = set(), set(), set()
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            names.add((record.run.project, record.run.display_name))
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            keys |= items.keys()
            if "train/global_step" in items:
                steps.add(int(float(items["train/global_step"])))
    assert ("egpo-tests", "tiny-offline") in names
    for key in ("train/egpo/frac_all_incorrect", "train/egpo/entropy_mean", "train/egpo/frac_mixed"):
        assert key in keys  # the egpo/* metrics
    assert {"train/reward", "train/loss", "train/step_time"} <= keys  # TRL's metrics
    assert "completions/_type" in keys  # the completions table ...
    assert glob.glob(f"{runs[0]}/files/media/table/completions_*.table.json")  # ... and its contents
    assert {1, 2} <= steps and max(steps) == 2
    # The same numbers land in metrics.jsonl.
    records = [r for r in read_metrics(out / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in records] == [1, 2] and "egpo/entropy_mean" in records[0]


@pytest.mark.slow
def test_one_command_runs_accelerate_launch_with_two_processes(tiny_model_dir, tmp_path):
    # The DDP config of the recipes, for 2 processes; without a GPU the processes use gloo on CPU.
    config = yaml.safe_load((REPO / "recipes/accelerate/ddp.yaml").read_text())
    config.update(mixed_precision="no", main_process_port=29000 + os.getpid() % 1000)
    accelerate_config = tmp_path / "ddp2.yaml"
    accelerate_config.write_text(yaml.safe_dump(config))
    recipe = yaml.safe_load((REPO / "recipes/demo_tiny_cpu.yaml").read_text())
    recipe.update(accelerate_config=str(accelerate_config), num_processes=2, model_name_or_path=tiny_model_dir)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    # 2 per device x 2 processes = one group of 4: a single process could not form it (2 % 4 != 0).
    overrides = [*TINY_RUN, "--per_device_train_batch_size", "2", "--output_dir", str(out)]
    command = [sys.executable, "-m", "egpo_trl.train", str(recipe_path), *overrides]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    launched = next(line for line in result.stdout.splitlines() if line.startswith("Launching: "))
    assert launched.startswith(
        f"Launching: accelerate launch --config_file {accelerate_config} --num_processes 2 -m egpo_trl.train "
        f"--config {recipe_path} --max_steps 2"
    )
    records = [r for r in read_metrics(out / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert "egpo/frac_all_incorrect" in records[0]


def test_dry_run_sizes_the_checkpoints_against_the_free_disk(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    from transformers import Qwen2Config

    from egpo_trl.launch import dry_run

    # A config-only copy of DeepSeek-R1-Distill-Qwen-7B's architecture: no weights are read.
    Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
                tie_word_embeddings=False).save_pretrained(tmp_path / "r1-7b")  # fmt: skip
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 60 * 10**9))
    argv = ["--config", "recipes/egpo_r1_distill_7b.yaml", "--model_name_or_path", str(tmp_path / "r1-7b"),
            "--output_dir", str(tmp_path / "run")]  # fmt: skip
    assert dry_run(argv) == 1
    out = capsys.readouterr().out
    assert "~107 GB each (7.62B parameters" in out and "save_total_limit 3 keeps ~442 GB" in out
    assert "has 60 GB free but one checkpoint takes ~107 GB" in out


def test_launch_over_several_machines_passes_them_to_accelerate():
    base = ["--config", "recipes/egpo_qwen15b.yaml", "--num_processes", "16", "--num_machines", "2"]
    plan = plan_launch([*base, "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29611"])
    assert plan.world_size == 16 and plan.machines == 2
    assert launch_command(plan)[:14] == [
        "accelerate", "launch", "--config_file", "recipes/accelerate/zero2.yaml", "--num_processes", "16",
        "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29611",
    ]  # fmt: skip
    for wrong in (
        ["--machine_rank", "0"],
        ["--main_process_ip", "h"],
        ["--machine_rank", "2", "--main_process_ip", "h"],
    ):
        with pytest.raises(SystemExit, match="needs --main_process_ip .* its --machine_rank 0 to 1"):
            plan_launch([*base, *wrong])
    with pytest.raises(SystemExit, match="main_process_port must be an integer"):
        plan_launch([*base, "--main_process_port", "x"])
    with pytest.raises(SystemExit, match="not a multiple of num_machines 2"):
        plan_launch([*base[:3], "9", *base[4:], "--machine_rank", "0", "--main_process_ip", "h"])
    with pytest.raises(SystemExit, match="set accelerate_config too"):
        plan_launch(["--config", "recipes/demo_tiny_cpu.yaml", "--num_machines", "2"])


def test_dry_run_prints_the_command_of_each_machine(capsys):
    from egpo_trl.launch import dry_run

    argv = ["--config", "recipes/egpo_qwen15b.yaml", "--num_processes", "16", "--num_machines", "2"]
    dry_run([*argv, "--machine_rank", "1", "--main_process_ip", "node-a", "--gradient_accumulation_steps", "4"])
    out = capsys.readouterr().out
    assert "2 x 8 processes; this one is rank 1, rendezvous at node-a:29500" in out
    assert "--num_machines 2 --machine_rank 1 --main_process_ip node-a -m egpo_trl.train" in out
    assert "1024 completions (64 prompts) per optimizer step" in out
    assert dry_run(argv) == 1 and "needs --main_process_ip" in capsys.readouterr().out


def test_train_runs_the_dry_run_checks_before_launching(tmp_path, capsys):
    argv = ["recipes/egpo_qwen15b.yaml", "--accelerate_config", "recipes/accelerate/ddp.yaml", "--use_vllm", "false"]
    argv += ["--bf16", "false", "--dataset_name", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    message = str(stop.value)
    assert len(message.splitlines()) == 1 and "Nothing was launched" in message
    assert f"dataset {tmp_path / 'missing'} does not exist" in message
    assert "egpo-trl train recipes/egpo_qwen15b.yaml --dry-run" in message
    assert "Launching:" not in capsys.readouterr().out


def test_the_dry_run_and_the_run_give_the_global_batch_and_say_when_it_is_not_the_recipes(tmp_path, capsys):
    from egpo_trl.launch import dry_run

    # Two machines of 8 for a recipe made for 8 processes: each optimizer step takes twice the recipe's batch.
    two = ["--config", "recipes/egpo_qwen7b.yaml", "--num_machines", "2", "--num_processes", "16"]
    two += ["--machine_rank", "0", "--main_process_ip", "node-a"]
    dry_run(two)
    out = capsys.readouterr().out
    assert "2 per device x 16 processes x 64 accumulation = 2048 completions (128 prompts) per optimizer step" in out
    assert (
        "this launch's optimizer step takes 2048 completions, 2x the recipe's 1024, 16 processes for its 8; to keep "
        "the recipe's, halve gradient_accumulation_steps (--gradient_accumulation_steps 32)." in out
    )
    dry_run([*two, "--gradient_accumulation_steps", "32"])
    out = capsys.readouterr().out
    assert "= 1024 completions (64 prompts) per optimizer step" in out and "x the recipe's" not in out
    # The run's first line says it too, before anything loads (here the output folder then stops it).
    (tmp_path / "run" / "checkpoint-10").mkdir(parents=True)
    with pytest.raises(SystemExit, match="already holds"):
        main(["recipes/demo_tiny_cpu.yaml", *TINY_RUN, "--output_dir", str(tmp_path / "run")])
    assert capsys.readouterr().out.splitlines()[0] == (
        "Batch: 8 per device x 1 processes x 1 accumulation = 8 completions (2 prompts) per optimizer step. Note: this "
        "launch's optimizer step takes 8 completions, 0.125x the recipe's 64; to keep the recipe's, set "
        "gradient_accumulation_steps (--gradient_accumulation_steps 8)."
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_a_gpu_recipe_on_a_machine_without_one_is_one_problem_first_and_nothing_launches(tmp_path, capsys):
    from egpo_trl.launch import dry_run

    argv = ["recipes/egpo_qwen15b.yaml", "--output_dir", str(tmp_path / "run")]
    needs = (
        "this machine sees no GPU, but the recipe needs 8 GPUs (use_vllm, bf16): run it on a machine with GPUs "
        "(recipes/demo_tiny_cpu.yaml trains on CPU)."
    )
    assert dry_run(["--config", *argv]) == 1
    out = capsys.readouterr().out
    assert out.split("problem(s) found:\n")[1].splitlines()[0] == f"  - {needs}"
    assert "ready to run" not in out and "not checked: this machine sees no GPU" not in out
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert str(stop.value).startswith(f"egpo-trl train: {needs}") and len(str(stop.value).splitlines()) == 1
    assert "Launching:" not in capsys.readouterr().out
    # Without vLLM and bf16 the launch can run on CPU: a note, not a problem.
    dry_run(["--config", *argv, "--use_vllm", "false", "--bf16", "false"])
    out = capsys.readouterr().out
    assert "this machine sees no GPU; the launch needs 8." in out.split("problem(s) found")[0]
    assert "this machine sees no GPU, but" not in out


@pytest.mark.slow
def test_the_processes_of_a_launch_share_one_timestamped_output_dir(tmp_path):
    """Each process replaces {timestamp} as it parses the recipe; the second one here parses in a later second."""
    script = tmp_path / "parse.py"
    script.write_text(
        "import os, sys, time\n"
        "time.sleep(1.5 * int(os.environ['RANK']))\n"
        "from egpo_trl.train import parse_args\n"
        "_, args, _ = parse_args(['--config', sys.argv[1], '--output_dir', sys.argv[2]])\n"
        "open(f\"{sys.argv[3]}/{os.environ['RANK']}.txt\", 'w').write(args.output_dir)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf")}
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(name, None)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--mixed_precision", "no"]
    command += ["--num_processes", "2", "--main_process_port", port, str(script)]
    command += [str(REPO / "recipes/demo_tiny_cpu.yaml"), str(tmp_path / "run-{timestamp}"), str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    folders = [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)]
    assert folders[0] == folders[1] and "{timestamp}" not in folders[0]
