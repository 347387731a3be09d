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
    """Saved to a file and run from a folder laid out like the repository root, offline, on CPU."""
    (tmp_path / "example.py").write_text(code_blocks("python")[0])
    (tmp_path / "egpo_trl").symlink_to(REPO / "egpo_trl")  # the example's model path is relative to the clone
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


def test_the_gpu_variant_changes_two_lines_and_keeps_whole_groups():
    first, gpu = code_blocks("python")[:2]
    gpu_lines = [line for line in gpu.splitlines() if line.strip()]
    assert len(gpu_lines) == 2
    lines = first.splitlines()
    for new in gpu_lines:
        key = new.strip().split("=", 1)[0]
        matches = [i for i, line in enumerate(lines) if line.strip().startswith(f"{key}=")]
        assert len(matches) == 1, key
        lines[matches[0]] = new
    variant = "\n".join(lines)
    ast.parse(variant)
    trainer = ast.unparse(
        next(
            n
            for n in ast.walk(ast.parse(variant))
            if getattr(n, "func", None) is not None and getattr(n.func, "id", "") == "EGPOTrainer"
        )
    )
    assert "Qwen/Qwen2.5-Math-1.5B" in trainer
    args = _call_keywords(variant, "EGPOConfig")
    assert "use_cpu" not in args and args.get("bf16", True)
    # TRL's check: per_device_train_batch_size x processes x gradient_accumulation_steps divisible by num_generations,
    # for any number of processes.
    assert (
        args["per_device_train_batch_size"] * args.get("gradient_accumulation_steps", 1) % args["num_generations"] == 0
    )
    cpu = _call_keywords(first, "EGPOConfig")
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
