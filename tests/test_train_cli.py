"""`egpo-trl train`: recipe + command-line parsing, clear errors, data loading, output folder, and a real run."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import last_line

from egpo_trl.rewards import boxed_accuracy_reward, think_format_reward
from egpo_trl.train import (
    METRICS_FILE,
    PLOT_FILE,
    TrainScriptArguments,
    load_datasets,
    main,
    make_parser,
    parse_args,
    prepare_output_dir,
    resolve_model_path,
    resolve_reward_funcs,
)

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "recipes" / "demo_tiny_cpu.yaml"


def write_recipe(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump(fields))
    return path


def test_recipe_values_and_command_line_overrides(tmp_path):
    script_args, training_args, model_args = parse_args(
        ["--config", str(DEMO_RECIPE), "--seed", "3", "--learning_rate", "2e-4", "--synthetic_levels", "1,2"]
    )
    recipe = yaml.safe_load(DEMO_RECIPE.read_text())
    # From the command line
    assert training_args.seed == 3
    assert training_args.learning_rate == 2e-4
    assert script_args.synthetic_levels == "1,2"
    # From the file
    assert training_args.num_generations == recipe["num_generations"]
    assert training_args.advantage_estimator == "egpo"
    assert training_args.egpo_lambda_min == recipe["egpo_lambda_min"]
    assert model_args.model_name_or_path == "builtin:tiny-math-qwen2"
    assert script_args.dataset_name == "synthetic:arithmetic"
    # {timestamp} is filled in
    assert "{timestamp}" not in training_args.output_dir
    assert training_args.output_dir.startswith("outputs/demo-tiny-cpu-")


def test_unknown_field_in_the_recipe_names_it_and_suggests_the_fix(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", model_name_or_path="m", use_cpu=True, bf16=False, learning_rat=1e-4)
    with pytest.raises(SystemExit) as error:
        parse_args(["--config", str(recipe)])
    message = str(error.value)
    assert "unknown field" in message and str(recipe) in message
    assert "learning_rat (did you mean learning_rate?)" in message


def test_unknown_flag_is_an_error_not_an_abbreviation():
    with pytest.raises(SystemExit) as error:
        parse_args(["--config", str(DEMO_RECIPE), "--num_generation", "4"])
    assert "num_generation (did you mean num_generations" in str(error.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "does/not/exist.yaml"], "does not exist"),
        (["--config"], "needs a path"),
        (["--config", str(DEMO_RECIPE), "--egpo_clamp", "bogus"], "invalid choice"),
        (["--config", str(DEMO_RECIPE), "--max_steps", "many"], "invalid int value"),
        (["--config", str(DEMO_RECIPE), "--egpo_lambda_min", "3"], "egpo_lambda_min"),
        (["--config", str(DEMO_RECIPE), "--use_cpu", "false", "--bf16", "true"], "use_cpu: true"),
    ],
)
def test_bad_input_gives_a_clear_error(argv, message):
    if "--use_cpu" in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("bf16 is supported on this machine")
    with pytest.raises(SystemExit) as error:
        parse_args(argv)
    assert message in str(error.value)


def test_missing_model_is_reported(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", use_cpu=True, bf16=False)
    with pytest.raises(SystemExit, match="model_name_or_path"):
        parse_args(["--config", str(recipe)])


def test_help_all_lists_every_field_with_its_help(capsys):
    assert main(["--help-all"]) == 0
    text = capsys.readouterr().out
    for name in (
        "dataset_name",
        "synthetic_levels",
        "prompt_template",
        "reward_funcs",
        "eval_size",
        "overwrite_output_dir",
        "model_name_or_path",
        "egpo_lambda_min",
        "egpo_nsr",
        "egpo_entropy_scope",
        "num_generations",
        "learning_rate",
    ):
        assert f"--{name}" in text, name
    assert "builtin:tiny-math-qwen2" in text
    parser = make_parser()
    undocumented = [a.dest for a in parser._actions if a.dest != "help" and not (a.help or "").strip()]
    assert not undocumented


def test_output_dir_with_another_run_is_refused_unless_overwrite_or_resume(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-10").mkdir(parents=True)
    (out / METRICS_FILE).write_text("{}\n")
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="overwrite_output_dir"):
        prepare_output_dir(str(out), overwrite=False, resuming=False)
    # A new run started from a checkpoint of another folder: refused too, without suggesting to resume this one.
    with pytest.raises(SystemExit, match="/elsewhere/checkpoint-3 is not one of its checkpoints") as refused:
        prepare_output_dir(str(out), overwrite=False, resuming=False, start_from="/elsewhere/checkpoint-3")
    assert "--overwrite_output_dir true" in str(refused.value) and "resume_from_checkpoint" not in str(refused.value)
    prepare_output_dir(str(out), overwrite=False, resuming=True)()  # resuming keeps everything
    assert (out / "checkpoint-10").is_dir()
    clear = prepare_output_dir(str(out), overwrite=True, resuming=False)
    assert (out / "checkpoint-10").is_dir()  # nothing is removed until the run has loaded what it needs
    clear()
    assert not (out / "checkpoint-10").exists() and not (out / METRICS_FILE).exists()
    assert (out / "notes.txt").read_text() == "keep me"
    prepare_output_dir(str(tmp_path / "fresh"), overwrite=False, resuming=False)  # a new folder is fine


def test_reward_functions_by_name_or_import_path():
    assert resolve_reward_funcs(["boxed_accuracy_reward", "think_format_reward"]) == [
        boxed_accuracy_reward,
        think_format_reward,
    ]
    assert resolve_reward_funcs(["egpo_trl.rewards:think_format_reward"]) == [think_format_reward]
    with pytest.raises(SystemExit, match="unknown reward function 'accuracy'"):
        resolve_reward_funcs(["accuracy"])
    with pytest.raises(SystemExit, match="cannot import"):
        resolve_reward_funcs(["egpo_trl.rewards:nope"])


def test_builtin_model_paths():
    path = Path(resolve_model_path("builtin:tiny-math-qwen2"))
    assert (path / "config.json").is_file()
    assert resolve_model_path("Qwen/Qwen2.5-Math-1.5B") == "Qwen/Qwen2.5-Math-1.5B"
    with pytest.raises(SystemExit, match="tiny-math-qwen2"):
        resolve_model_path("builtin:huge-model")


def test_synthetic_dataset_and_held_out_split_are_disjoint():
    args = TrainScriptArguments(synthetic_train_size=300, synthetic_levels="1,2,3", eval_size=60, system_prompt="Hi.")
    train, heldout = load_datasets(args)
    assert len(train) == 300 and len(heldout) == 60
    assert not set(train["id"]) & set(heldout["id"])
    assert train[0]["prompt"][0] == {"role": "system", "content": "Hi."}
    with pytest.raises(SystemExit, match="synthetic:arithmetic"):
        load_datasets(TrainScriptArguments(dataset_name="synthetic:geometry"))


def test_local_file_with_prompt_template_holds_out_problems(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "final": str(2 * i)} for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = TrainScriptArguments(
        dataset_name=str(data),
        prompt_template="{question} Put the answer in \\boxed{{}}.",
        answer_column="final",
        eval_size=10,
    )
    train, heldout = load_datasets(args, seed=0)
    assert len(train) == 30 and len(heldout) == 10
    assert not set(train["question"]) & set(heldout["question"])
    assert train[0]["prompt"][-1]["content"].endswith("Put the answer in \\boxed{}.")
    assert train[0]["answer"] == str(2 * int(train[0]["question"].split()[2]))
    with pytest.raises(SystemExit, match="no 'prompt' column"):
        load_datasets(TrainScriptArguments(dataset_name=str(data), answer_column="final"))
    with pytest.raises(SystemExit, match="not a column"):
        load_datasets(TrainScriptArguments(dataset_name=str(data), answer_column="final", prompt_template="{nope}"))


@pytest.mark.slow
def test_a_short_real_run_writes_metrics_plot_and_model(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "--config",
        str(DEMO_RECIPE),
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--max_completion_length",
        "48",
        "--synthetic_train_size",
        "40",
        "--eval_size",
        "6",
        "--eval_num_samples",
        "1",
        "--disable_tqdm",
        "true",
    ]
    import torch

    threads = torch.get_num_threads()
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # the recipe's torch_num_threads holds for the run only
    printed = capsys.readouterr().out
    assert "Held-out accuracy before training" in printed and "after training" in printed
    assert "points)." in printed and "%)." not in printed  # a change of accuracy is in percentage points
    assert str(out) in printed

    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("egpo/frac_all_correct", "egpo/frac_mixed", "egpo/frac_all_incorrect", "accuracy", "loss"):
        assert key in steps[0], key
    assert abs(steps[0]["accuracy"] - (steps[0]["rewards/boxed_accuracy_reward/mean"] + 1) / 2) < 1e-9
    heldout = [r for r in records if "heldout/accuracy" in r]
    assert [r["heldout/stage"] for r in heldout] == ["before", "after"]
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "heldout.json").read_text())
    assert set(summary) == {"before", "after"} and summary["after"]["step"] == 2
    assert (out / "model.safetensors").is_file()

    # The same output folder again: refused, nothing touched.
    before = (out / METRICS_FILE).read_text()
    with pytest.raises(SystemExit, match="already holds another run"):
        main(argv)
    assert (out / METRICS_FILE).read_text() == before


@pytest.mark.slow
def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "egpo_trl.train", "--help"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert "--egpo_lambda_max" in result.stdout and "--help-all" in result.stdout


# ---------------------------------------------------------------------------------------------- first-run experience
def egpo_trl(*args, cwd=REPO, timeout=300, **env):
    """Run the `egpo-trl` command line as a user would, in a child process."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "egpo_trl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def test_help_leads_with_what_users_type_and_imports_nothing_heavy():
    code = (
        "import sys; from egpo_trl.cli import main; main(['train', '--help']); "
        "assert not {'trl', 'torch', 'transformers'} & set(sys.modules), 'heavy import'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    text = result.stdout
    lines = text.splitlines()
    assert len(lines) < 120
    assert lines[0] == "usage: egpo-trl train RECIPE.yaml [--dry-run] [--FIELD VALUE ...]"
    for needle in ("--config RECIPE.yaml", "--dry-run", "--help-all", "recipes/demo_tiny_cpu.yaml", "--max_steps"):
        assert needle in text, needle
    for needle in ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port"):
        assert needle in text, needle
    # Every flag shown is a field, and every default shown is the field's own.
    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for cls in make_parser().dataclass_types
        for f in dataclasses.fields(cls)
    }
    shown = re.findall(r"^  --(\w+)(?= |$)(?: \[([^\]]*)\])?", text, flags=re.M)
    assert len(shown) > 25
    for name, default in shown:
        assert name in defaults, name
        if default:
            value = defaults[name]
            assert default == (", ".join(value) if isinstance(value, list) else str(value)), name


