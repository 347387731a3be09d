"""Packaging: the wheel holds the shipped model and benchmark files, and building it prints no setuptools warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_the_data_folders_without_warnings(tmp_path):
    source = tmp_path / "source"  # setuptools builds in the source tree: a copy keeps the checkout clean
    ignore = shutil.ignore_patterns(".git", ".venv*", "build", "outputs", "runs", "*.egg-info", "__pycache__")
    shutil.copytree(REPO, source, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)]
        + ["--verbose"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "is absent from the `packages` configuration" not in output
    assert "License classifiers are deprecated" not in output
    (wheel,) = tmp_path.glob("egpo_trl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "egpo_trl/assets/tiny-math-qwen2/model.safetensors",
        "egpo_trl/assets/tiny-math-qwen2/tokenizer.json",
        "egpo_trl/data/benchmarks/gsm8k/test.jsonl",
    ):
        assert required in names, required
    assert not [name for name in names if "__pycache__" in name]


def test_run_folders_are_ignored_by_git():
    result = subprocess.run(
        ["git", "check-ignore", "runs/eval-demo/summary.json", "outputs/demo/metrics.jsonl"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.stdout.split() == ["runs/eval-demo/summary.json", "outputs/demo/metrics.jsonl"]
