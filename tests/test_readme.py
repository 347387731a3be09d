"""The README as a user reads it: its Python examples run, its commands, flags, keys, defaults and links exist."""

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
MULTI_GPU = (REPO / "docs" / "multi_gpu.md").read_text(encoding="utf-8")


def code_blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def block_commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    lines = (line.split(" #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines())
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def shell_commands(text: str = README) -> list[list[str]]:
    return [command for block in code_blocks("bash", text) for command in block_commands(block)]


def call_keywords(source: str, name: str) -> dict:
    """Literal keyword arguments of the first call to ``name`` in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    raise AssertionError(f"no call to {name}")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header row starts with ``header``, as lists of cells."""
    lines = text[text.index(header) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_setup_commands_come_first_and_the_quickstart_follows():
    """The first lines set a fresh machine up; the first Python example trains, before Install."""
    first_commands = code_blocks("bash")[0]
    assert README.index(first_commands) < README.index("\n## ")
    assert [c[:2] for c in block_commands(first_commands)[:2]] == [["make", "demo"], ["make", "test"]]
    quickstart = code_blocks("python")[0]
    assert "from egpo_trl import EGPOConfig, EGPOTrainer" in quickstart and "trainer.train()" in quickstart
    assert README.index(quickstart) < README.index("\n## Install\n")
    assert len(quickstart.splitlines()) <= 20


def test_the_quickstart_config_is_valid():
    """Every argument of the quickstart's EGPOConfig is a field, with a value the config accepts."""
    from egpo_trl import EGPOConfig

    args = call_keywords(code_blocks("python")[0], "EGPOConfig")
    config = EGPOConfig(**args)
    assert config.use_cpu and not config.bf16
    assert config.per_device_train_batch_size % config.num_generations == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_quickstart_runs_as_copied(tmp_path):
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


def test_the_custom_reward_example_scores_text_and_chat_completions():
    """The README's reward function, as a user would save it, returns one +1/-1 per completion."""
    namespace: dict = {}
    exec(next(b for b in code_blocks("python") if "def my_reward" in b), namespace)
    completions = [
        "<think>2+2=4</think> \\boxed{4}",
        [{"role": "assistant", "content": "<think>2+2=5</think> \\boxed{5}"}],
        "no box",
    ]
    assert namespace["my_reward"](completions, answer=["4", "4", "4"], problem=["", "", ""]) == [1.0, -1.0, -1.0]


def test_the_egpo_keys_and_defaults_are_the_configs():
    """Each key of the 'EGPO on one screen' table is an EGPOConfig field with the default the table gives."""
    from egpo_trl import EGPOConfig

    def value(text: str):
        try:
            return float(text)
        except ValueError:
            return {"true": True, "false": False}.get(text, text)

    config = EGPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False)
    rows = table_rows(section("EGPO on one screen"), "| key | default |")
    assert len(rows) >= 10
    for keys, defaults, _ in rows:
        expected = [None] if defaults == "unset" else [value(default) for default in ticked(defaults)]
        for key, default in zip(ticked(keys), expected, strict=True):
            assert getattr(config, key) == default, key


def test_every_method_row_is_a_valid_config(tmp_path):
    """The methods table's keys, with their values, build an EGPOConfig; its CPU recipes exist."""
    from egpo_trl import EGPOConfig

    rows = table_rows(section("Methods"), "| method | keys |")
    assert {row[0] for row in rows} >= {"GRPO", "DAPO", "EDGE-GRPO", "NSR", "EGPO"}
    assert sum(row[0].startswith(f"C{i} ") for row in rows for i in range(1, 7)) == 6
    fields = set(EGPOConfig.__dataclass_fields__)
    for method, keys, recipe in rows:
        settings = {}
        for item in ticked(keys):
            name, _, value = item.partition(": ")
            assert name in fields, (method, name)
            if value:
                settings[name] = yaml.safe_load(value)
        EGPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **settings)
        for path in ticked(recipe):
            assert (REPO / path).is_file(), path


def _train_flags(capsys) -> set[str]:
    from egpo_trl.cli import main

    assert main(["train", "--help-all"]) == 0
    return set(re.findall(r"--[a-z][a-z0-9_]*", capsys.readouterr().out)) | {"--config", "--dry-run", "--help-all"}


def test_commands_flags_files_and_targets_exist(capsys):
    """`make` targets are the Makefile's; `egpo-trl train` flags (also after a recipe given to accelerate or python)
    are fields of `egpo-trl train --help-all`; eval commands parse; every path named exists."""
    from egpo_trl.evaluation.benchmarks import BENCHMARKS
    from egpo_trl.evaluation.cli import build_parser

    makefile = (REPO / "Makefile").read_text()
    flags = _train_flags(capsys)
    commands = shell_commands()
    assert ["source", ".venv/bin/activate"] in commands
    kinds = set()
    for command in commands:
        if command[0] == "make":
            assert re.search(rf"^{re.escape(command[1])}:", makefile, re.M), command
        recipe = next(
            (i for i, word in enumerate(command) if word.endswith(".yaml") and "accelerate/" not in word), None
        )
        if command[:2] == ["egpo-trl", "train"] or (recipe is not None and command[0] in ("python", "accelerate")):
            kinds.add(command[0])
            start = 2 if command[0] == "egpo-trl" else recipe + 1
            for word in command[start:]:
                if word.startswith("--"):
                    assert word in flags, (word, command)
        if command[:2] == ["egpo-trl", "eval"]:
            args = build_parser().parse_args(command[2:])
            if args.model:
                assert set(args.benchmarks.split(",")) <= set(BENCHMARKS), command
        for word in command:
            if word.startswith(("recipes/", "notebooks/", "benchmarks/", "egpo_trl/")) and "<" not in word:
                assert (REPO / word).exists(), word
    assert kinds == {"egpo-trl", "accelerate", "python"}
    assert {"--num_machines", "--machine_rank", "--main_process_ip", "--dry-run"} <= {
        word for command in commands for word in command
    }


def test_links_and_images_exist():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (REPO / target).exists(), target


def test_the_gpu_example_matches_its_recipe():
    """docs/multi_gpu.md's Python example trains what recipes/egpo_qwen15b.yaml trains, with valid values."""
    from egpo_trl import EGPOConfig
    from egpo_trl.input_checks import training_value_problems

    gpu = code_blocks("python", MULTI_GPU)[0]
    assert 'load_from_disk("outputs/data/openr1_stable_10k/dataset")' in gpu and "trainer.train()" in gpu
    args = call_keywords(gpu, "EGPOConfig")
    assert args["learning_rate"] == 1e-6 and args["num_train_epochs"] == 5 and args.get("bf16") is True
    processes = 8
    completions = args["per_device_train_batch_size"] * processes * args["gradient_accumulation_steps"]
    assert completions == 1024 and completions % args["num_generations"] == 0
    recipe = yaml.safe_load((REPO / "recipes/egpo_qwen15b.yaml").read_text())
    for name, value in args.items():
        if name in recipe and name not in ("output_dir", "report_to"):
            assert recipe[name] == value, name
    config = EGPOConfig(**{**args, "bf16": False, "use_cpu": True, "use_vllm": False, "output_dir": "/tmp/x"})
    assert training_value_problems(config) == []
    launch = next(c for c in shell_commands(MULTI_GPU) if "train_egpo_gpu.py" in c)
    assert launch[launch.index("--num_processes") + 1] == str(processes)


@pytest.mark.slow
def test_the_evaluation_and_diagnosis_commands_run(tmp_path):
    """The README's evaluation of the shipped model (fewer problems) and the diagnosis of its run."""
    evals = [c for c in shell_commands() if c[:2] == ["egpo-trl", "eval"] and "egpo_trl/assets/tiny-math-qwen2" in c]
    command = evals[0]
    command[command.index("--limit") + 1] = "8"
    output = command[command.index("--output-dir") + 1]
    command[command.index("--output-dir") + 1] = str(tmp_path / "eval")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cli = [sys.executable, "-m", "egpo_trl.cli"]
    result = subprocess.run([*cli, *command[1:]], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "eval" / "summary.json").is_file()
    assert ["egpo-trl", "diagnose", output] in shell_commands()
    result = subprocess.run(
        [*cli, "diagnose", str(tmp_path / "eval")], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