def test_no_recipe_says_what_to_give():
    with pytest.raises(SystemExit) as error:
        main([])
    assert "give a recipe, e.g. `egpo-trl train recipes/demo_tiny_cpu.yaml`" in str(error.value)


def test_bad_batch_is_reported_in_the_fields_the_user_sets():
    with pytest.raises(SystemExit) as error:
        parse_args(["--config", str(DEMO_RECIPE), "--per_device_train_batch_size", "60"])
    message = str(error.value)
    assert "generation_batch_size" not in message
    assert message == (
        "egpo-trl train: per_device_train_batch_size 60 x 1 process(es) x gradient_accumulation_steps 1 = 60 "
        "completions per generation, not divisible by num_generations=8 (every prompt needs a whole group); set "
        "per_device_train_batch_size to a multiple of 8, e.g. 64."
    )
    from egpo_trl import EGPOConfig

    with pytest.raises(ValueError) as api_error:  # the Python API: the same line
        EGPOConfig(output_dir="out", use_cpu=True, bf16=False, per_device_train_batch_size=60, num_generations=8)
    assert message == f"egpo-trl train: {api_error.value}"
    with pytest.raises(SystemExit, match="gradient_accumulation_steps 3 = 18 completions"):
        parse_args(
            ["--config", str(DEMO_RECIPE), "--per_device_train_batch_size", "6", "--gradient_accumulation_steps", "3"]
        )


