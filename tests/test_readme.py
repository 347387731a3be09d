"""The README's examples, run as a user copies them: the first Python example, its GPU variant, the shell commands."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_the_first_example_is_the_one_after_the_introduction():
    first = code_blocks("python")[0]
    assert "EGPOTrainer(" in first and "trainer.train()" in first
    assert README.index(first) < README.index("## What `make demo` shows")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_first_python_example_runs_as_copied(tmp_path):
    """Saved to a file and run from a folder that is not the repository's, offline, on CPU."""
    (tmp_path / "example.py").write_text(code_blocks("python")[0])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "example.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=580
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'train_runtime'" in result.stdout + result.stderr
    assert "egpo/entropy_gap" in result.stdout + result.stderr
    assert (tmp_path / "outputs" / "readme-example").is_dir()


def _call_keywords(source: str, name: str) -> dict:
    """Literal keyword arguments of the first call to ``name`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    raise AssertionError(f"no call to {name}")


def test_the_gpu_variant_is_complete():
    """Data, length, learning rate and batch spelled out (no TRL default decides them), and the launch command."""
    from egpo_trl import EGPOConfig
    from egpo_trl.input_checks import training_value_problems

    gpu = code_blocks("python")[1]
    assert 'load_from_disk("outputs/data/openr1_stable_10k/dataset")' in gpu and "trainer.train()" in gpu
    args = _call_keywords(gpu, "EGPOConfig")
    assert args["learning_rate"] == 1e-6 and args["num_train_epochs"] == 5 and args.get("bf16") is True
    assert "use_cpu" not in args and args["use_vllm"] is True
    # 8 processes: 64 prompts of 16 completions per optimizer step, as the paper's recipe.
    processes = 8
    completions = args["per_device_train_batch_size"] * processes * args["gradient_accumulation_steps"]
    assert completions == 1024 and completions % args["num_generations"] == 0
    recipe = yaml.safe_load((REPO / "recipes/egpo_qwen15b.yaml").read_text())
    for name, value in args.items():
        if name in recipe and name not in ("output_dir", "report_to"):
            assert recipe[name] == value, name
    # Every field exists and its value is valid (on this machine: CPU, no vLLM).
    config = EGPOConfig(**{**args, "bf16": False, "use_cpu": True, "use_vllm": False, "output_dir": "/tmp/x"})
    assert training_value_problems(config) == []
    launches = [c for c in _shell_commands() if c[:2] == ["accelerate", "launch"] and "train_egpo_gpu.py" in c]
    assert launches and launches[0][launches[0].index("--num_processes") + 1] == str(processes)
    assert ["egpo-trl", "data", "build", "--config", "recipes/data/openr1_stable_10k.yaml"] in _shell_commands()
    cpu = _call_keywords(code_blocks("python")[0], "EGPOConfig")
    assert cpu["use_cpu"] is True and cpu["bf16"] is False
    assert cpu["per_device_train_batch_size"] % cpu["num_generations"] == 0


def _shell_commands() -> list[list[str]]:
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line, comments=True))
    return commands


def test_shell_commands_name_files_and_targets_that_exist():
    makefile = (REPO / "Makefile").read_text()
    commands = _shell_commands()
    assert ["source", ".venv/bin/activate"] in commands  # said right after `make demo`
    for command in commands:
        if command[0] == "make":
            assert re.search(rf"^{re.escape(command[1])}:", makefile, re.M), command
        for word in command:
            if word.startswith(("recipes/", "notebooks/", "benchmarks/")) and "*" not in word and "<" not in word:
                assert (REPO / word).exists(), word


@pytest.mark.slow
def test_the_evaluation_and_diagnosis_commands_run(tmp_path):
    """The README's first evaluation command (on the shipped model, fewer problems) and the diagnosis of its run."""
    evals = [c for c in _shell_commands() if c[:2] == ["egpo-trl", "eval"] and "egpo_trl/assets/tiny-math-qwen2" in c]
    command = evals[0]
    command[command.index("--limit") + 1] = "8"
    command[command.index("--output-dir") + 1] = str(tmp_path / "eval-tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "egpo_trl.cli"]
    result = subprocess.run([*cli, *command[1:]], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "eval-tiny" / "summary.json").is_file()
    diagnose = [c for c in _shell_commands() if c[:2] == ["egpo-trl", "diagnose"]][0]
    assert diagnose[2].startswith("runs/")
    result = subprocess.run(
        [*cli, "diagnose", str(tmp_path / "eval-tiny")], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