def test_dataset_without_prompt_or_answer_fails_in_one_line_before_the_model_loads(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(20)))
    out = tmp_path / "run"
    # wandb (disabled) creates the output folder early: a failed run must not leave it behind, empty.
    common = ["train", str(DEMO_RECIPE), "--dataset_name", str(data), "--output_dir", str(out), "--report_to", "wandb"]
    result = egpo_trl(*common, WANDB_MODE="disabled")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "Loading weights" not in result.stderr
    assert last_line(result.stderr) == (
        "egpo-trl train: the dataset has no 'prompt' column and no 'answer' column (the ground truth that "
        "boxed_accuracy_reward needs) (its columns: question, solution); pass --prompt_template '{question} Put the "
        "final answer in \\boxed{{}}.' --answer_column solution."
    )
    assert not out.exists()
    result = egpo_trl(*common, "--prompt_template", "{question}", WANDB_MODE="disabled")
    assert last_line(result.stderr).endswith("(its columns: question, solution); pass --answer_column solution.")
    assert not out.exists()


def test_a_missing_model_is_one_line_in_train_and_eval(tmp_path):
    result = egpo_trl("train", str(DEMO_RECIPE), "--model_name_or_path", "./no-such-model", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert last_line(result.stderr).startswith("egpo-trl train: the model ./no-such-model does not exist; check the")
    from egpo_trl import EGPOTrainer

    with pytest.raises(ValueError) as api_error:  # the Python API: the same line
        EGPOTrainer(model="./no-such-model", reward_funcs=boxed_accuracy_reward)
    assert last_line(result.stderr) == f"egpo-trl train: {api_error.value}"
    result = egpo_trl("train", str(DEMO_RECIPE), "--model_name_or_path", "someone/no-such-model", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert last_line(result.stderr).startswith("egpo-trl train: cannot find the model someone/no-such-model: it is")
    result = egpo_trl("train", str(DEMO_RECIPE), "--model_name_or_path", "./no-such-model", "--dry-run", cwd=tmp_path)
    assert result.returncode == 1 and "  - the model ./no-such-model does not exist" in result.stdout
    out = tmp_path / "eval"
    result = egpo_trl("eval", "--model", "./no-such-model", "--benchmarks", "gsm8k", "--output-dir", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert last_line(result.stderr).startswith("egpo-trl eval: the model ./no-such-model does not exist")
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing left behind
    elsewhere = str(tmp_path / "nowhere" / "assets" / "tiny-math-qwen2")  # not the shipped model's folder
    result = egpo_trl("train", str(DEMO_RECIPE), "--model_name_or_path", elsewhere, cwd=tmp_path)
    assert result.returncode == 1 and last_line(result.stderr).endswith(
        f"egpo-trl train: the model {elsewhere} does not exist; check the path, or give a local model folder, a Hub id "
        "such as Qwen/Qwen2.5-Math-1.5B, or builtin:tiny-math-qwen2."
    )
    result = egpo_trl("eval", "--model", elsewhere, "--benchmarks", "gsm8k", "--output-dir", str(out))
    assert result.returncode == 1 and f"egpo-trl eval: the model {elsewhere} does not exist" in result.stderr


def test_training_curves_have_labelled_axes_and_one_point_per_step():
    from egpo_trl.train import metrics_figure

    rows = [{"step": s, "reward": 0.1 * s, "accuracy": 0.5, "egpo/entropy_gap": 0.1} for s in (1, 2, 3, 4, 3, 4, 5)]
    rows += [{"step": 0, "heldout/accuracy": 0.4, "heldout/stage": "before"}]
    figure = metrics_figure(rows)
    for axis in figure.axes:
        assert axis.get_xlabel() == "training step" and axis.get_ylabel(), axis.get_title()
    steps = list(figure.axes[0].lines[0].get_xdata())
    assert steps == [1, 2, 3, 4, 5]


TINY_TRAIN = [
    "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "24",
    "--synthetic_train_size", "64", "--eval_size", "0", "--disable_tqdm", "true", "--save_final_model", "false",
]  # fmt: skip


def _train_steps(out: Path) -> list[int]:
    return [
        r["step"]
        for r in (json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines())
        if "reward" in r
    ]


@pytest.mark.slow
def test_resuming_keeps_one_metrics_row_per_step(tmp_path):
    out = tmp_path / "run"
    argv = ["--config", str(DEMO_RECIPE), *TINY_TRAIN, "--output_dir", str(out), "--max_steps", "4"]
    assert main([*argv, "--save_strategy", "steps", "--save_steps", "2"]) == 0
    assert _train_steps(out) == [1, 2, 3, 4]
    # As after a crash at step 4: resuming from checkpoint-2 replays steps 3 and 4.
    assert main([*argv, "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    assert _train_steps(out) == [1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_prints_the_resume_command(tmp_path):
    import os
    import signal
    import time

    out = tmp_path / "run"
    args = ["train", str(DEMO_RECIPE), *TINY_TRAIN, "--max_steps", "30", "--output_dir", str(out)]
    # the run's output goes to files: a pipe nobody reads while waiting could fill and stall the run
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "egpo_trl.cli", *args],
            stdout=stdout,
            stderr=stderr_file,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    started = time.time()  # a loaded machine can take minutes to the second logged step: wait for it, not a guess
    logged = 0
    while time.time() < started + 600 and process.poll() is None:
        logged = len((out / METRICS_FILE).read_text().splitlines()) if (out / METRICS_FILE).is_file() else 0
        if logged >= 2:
            break
        time.sleep(0.2)
    running = process.poll() is None
    if not running or logged < 2:
        process.kill()
        process.wait(timeout=60)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert running, f"the run ended before it was interrupted: {stderr[-3000:]}"
    assert logged >= 2, f"no second step logged in {time.time() - started:.0f} s: {stderr[-3000:]}"
    waited = f"interrupted after {time.time() - started:.0f} s with {logged} steps logged"
    process.send_signal(signal.SIGINT)
    process.wait(timeout=240)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 130, f"{waited}; {stderr[-3000:]}"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1, f"{waited}; {stderr[-3000:]}"
    lines = stderr.strip().splitlines()
    assert lines[-2] == f"Interrupted; the last checkpoint is {checkpoints[0]}. Resume the run with:"
    resume = lines[-1].strip()
    assert resume.startswith("egpo-trl train ") and resume.endswith(
        f"--output_dir {out} --resume_from_checkpoint true"
    )
    import shlex

    result = egpo_trl(*shlex.split(resume)[1:], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _train_steps(out) == list(range(1, 31))


def test_invalid_training_values_are_refused_before_anything_runs(tmp_path):
    out = tmp_path / "run"
    base = ["--config", str(DEMO_RECIPE), "--output_dir", str(out)]
    for flag in (["--learning_rate", "-1e-4"], ["--learning_rate=-1e-4"]):  # with a space or an equals sign
        with pytest.raises(SystemExit, match=r"learning_rate must be >= 0 .*got -0\.0001"):
            parse_args([*base, *flag])
    with pytest.raises(SystemExit) as stop:
        main([*base, "--learning_rate", "-1e-4", "--temperature", "0", "--top_p", "1.5", "--eval_size", "5"])
    message = str(stop.value)
    assert (
        len(message.splitlines()) == 1
        and "temperature must be > 0" in message
        and "top_p must be in (0, 1]" in message
    )
    assert not out.exists()  # refused before the held-out check and before the output folder
    # A negative value after a space parses where it is valid.
    assert parse_args([*base, "--seed", "-3", "--learning_rate", "1e-4"])[1].seed == -3


def test_a_folder_left_by_a_failed_start_does_not_block_the_rerun(tmp_path):
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / METRICS_FILE).write_text(json.dumps({"step": 0, "heldout/accuracy": 0.4}) + "\n")
    prepare_output_dir(str(failed), overwrite=False, resuming=False)()
    assert not (failed / METRICS_FILE).exists()
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / METRICS_FILE).write_text(json.dumps({"step": 1, "reward": 0.5, "loss": 0.1}) + "\n")
    with pytest.raises(SystemExit, match="already holds another run"):
        prepare_output_dir(str(trained), overwrite=False, resuming=False)
    assert (trained / METRICS_FILE).is_file()
    killed = tmp_path / "killed"  # a run killed while writing its last line
    killed.mkdir()
    (killed / METRICS_FILE).write_text(json.dumps({"step": 0, "heldout/accuracy": 0.4}) + '\n{"step": 1, "rew')
    with pytest.raises(SystemExit, match="already holds another run"):
        prepare_output_dir(str(killed), overwrite=False, resuming=False)
    result = egpo_trl("train", str(DEMO_RECIPE), "--output_dir", str(killed), "--dry-run")
    assert result.returncode == 1 and "Traceback" not in result.stderr and "already holds another run" in result.stdout
    prepare_output_dir(str(killed), overwrite=True, resuming=False)()
    assert not (killed / METRICS_FILE).exists()


def test_reward_import_paths_resolve_from_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_for_test.py").write_text(
        "def my_reward(completions, answer, **kwargs):\n    return [1.0 for _ in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    # A module installed elsewhere, and a local file of the same name that must not shadow it after the import.
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / "later_import_for_test.py").write_text("WHERE = 'installed'\n")
    (tmp_path / "later_import_for_test.py").write_text("WHERE = 'current folder'\n")
    sys.path.append(str(installed))
    (func,) = resolve_reward_funcs(["cwd_rewards_for_test:my_reward"])
    assert func.__name__ == "my_reward" and func(["a", "b"], ["1", "2"]) == [1.0, 1.0]
    assert str(tmp_path) not in sys.path and "" not in sys.path  # on sys.path only during the import
    monkeypatch.delitem(sys.modules, "later_import_for_test", raising=False)
    assert importlib.import_module("later_import_for_test").WHERE == "installed"
    monkeypatch.delitem(sys.modules, "later_import_for_test")
    monkeypatch.delitem(sys.modules, "cwd_rewards_for_test")
    with pytest.raises(SystemExit, match="looked for in the current folder"):
        resolve_reward_funcs(["no_such_module_here:my_reward"])
    assert str(tmp_path) not in sys.path


def test_the_python_api_checks_its_inputs_before_loading_the_model(tmp_path, monkeypatch):
    from datasets import Dataset

    from egpo_trl import EGPOConfig, EGPOTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # not the repository root
    args = EGPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=1, report_to="none",
    )  # fmt: skip
    no_answer = Dataset.from_dict({"prompt": ["Compute 1 + 1."] * 4, "solution": ["2"] * 4})
    # A model that does not exist: the check must fail first, with its one line.
    with pytest.raises(ValueError) as error:
        EGPOTrainer(
            model="nobody/no-such-model", reward_funcs=boxed_accuracy_reward, args=args, train_dataset=no_answer
        )
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert (
        "train_dataset has no 'answer' column, which boxed_accuracy_reward (its 'answer' parameter; reward_funcs) needs"
        in message
        and "rename_column('solution', 'answer')" in message
    )
    args.learning_rate = -1e-4
    with pytest.raises(ValueError, match="learning_rate must be >= 0"):
        EGPOTrainer(
            model="nobody/no-such-model", reward_funcs=boxed_accuracy_reward, args=args, train_dataset=no_answer
        )
    args.learning_rate = 1e-4
    # The shipped model, by builtin name or by its path in the repository, from any folder.
    dataset = no_answer.rename_column("solution", "answer")
    for model in ("builtin:tiny-math-qwen2", "egpo_trl/assets/tiny-math-qwen2"):
        trainer = EGPOTrainer(model=model, reward_funcs=boxed_accuracy_reward, args=args, train_dataset=dataset)
        assert trainer.model.config.vocab_size > 0 and not Path("egpo_trl").exists()


def test_a_missing_column_message_names_what_expects_it_and_the_rename_that_fixes_it(tmp_path):
    """Each missing column is named with what expects it (the trainer, a reward's parameter, edge_gec), and the
    suggested renames take the dataset's own question-like and answer-like columns to the names expected."""
    from datasets import Dataset

    from egpo_trl import EGPOConfig, EGPOTrainer
    from egpo_trl.script.args import TrainScriptArguments
    from egpo_trl.script.data import column_problem

    def level_reward(completions, level, **kwargs):
        return [0.0 for _ in completions]

    args = EGPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_steps=1, report_to="none",
    )  # fmt: skip

    def message(columns, reward_funcs):
        dataset = Dataset.from_dict({c: ["x"] * 4 for c in columns})
        with pytest.raises(ValueError) as error:
            EGPOTrainer(model="nobody/no-such-model", reward_funcs=reward_funcs, args=args, train_dataset=dataset)
        return str(error.value)

    # Only the answer is missing: the rename takes the answer-like column, not the question column 'problem'.
    text = message(["prompt", "problem", "final_answer"], boxed_accuracy_reward)
    assert text == (
        "train_dataset has no 'answer' column, which boxed_accuracy_reward (its 'answer' parameter; reward_funcs) "
        "needs. Its columns: prompt, problem, final_answer. Rename or add them, e.g. "
        "dataset.rename_column('final_answer', 'answer')."
    )
    text = message(["question", "solution"], [boxed_accuracy_reward, level_reward])
    assert "no 'prompt' column, which the trainer (the prompts: text or chat messages) needs" in text
    assert "no 'level' column, which level_reward (its 'level' parameter; reward_funcs) needs" in text
    assert text.endswith(
        "e.g. dataset.rename_column('question', 'prompt').rename_column('solution', 'answer'); add 'level' "
        "(e.g. with dataset.map)."
    )
    # edge_gec expects the reference answers even when no reward function takes them.
    args.edge_gec = True
    text = message(["prompt", "solution"], level_reward)
    assert "no 'answer' column, which edge_gec=True (the reference answers) needs" in text
    assert "rename_column('solution', 'answer')" in text

    # The command line: a recipe whose answer_column is 'problem' is never told to build prompts from 'problem'.
    script_args = TrainScriptArguments(dataset_name="d", answer_column="problem")
    text = column_problem(["problem", "statement"], script_args)
    assert "--prompt_template '{statement} Put the final answer" in text and "{problem}" not in text


def test_values_and_rewards_that_trl_accepts_are_not_refused(tmp_path):
    import torch

    from egpo_trl import EGPOConfig
    from egpo_trl.input_checks import required_columns, training_value_problems

    def env_reward(prompts, completions, completion_ids, environments, trainer_state, log_extra, log_metric):
        return [0.0 for _ in completions]

    def column_reward(completions, answer, level, **kwargs):
        return [0.0 for _ in completions]

    # TRL passes environments (with environment_factory) and its other keywords itself; a reward model, loaded or
    # named by an id, reads the prompt and completion only; a plain function's own parameters are columns.
    rewards = [env_reward, torch.nn.Linear(2, 1), "some-org/some-reward-model", column_reward]
    assert required_columns(rewards) == {"answer": "column_reward", "level": "column_reward"}

    fields = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_steps=1, report_to="none", top_k=-1, max_grad_norm=-1.0,
    )  # fmt: skip
    # top_k=-1 is vLLM's "off" (as 0 is): accepted with vLLM; transformers' generation would refuse it mid-run.
    with pytest.raises(ValueError, match=r"^EGPOConfig: top_k=-1 turns top-k off in vLLM only.*use top_k=0\.$"):
        EGPOConfig(**fields)
    args = EGPOConfig(**fields, use_vllm=True)
    assert training_value_problems(args) == []
    args.top_k = -2
    assert training_value_problems(args) == ["top_k must be >= -1 (0, -1 or unset: off), got -2"]


@pytest.mark.slow
def test_overwrite_removes_the_earlier_run_only_once_the_run_has_loaded(tmp_path):
    """--overwrite_output_dir with a typo in the model path: the command fails and the earlier run is still there."""
    out = tmp_path / "run"
    argv = ["--config", str(DEMO_RECIPE), *TINY_TRAIN, "--output_dir", str(out), "--max_steps", "1"]
    assert main(argv) == 0
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(SystemExit, match="does not exist"):
        main([*argv, "--overwrite_output_dir", "true", "--model_name_or_path", str(tmp_path / "typo-model")])
    assert sorted(p.name for p in out.rglob("*")) == before


def test_output_dir_over_the_model_folder_is_refused(tmp_path):
    from egpo_trl.tiny_model import tiny_model_path

    model = tmp_path / "base"
    import shutil

    shutil.copytree(tiny_model_path(), model)
    weights = sorted(p.name for p in model.iterdir())
    argv = ["--config", str(DEMO_RECIPE), *TINY_TRAIN, "--model_name_or_path", str(model), "--max_steps", "1"]
    for overwrite in ("false", "true"):
        with pytest.raises(SystemExit, match="is the model folder the run starts from"):
            main([*argv, "--output_dir", str(model), "--overwrite_output_dir", overwrite])
    assert sorted(p.name for p in model.iterdir()) == weights
    from egpo_trl.script.outputs import refuse_output_dir_over_model

    refuse_output_dir_over_model(str(model / "trained"), str(model))  # its own files, beside the model's: fine
    refuse_output_dir_over_model(str(tmp_path / "run"), "Qwen/Qwen2.5-Math-1.5B")  # a Hub name


def test_resume_true_into_a_missing_folder_or_one_without_checkpoints_says_what_to_do(tmp_path):
    from types import SimpleNamespace

    from egpo_trl.script.resume import resume_checkpoint

    (tmp_path / "finished").mkdir()
    for folder in (tmp_path / "outputs" / "run-20261126", tmp_path / "finished"):
        args = SimpleNamespace(resume_from_checkpoint="true", output_dir=str(folder))
        with pytest.raises(SystemExit, match="has no checkpoint-. folder; give the earlier run"):
            resume_checkpoint(args)


def test_bf16_on_cpu_is_named_in_the_help_and_the_run_says_its_precision(tmp_path, capsys):
    """bf16 is on unless set false; with use_cpu it runs under the CPU's autocast, and the run's first line says so."""
    import torch
    from datasets import Dataset

    from egpo_trl import EGPOConfig, EGPOTrainer
    from egpo_trl.script.run import precision_label

    assert main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "with use_cpu it runs under the CPU's bf16 autocast" in help_text and "needs a GPU" not in help_text

    dataset = Dataset.from_dict({"prompt": ["Compute 1 + 1."] * 4, "answer": ["2"] * 4})
    labels = {}
    for bf16 in (None, True, False):  # None: the library default
        settings = {} if bf16 is None else {"bf16": bf16}
        args = EGPOConfig(
            output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, max_steps=1, report_to="none", **settings,
        )  # fmt: skip
        trainer = EGPOTrainer(
            model="builtin:tiny-math-qwen2", reward_funcs=boxed_accuracy_reward, args=args, train_dataset=dataset
        )
        with trainer.accelerator.autocast():
            computed = trainer.model(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype
        labels[bf16] = (precision_label(trainer), computed)
    assert labels[None] == labels[True]
    assert labels[True] == ("bf16 autocast on cpu (--bf16 false trains in float32)", torch.bfloat16)
    assert labels[False] == ("float32 on cpu", torch.float32)


def test_the_progress_bar_shows_each_step_its_own_metrics(tiny_model_dir, tmp_path, capsys):
    """The bar drawn at step k carries step k's reward and fractions, never the step before's."""
    import re

    from conftest import make_prompt_dataset, parity_reward, trainer_config
    from transformers.trainer_callback import ProgressCallback

    from egpo_trl import EGPOTrainer
    from egpo_trl.script.callbacks import CompactProgressCallback

    args = trainer_config(tmp_path, max_steps=3, bf16=False, disable_tqdm=False)
    trainer = EGPOTrainer(
        model=tiny_model_dir, reward_funcs=parity_reward, args=args, train_dataset=make_prompt_dataset()
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(CompactProgressCallback())
    capsys.readouterr()
    trainer.train()
    drawn = re.split(r"[\r\n]", capsys.readouterr().err)
    logged = {entry["step"]: entry for entry in trainer.state.log_history if "reward" in entry}
    assert sorted(logged) == [1, 2, 3]
    expected = {
        step: f"reward={entry['reward']:.2f}, mixed={entry['egpo/frac_mixed']:.2f}" for step, entry in logged.items()
    }
    assert len(set(expected.values())) > 1  # the steps differ, so a bar one step behind would show
    shown: dict[int, set[str]] = {}
    for line in drawn:
        match = re.search(r"\| (\d)/3 \[[^,\]]*, [^,\]]*, (.+)\]", line)
        if match and "reward=" in match.group(2):
            postfix = ", ".join(p for p in match.group(2).split(", ") if p.split("=")[0] in ("reward", "mixed"))
            shown.setdefault(int(match.group(1)), set()).add(postfix)
    assert shown == {step: {text} for step, text in expected.items()}


def test_the_progress_bar_derives_accuracy_only_from_a_plus_minus_one_reward():
    """`acc` = (mean + 1) / 2 holds for a +1/-1 correctness reward only; a 1/0 one shows no `acc` (as metrics.jsonl)."""
    import io

    from tqdm.auto import tqdm
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from egpo_trl.script.callbacks import CompactProgressCallback

    logs = {"reward": 0.0, "rewards/zero_one/mean": 0.0}
    shown = {}
    for plus_minus_one in (True, False):
        callback = CompactProgressCallback("zero_one", accuracy_from_reward=plus_minus_one)
        callback.training_bar = tqdm(total=1, file=io.StringIO())
        callback.on_log(TrainingArguments("unused", report_to="none"), TrainerState(), TrainerControl(), logs=logs)
        shown[plus_minus_one] = callback.training_bar.postfix
    assert shown[True] == "reward=0.00, acc=0.50"
    assert shown[False] == "reward=0.00"


def test_the_heldout_evaluation_before_training_leaves_the_training_run_unchanged(tmp_path):
    """eval_size changes what is evaluated, never what is trained: the evaluation samples from its own seed and
    gives the random state back as it found it."""
    import random

    import numpy as np
    import torch

    from egpo_trl.heldout import generate_completions
    from egpo_trl.tiny_model import tiny_model_path

    runs = {}
    for eval_size in ("0", "6"):
        out = tmp_path / f"eval{eval_size}"
        argv = ["--config", str(DEMO_RECIPE), *TINY_TRAIN, "--output_dir", str(out), "--max_steps", "2"]
        assert main([*argv, "--eval_size", eval_size, "--eval_num_samples", "2"]) == 0
        records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
        runs[eval_size] = [
            {k: v for k, v in r.items() if not any(part in k for part in ("time", "timing", "clock", "per_second"))}
            for r in records
            if "heldout/accuracy" not in r
        ]
        heldout = [r for r in records if "heldout/accuracy" in r]
        assert len(heldout) == (2 if eval_size != "0" else 0)
    assert [r["step"] for r in runs["0"] if "loss" in r] == [1, 2]
    assert runs["6"] == runs["0"]

    # The sampler itself: torch's, Python's and NumPy's next numbers are the ones they would have been.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    first = generate_completions(model, tokenizer, ["What is 2 + 3?"] * 2, max_new_tokens=6, seed=0)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[2]))
    assert generate_completions(model, tokenizer, ["What is 2 + 3?"] * 2, max_new_tokens=6, seed=0) == first


def test_kv_cache_line_says_when_a_generation_batch_is_decoded_in_rounds(tmp_path):
    """The start-up line on vLLM's KV cache: how many full-length sequences fit at once against those sent per
    generation batch, and the rounds (with the setting that changes them) only when fewer fit; nothing without a
    colocated engine (a trainer that generates with transformers)."""
    from datasets import Dataset

    from egpo_trl import EGPOConfig, EGPOTrainer
    from egpo_trl.script.run import kv_cache_line, kv_cache_message

    # The R1-Distill-7B recipe's shape: 1,024 + 15,360 tokens, 128 completions per GPU, ~400k tokens of cache.
    line = kv_cache_message(400_000, 16_384, 128)
    assert line.startswith("vLLM's KV cache holds 400,000 tokens: 24 sequences of 16,384 tokens at once")
    assert "for 128 per generation batch" in line and "decoded in 6 rounds" in line
    assert "vllm_gpu_memory_utilization" in line
    # A few sequences over what fits take a whole round more: 192 where 183 fit are 2 rounds, not "about 1.0".
    line = kv_cache_message(750_000, 4_096, 192, "oversampled first round")
    assert "183 sequences" in line and "for 192 per oversampled first round" in line and "decoded in 2 rounds" in line
    # The whole batch fits: no rounds, no advice.
    line = kv_cache_message(10_000_000, 3_272, 128)
    assert "3056 sequences" in line and "rounds" not in line and line.endswith("generation batch.")

    dataset = Dataset.from_dict({"prompt": ["Compute 1 + 1."] * 4, "answer": ["2"] * 4})
    args = EGPOConfig(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=1, report_to="none",
    )  # fmt: skip
    trainer = EGPOTrainer(
        model="builtin:tiny-math-qwen2", reward_funcs=boxed_accuracy_reward, args=args, train_dataset=dataset
    )
    assert trainer.vllm_kv_cache_tokens() is None
    assert kv_cache_line(trainer, args, 64) is None

    # With an engine: the sequences it was started with, over the run's processes (here 8) and its tensor-parallel
    # group, an oversampled first round's where there is one
    from types import SimpleNamespace

    def line(**settings):
        config = EGPOConfig(
            output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=16, gradient_accumulation_steps=8,
            num_generations=16, max_completion_length=3_072, report_to="none", **settings,
        )  # fmt: skip
        engine = SimpleNamespace(vllm_kv_cache_tokens=lambda: 600_000, accelerator=SimpleNamespace(num_processes=8))
        return kv_cache_line(engine, config, 200)

    assert line().endswith("183 sequences of 3,272 tokens at once (prompt and completion at their limits), for 128 per "
                           "generation batch.")  # fmt: skip
    assert (
        "for 256 per generation batch; when every completion runs to its limit they are decoded in 2 rounds"
        in line(vllm_tensor_parallel_size=2)
    )
    oversampled = dict(dynamic_sampling=True, dynamic_sampling_oversample=1.5)
    assert "for 192 per oversampled first round; when every completion runs to its limit they are decoded in 2 " in (
        line(**oversampled)
    )
    assert "for 384 per oversampled first round; when every completion runs to its limit they are decoded in 3 " in (
        line(**oversampled, vllm_tensor_parallel_size=2)
    )


def test_metrics_callback_writes_each_training_logs_clock(tmp_path, monkeypatch):
    """clock_s: seconds per optimizer step since the previous training log or the training's (re)start, with whatever
    ran in between (an evaluation or a save after a log counts in the next one); none on evaluations or the summary."""
    from types import SimpleNamespace

    import egpo_trl.script.callbacks as callbacks

    now = [1000.0]
    monkeypatch.setattr(callbacks.time, "time", lambda: now[0])
    path = tmp_path / "metrics.jsonl"
    # a run started from another folder's checkpoint-100: its time_s starts at 0, its steps at 100
    callback = callbacks.MetricsCallback(path, time_offset=0.0)
    state = SimpleNamespace(global_step=100, epoch=1.0, is_world_process_zero=True)
    callback.on_train_begin(None, state, None)

    def log(step, seconds, **logs):
        now[0] += seconds
        state.global_step = step
        callback.on_log(None, state, None, logs=logs)

    log(101, 95.0, loss=0.1, step_time=87.0)
    log(102, 90.0, loss=0.2, step_time=85.0)
    log(102, 30.0, eval_loss=0.3)  # an evaluation after step 102's log
    log(104, 20.0, loss=0.2, step_time=9.0)  # logging_steps 2: the mean of two steps, the evaluation's 30 s included
    log(104, 1.0, train_runtime=236.0, train_loss=0.2)  # the end-of-training summary
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("clock_s") for r in records] == [95.0, 90.0, None, 25.0, None]
    assert [r["time_s"] for r in records] == [95.0, 185.0, 215.0, 235.0, 236.0]
    # a process other than the main one writes nothing
    other = callbacks.MetricsCallback(tmp_path / "other.jsonl")
    other.on_train_begin(None, state, None)
    other.on_log(
        None, SimpleNamespace(global_step=105, epoch=1.0, is_world_process_zero=False), None, logs={"loss": 1}
    )
    assert not (tmp_path / "other.jsonl").exists()


def _demo_copy(tmp_path: Path, name: str, after_first=(), before_last=()) -> Path:
    """The CPU demo recipe with lines added after its first line and before its last (the one that trains it)."""
    lines = DEMO_RECIPE.read_text().splitlines(keepends=True)
    path = tmp_path / name
    path.write_text("".join([lines[0], *after_first, *lines[1:-1], *before_last, lines[-1]]))
    return path


def test_a_recipe_that_would_not_train_as_written_is_refused_in_one_line_by_every_entry_point(
    tmp_path, capsys, monkeypatch
):

    # A key written twice: YAML keeps the last one, so the first would be ignored.
    twice = _demo_copy(tmp_path, "twice.yaml", after_first=["max_steps: 20\n"])
    later = next(n for n, line in enumerate(twice.read_text().splitlines(), 1) if line.startswith("max_steps: 100"))
    duplicate = f"{twice}: max_steps is written twice, on lines 2 and {later}; keep one."
    # A comment ending in ''' ends the text Python skips early: what follows is a syntax error for `python`.
    quoted = _demo_copy(tmp_path, "quoted.yaml", before_last=["# see '''\n", "gradient_accumulation_steps: 1\n"])
    quotes = f"{quoted} line {len(quoted.read_text().splitlines()) - 2} holds ''', which ends the text Python skips"
    # A scalar where a list is expected: TRL's parser keeps a recipe's value as written.
    scalar = _demo_copy(tmp_path, "scalar.yaml", after_first=["reward_funcs: boxed_accuracy_reward\n"])
    listed = "reward_funcs must be a list, e.g. [boxed_accuracy_reward]."
    for recipe, message in [(twice, duplicate), (quoted, quotes), (scalar, listed)]:
        with pytest.raises(SystemExit) as stop:
            main([str(recipe), "--output_dir", str(tmp_path / "run")])
        assert message in str(stop.value) and len(str(stop.value).splitlines()) == 1
        assert main([str(recipe), "--output_dir", str(tmp_path / "run"), "--dry-run"]) == 1
        out = capsys.readouterr().out
        assert out.count(message) == 1 and "ready to run" not in out
    assert not (tmp_path / "run").exists()
    # `python twice.yaml` and `accelerate launch twice.yaml` run the recipe's last line: the first process says why,
    # once, and the others stop with it.
    from egpo_trl.recipe_launch import run_as_script

    with pytest.raises(SystemExit, match=re.escape(duplicate)):
        run_as_script(str(twice), [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run_as_script(str(twice), []) == 1
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match=re.escape(duplicate)):
        run_as_script(str(twice), [])
    assert capsys.readouterr().out == ""
    ran = subprocess.run([sys.executable, str(quoted)], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode != 0 and "SyntaxError" in ran.stderr
