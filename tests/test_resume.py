"""Exact resume: a run stopped (a regular checkpoint, or Ctrl-C in the middle of a step) and resumed gives the same
metrics and the same final weights as the run that was never stopped; a finished run resumed trains nothing."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from conftest import last_line

from egpo_trl.resume_state import generation_seed
from egpo_trl.train import main, read_metrics

REPO = Path(__file__).resolve().parents[1]
DEMO_RECIPE = REPO / "recipes" / "demo_tiny_cpu.yaml"

# One generation batch spans two optimizer steps (steps_per_generation=2), so a checkpoint after an odd step holds a
# batch in progress; attention dropout makes every training step draw random numbers.
RUN = [
    "--config", str(DEMO_RECIPE), "--per_device_train_batch_size", "4", "--num_generations", "4",
    "--steps_per_generation", "2", "--max_completion_length", "16", "--synthetic_train_size", "32",
    "--eval_size", "3", "--eval_num_samples", "1", "--disable_tqdm", "true", "--plot", "false",
    "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "3", "--learning_rate", "3e-4",
    "--model_init_kwargs", '{"attention_dropout": 0.1}',
]  # fmt: skip
# Logged numbers that measure time, and the end-of-training summary (it covers the steps of one call only).
UNTIMED = ("time_s", "clock_s", "step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def _rows(out: Path) -> list[dict]:
    rows = []
    for record in read_metrics(out / "metrics.jsonl"):
        if "train_loss" in record:
            continue
        rows.append({k: v for k, v in record.items() if k not in UNTIMED and not k.startswith("timing/")})
    return rows


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run never stopped: its metrics rows and final weights."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    assert main([*RUN, "--output_dir", str(out)]) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    return out, rows, _digest(out / "model.safetensors")


@pytest.mark.slow
def test_resume_from_a_checkpoint_inside_a_generation_batch_is_exact(reference, tmp_path, capsys, caplog):
    ref_out, ref_rows, ref_weights = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out / "checkpoint-3", out / "checkpoint-3")  # as if the run had stopped after step 3
    for name in ("metrics.jsonl", "heldout.json"):
        shutil.copy(ref_out / name, out / name)
    capsys.readouterr()
    assert main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    printed = capsys.readouterr().out
    assert "Held-out accuracy before training" in printed and "stored by the run resumed" in printed
    assert "cannot be resumed exactly" not in caplog.text and "has no egpo_resume_state" not in caplog.text
    assert _rows(out) == ref_rows
    assert _digest(out / "model.safetensors") == ref_weights
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    times = [r["time_s"] for r in records]
    assert times == sorted(times)  # the clock continues, it does not restart at 0
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(0 < r["clock_s"] for r in records)
    # The copied file's records after step 3 (those steps, trained again, and the evaluation after training) were
    # set aside, not lost.
    copied = read_metrics(ref_out / "metrics.jsonl")
    later = [r for r in copied if r.get("step", 0) > 3 or r.get("heldout/stage") == "after"]
    (aside,) = (out / "replaced").iterdir()
    assert aside.name.endswith("-from-step-3") and f"moved to {aside}" in printed
    assert later and read_metrics(aside / "metrics.jsonl") == later


def _interrupted_run(monkeypatch, argv: list[str], after_calls: int, method: str = "training_step") -> int:
    """``main(argv)`` with a Ctrl-C (SIGINT) right after the given number of calls of ``EGPOTrainer.<method>``
    (``training_step``: micro-batches; ``_generate_and_score_completions``: generations)."""
    from egpo_trl.trainer import EGPOTrainer

    calls = []
    original = getattr(EGPOTrainer, method)

    def interrupted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls.append(self.state.global_step)
        if len(calls) == after_calls:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(EGPOTrainer, method, interrupted)
    try:
        return main(argv)
    finally:
        monkeypatch.undo()


@pytest.mark.slow
def test_ctrl_c_inside_a_step_then_resume_is_exact(reference, tmp_path, monkeypatch):
    _, ref_rows, ref_weights = reference
    out = tmp_path / "run"
    # After the 2nd generation, in step 3: it drew random numbers (sampling, dropout in the old-policy pass), and the
    # step's training has not begun.
    run = [*RUN, "--output_dir", str(out)]
    assert _interrupted_run(monkeypatch, run, after_calls=2, method="_generate_and_score_completions") == 130
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    assert _rows(out) == ref_rows
    assert _digest(out / "model.safetensors") == ref_weights


def _ctrl_c_after_the_update(monkeypatch, argv: list[str], times: int) -> tuple[int, list[int]]:
    """``main(argv)`` with ``times`` Ctrl-C (SIGINT) right after step 2's optimizer update, before the step is
    counted: the exit code, and the global steps at which they were sent."""
    from transformers import TrainerCallback

    from egpo_trl.trainer import EGPOTrainer

    sent = []

    class CtrlC(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:  # step 2's update is applied; the step is not counted yet
                sent.append(state.global_step)
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)

    init = EGPOTrainer.__init__

    def with_ctrl_c(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(CtrlC())

    monkeypatch.setattr(EGPOTrainer, "__init__", with_ctrl_c)
    try:
        return main(argv), sent
    finally:
        monkeypatch.undo()


@pytest.mark.slow
def test_ctrl_c_during_the_optimizer_update_saves_that_step_and_resumes_exactly(reference, tmp_path, monkeypatch):
    """A Ctrl-C that arrives between step 2's optimizer update and the end of that step is held back to the step's
    end: the checkpoint is step 2's (not lost to a half-finished update), and the resumed run is exact."""
    _, ref_rows, ref_weights = reference
    out = tmp_path / "run"
    assert _ctrl_c_after_the_update(monkeypatch, [*RUN, "--output_dir", str(out)], times=1) == (130, [1])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [r["step"] for r in _rows(out) if "loss" in r] == [1, 2]  # step 2 finished and logged before stopping
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # no handler of the run left behind
    assert main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    assert _rows(out) == ref_rows
    assert _digest(out / "model.safetensors") == ref_weights


@pytest.mark.slow
def test_a_second_ctrl_c_inside_the_update_saves_no_checkpoint(tmp_path, monkeypatch, capsys):
    """Two Ctrl-C after step 2's update, before the step is counted: the second stops at once and nothing is saved,
    even where the optimizer keeps no step count to tell a half-finished step by (SGD)."""
    out = tmp_path / "run"
    run = [*RUN, "--output_dir", str(out), "--optim", "sgd", "--eval_size", "0"]
    assert _ctrl_c_after_the_update(monkeypatch, run, times=2) == (130, [1])
    assert not list(out.glob("checkpoint-*"))
    assert "Checkpoint not saved: a second Ctrl-C stopped step 2 before it had finished." in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_under_deepspeed_after_the_update_saves_that_step(tmp_path, tiny_model_dir):
    """DeepSpeed applies the update inside the last micro-batch's backward, before the optimizer hooks: a Ctrl-C
    right after it is held back to the step's end, and the checkpoint saved is that step's, with its weights (it was
    refused as "during an optimizer update" before)."""
    pytest.importorskip("deepspeed")
    import json
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.update(WANDB_MODE="disabled", PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "recipes" / "accelerate" / "zero2.yaml"), "--num_processes", "1", "--mixed_precision", "no",
               "--main_process_port", str(29700 + os.getpid() % 100),
               str(REPO / "tests" / "scripts" / "deepspeed_ctrl_c.py"), tiny_model_dir, str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped"] and result["engine_steps_at_ctrl_c"] == [2], result
    assert result["checkpoints"] == ["checkpoint-2"] and result["saved_step"] == 2, result
    assert result["weights_are_the_models"], result


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    ["advantage_settings", "process_count", "same_weights"],
)
def test_a_state_saved_with_another_layout_is_ignored_with_a_warning(reference, tmp_path, caplog, change):
    """The generation buffer of checkpoint-3 belongs to its process count, batch shape and the settings its groups and
    advantages were made with: a resume with other ones ignores it, says so, and still trains to the end. The default reward weights written out are the same settings: it resumes
    exactly."""
    import torch

    from egpo_trl.resume_state import RESUME_STATE_NAME

    ref_out = reference[0]
    out = tmp_path / "run"
    shutil.copytree(ref_out / "checkpoint-3", out / "checkpoint-3")
    shutil.copy(ref_out / "metrics.jsonl", out / "metrics.jsonl")
    state_file = out / "checkpoint-3" / RESUME_STATE_NAME
    saved = torch.load(state_file, weights_only=True)
    assert saved["layout"]["steps_per_generation"] == 2 and saved["layout"]["world_size"] == 1
    assert saved["buffered_inputs"] is not None  # a batch in progress, which an exact resume would train on
    run = [*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "true", "--eval_size", "0"]
    if change == "advantage_settings":  # the buffered batch holds groups of 4 and group-scaled advantages
        run += ["--num_generations", "2", "--scale_rewards", "batch"]
        expected = "it was saved with num_generations=4 (now 2), scale_rewards=group (now batch)"
    elif change == "same_weights":  # the one reward function's default weight, written out
        run += ["--reward_weights", "1.0"]
        expected = None
    else:  # as saved by two processes
        state_file.rename(state_file.with_name(RESUME_STATE_NAME.replace(".pt", "_0.pt")))
        shutil.copy(
            state_file.with_name(RESUME_STATE_NAME.replace(".pt", "_0.pt")),
            state_file.with_name(RESUME_STATE_NAME.replace(".pt", "_1.pt")),
        )
        expected = "egpo_resume_state_0.pt, egpo_resume_state_1.pt but not egpo_resume_state.pt"
    with caplog.at_level("WARNING", logger="egpo_trl.resume_state"):
        assert main(run) == 0
    if expected is None:
        assert "cannot be resumed exactly" not in caplog.text
        assert _digest(out / "model.safetensors") == reference[2]
    else:
        assert "cannot be resumed exactly" in caplog.text and expected in caplog.text
    assert [r["step"] for r in _rows(out) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resuming_a_finished_run_trains_nothing(reference, tmp_path, capsys):
    ref_out = reference[0]
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    before = {p: (_digest(p), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    printed = [line for line in capsys.readouterr().out.strip().splitlines() if not line.startswith("Batch: ")]
    assert len(printed) == 1 and printed[0].startswith("egpo-trl train: nothing to train: ")
    assert "step 4" in printed[0] and "max_steps=4" in printed[0]
    assert {p: (_digest(p), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == before


def test_resuming_a_finished_run_from_python_trains_nothing(tmp_path, tiny_model_dir, caplog):
    """EGPOTrainer.train(resume_from_checkpoint=...) at the run's last step: the checkpoint is loaded, no step runs,
    nothing is written, and the warning says so (Trainer alone would train, and save, one step more)."""
    import logging

    import torch
    from conftest import make_prompt_dataset, parity_reward
    from conftest import trainer_config as config

    from egpo_trl import EGPOTrainer

    def trainer():
        args = config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, lr_scheduler_type="constant")
        return EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset(16))

    first = trainer()
    first.train()
    out = Path(first.args.output_dir)
    trained = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    before = {p: _digest(p) for p in out.rglob("*") if p.is_file()}
    for checkpoint in (True, str(out / "checkpoint-2")):
        resumed = trainer()
        with caplog.at_level(logging.WARNING, logger="egpo_trl.resume_state"):
            result = resumed.train(resume_from_checkpoint=checkpoint)
        assert "Nothing to train: the checkpoint is at step 2 and this run stops at step 2 (max_steps=2)" in (
            caplog.text
        )
        caplog.clear()
        assert result.global_step == 2 and resumed.state.global_step == 2 and not resumed.is_in_train
        for name, value in resumed.model.state_dict().items():  # the checkpoint's weights, no step trained
            torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
        assert {p: _digest(p) for p in out.rglob("*") if p.is_file()} == before
        assert not (out / "checkpoint-3").exists()
    # With a larger max_steps the same checkpoint resumes and trains on.
    resumed = trainer()
    resumed.args.max_steps = 3
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and (out / "checkpoint-3").is_dir()


def test_a_finished_epochs_run_is_judged_by_the_trainers_own_step_count(tmp_path, tiny_model_dir, caplog):
    """Runs sized by num_train_epochs: a fractional count (stored rounded up in trainer_state.json, where Trainer
    alone trains and saves a step more) trains nothing; the same checkpoint with twice the data trains on, as
    Trainer does; with load_best_model_at_end the model is the best checkpoint's, as at the end of the run."""
    import logging

    import torch
    from conftest import make_prompt_dataset, parity_reward
    from conftest import trainer_config as config
    from safetensors.torch import load_file

    from egpo_trl import EGPOTrainer

    def trainer(folder, rows=8, **overrides):
        args = config(
            tmp_path / folder, max_steps=-1, save_strategy="steps", save_steps=1, lr_scheduler_type="constant",
            **overrides,
        )  # fmt: skip
        return EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset(rows))

    first = trainer("fraction", num_train_epochs=1.5)  # 8 prompts: 4 steps an epoch, 6 in all
    first.train()
    out = Path(first.args.output_dir)
    assert first.state.global_step == 6
    before = {p: _digest(p) for p in out.rglob("*") if p.is_file()}
    with caplog.at_level(logging.WARNING, logger="egpo_trl.resume_state"):
        trainer("fraction", num_train_epochs=1.5).train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert "this run stops at step 6 (num_train_epochs=1.5 over this run's data and batch sizes)" in caplog.text
    assert {p: _digest(p) for p in out.rglob("*") if p.is_file()} == before  # no checkpoint-7

    first = trainer("more_data", num_train_epochs=1)
    first.train()
    out = Path(first.args.output_dir)
    resumed = trainer("more_data", rows=16, num_train_epochs=1)  # one epoch is now 8 steps
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert resumed.state.global_step == 8

    def best_of_three():
        args = config(
            tmp_path / "best", max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
            load_best_model_at_end=True, metric_for_best_model="eval_reward", greater_is_better=True,
            per_device_eval_batch_size=8, lr_scheduler_type="constant",
        )  # fmt: skip
        return EGPOTrainer(
            tiny_model_dir,
            parity_reward,
            args,
            train_dataset=make_prompt_dataset(16),
            eval_dataset=make_prompt_dataset(4),
        )

    first = best_of_three()
    first.train()
    out = Path(first.args.output_dir)
    assert Path(first.state.best_model_checkpoint).name != "checkpoint-3"  # the best is not the last one
    best = load_file(str(Path(first.state.best_model_checkpoint) / "model.safetensors"))
    resumed = best_of_three()
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.state.best_model_checkpoint == first.state.best_model_checkpoint
    for name, value in resumed.model.state_dict().items():
        if name in best:
            torch.testing.assert_close(value, best[name], rtol=0, atol=0)


# Epoch-sized runs through the command: one prompt of 4 completions a step.
EPOCH_RUN = [
    "--config", str(DEMO_RECIPE), "--per_device_train_batch_size", "4", "--num_generations", "4",
    "--steps_per_generation", "2", "--max_completion_length", "8", "--eval_size", "3", "--eval_num_samples", "1",
    "--disable_tqdm", "true", "--plot", "false", "--save_strategy", "steps", "--save_steps", "1",
    "--learning_rate", "3e-4", "--max_steps", "-1",
]  # fmt: skip


@pytest.mark.slow
def test_finished_epoch_runs_resumed_by_the_command_train_and_write_nothing(tmp_path, capsys):
    """A run sized by num_train_epochs is judged by the trainer's own step count, before anything is written: a
    fractional count (stored rounded up in trainer_state.json) trains nothing and leaves every file as it was; a run
    given more data since trains on, as Trainer does, and so does a run sized by max_steps resumed with epochs."""
    import json

    out = tmp_path / "fraction"
    run = [*EPOCH_RUN, "--synthetic_train_size", "8", "--num_train_epochs", "1.5", "--output_dir", str(out)]
    assert main(run) == 0
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 12  # 8 steps an epoch
    before = {p: _digest(p) for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main([*run, "--eval_num_samples", "2", "--resume_from_checkpoint", "true"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("egpo-trl train: nothing to train: "), printed
    assert "stops at step 12 (num_train_epochs=1.5 over this run's data and batch sizes)" in printed[-1]
    assert not any("Held-out accuracy" in line for line in printed), printed  # nothing evaluated
    assert {p: _digest(p) for p in out.rglob("*") if p.is_file()} == before

    out = tmp_path / "grown"
    run = [*EPOCH_RUN, "--num_train_epochs", "1", "--output_dir", str(out)]
    assert main([*run, "--synthetic_train_size", "4"]) == 0  # 4 steps
    capsys.readouterr()
    assert main([*run, "--synthetic_train_size", "8", "--resume_from_checkpoint", "true"]) == 0
    assert "nothing to train" not in capsys.readouterr().out
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 8  # one epoch of 8 prompts
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == list(range(1, 9))
    assert _digest(out / "model.safetensors") == _digest(out / "checkpoint-8" / "model.safetensors")

    out = tmp_path / "to_epochs"
    run = [*EPOCH_RUN, "--synthetic_train_size", "4", "--output_dir", str(out)]
    assert main([*run, "--max_steps", "2"]) == 0
    assert main([*run, "--num_train_epochs", "1", "--resume_from_checkpoint", "true"]) == 0
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.slow
def test_ctrl_c_after_the_last_step_keeps_the_trained_run(reference, tmp_path, monkeypatch, capsys):
    """Without regular checkpoints, a Ctrl-C during the held-out evaluation after training saves a checkpoint of the
    last step, with the weights of the run never stopped; a resume from it has nothing to train and says so."""
    import egpo_trl.heldout as heldout_module

    ref_weights = reference[2]
    out = tmp_path / "run"
    run = [*RUN, "--save_strategy", "no", "--output_dir", str(out)]
    evaluate, calls = heldout_module.heldout_accuracy, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the evaluation after training
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(heldout_module, "heldout_accuracy", interrupted)
    capsys.readouterr()
    assert main(run) == 130
    assert last_line(capsys.readouterr().err) == (
        f"Interrupted after the last step: {out / 'checkpoint-4'} holds the trained weights, but {out} lacks the "
        "trained model of step 4 and the held-out evaluation after step 4 (load the weights from the checkpoint)."
    )
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    assert not (out / "model.safetensors").exists()
    monkeypatch.undo()
    assert _digest(out / "checkpoint-4" / "model.safetensors") == ref_weights
    assert main([*run, "--resume_from_checkpoint", "true"]) == 0
    printed = last_line(capsys.readouterr().out)
    assert printed.startswith("egpo-trl train: nothing to train: ") and "left as they are" not in printed
    assert f"{out} lacks the trained model of step 4 and the held-out evaluation after step 4" in printed
    assert not (out / "model.safetensors").exists()


@pytest.mark.slow
def test_an_earlier_checkpoint_never_replaces_the_outputs_of_a_later_step(reference, tmp_path):
    """A run that finished at step 4, resumed from checkpoint-2 to end at step 3: its final outputs would replace step
    4's; the command stops, names them, and changes nothing. Past them (--max_steps 5) it trains on."""
    out = tmp_path / "run"
    assert main([*RUN, "--save_steps", "1", "--output_dir", str(out)]) == 0
    before = {p: _digest(p) for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as stopped:
        main(
            [*RUN, "--output_dir", str(out), "--max_steps", "3", "--resume_from_checkpoint", str(out / "checkpoint-2")]
        )
    message = str(stopped.value)
    assert "the trained model of step 4 and the held-out evaluation after training at step 4" in message, message
    assert "this run ends at step 3" in message and "another --output_dir" in message
    assert {p: _digest(p) for p in out.rglob("*") if p.is_file()} == before
    assert (
        main(
            [*RUN, "--output_dir", str(out), "--max_steps", "5", "--resume_from_checkpoint", str(out / "checkpoint-2")]
        )
        == 0
    )
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5]


def test_generation_seeds_depend_on_the_place_in_the_run_only():
    base = generation_seed(0, 5, 0, 0, 0)
    assert generation_seed(0, 5, 0, 0, 0) == base  # the same place, the same seed: in a resumed run too
    places = [
        (s, st, c, i, x) for s in (0, 1) for st in (0, 1, 2) for c in (-1, 0, 1) for i in (0, 1) for x in range(8)
    ]
    seeds = [generation_seed(*place) for place in places]
    assert len(set(seeds)) == len(seeds)  # every prompt, instance, call, step and run seed draws apart
    assert all(0 <= seed < 2**63 for seed in seeds)


@pytest.mark.slow
def test_resume_in_a_later_epoch_keeps_the_prompt_order(tmp_path):
    # 4 prompts, 2 per generation batch of 2 steps: an epoch is 4 steps; checkpoint-5 falls in the second, which generates again at step 7.
    run = [*RUN, "--synthetic_train_size", "4", "--max_steps", "8", "--save_steps", "5", "--eval_size", "0"]
    reference = tmp_path / "reference"
    assert main([*run, "--output_dir", str(reference)]) == 0
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoint-5", out / "checkpoint-5")
    shutil.copy(reference / "metrics.jsonl", out / "metrics.jsonl")
    assert main([*run, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    assert _rows(out) == _rows(reference)
    assert _digest(out / "model.safetensors") == _digest(reference / "model.safetensors")


# Two steps with a checkpoint after each: the runs the tests below resume, copy or resume into.
SHORT = [*RUN, "--max_steps", "2", "--save_steps", "1"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A finished two-step run (held-out at 1 sample, T=1): its folder, to copy from and never to change."""
    out = tmp_path_factory.mktemp("short") / "run"
    assert main([*SHORT, "--output_dir", str(out)]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    return out


# Other held-out settings than the short run's.
NEW_EVAL = ["--eval_num_samples", "3", "--eval_temperature", "0.3"]


def _files(folder: Path) -> dict[Path, tuple[str, int]]:
    return {p: (_digest(p), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def _heldout_records(out: Path) -> dict[str, float]:
    """The ``heldout/accuracy`` of each stage in ``metrics.jsonl`` (each stage must appear once)."""
    records = [r for r in read_metrics(out / "metrics.jsonl") if "heldout/stage" in r]
    stages = [r["heldout/stage"] for r in records]
    assert sorted(stages) == sorted(set(stages)), stages
    return {r["heldout/stage"]: r["heldout/accuracy"] for r in records}


@pytest.mark.slow
def test_a_checkpoint_of_another_folder_does_not_resume_the_run_in_output_dir(short_run, tmp_path):
    """Resuming from a checkpoint of run A into a folder that holds run B is refused, as a new run there is: B's
    files stay as they were. Into a new folder it starts a new run from A's checkpoint, and A is left alone."""
    other = tmp_path / "other"
    shutil.copytree(short_run, other)
    kept, source = _files(other), _files(short_run)
    start_from = ["--resume_from_checkpoint", str(short_run / "checkpoint-1")]
    with pytest.raises(SystemExit, match="already holds another run") as refused:
        main([*SHORT, "--seed", "7", "--output_dir", str(other), *start_from])
    assert "--overwrite_output_dir" in str(refused.value) and "new --output_dir" in str(refused.value)
    assert "--resume_from_checkpoint true" not in str(refused.value)  # that would resume B, not start from A
    assert _files(other) == kept
    with pytest.raises(SystemExit, match="already holds another run"):  # a checkpoint at the run's last step too
        main([*SHORT, "--output_dir", str(other), "--resume_from_checkpoint", str(short_run / "checkpoint-2")])
    assert _files(other) == kept

    new = tmp_path / "new"
    assert main([*SHORT, "--output_dir", str(new), *start_from]) == 0
    assert _files(short_run) == source  # nothing of run A truncated or rewritten
    assert [r["step"] for r in _rows(new) if "loss" in r] == [2]  # step 2 trained from checkpoint-1's state
    assert _rows(new) == [r for r in _rows(short_run) if r.get("step") != 1]  # and logged as run A logged it
    assert _digest(new / "model.safetensors") == _digest(short_run / "model.safetensors")
    assert set(_heldout_records(new)) == {"before", "after"}
    assert sorted(p.name for p in new.glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.slow
def test_a_recomputed_heldout_evaluation_before_training_replaces_the_stored_one_in_metrics(short_run, tmp_path):
    """Resumed with other evaluation settings, the evaluation before training runs again: ``metrics.jsonl`` (and
    so the curves) and ``heldout.json`` then hold the new result, the other records stay where they were."""
    import json

    out = tmp_path / "run"
    shutil.copytree(short_run / "checkpoint-1", out / "checkpoint-1")
    for name in ("metrics.jsonl", "heldout.json"):
        shutil.copy(short_run / name, out / name)
    assert main([*SHORT, "--output_dir", str(out), "--resume_from_checkpoint", "true", *NEW_EVAL]) == 0
    heldout = json.loads((out / "heldout.json").read_text())
    assert (heldout["before"]["num_samples"], heldout["before"]["temperature"]) == (3, 0.3)
    assert _heldout_records(out) == {"before": heldout["before"]["accuracy"], "after": heldout["after"]["accuracy"]}
    records = read_metrics(out / "metrics.jsonl")
    assert records[0] == {"step": 0, "heldout/accuracy": heldout["before"]["accuracy"], "heldout/stage": "before"}
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r for r in _rows(out) if r.get("step") == 1] == [r for r in _rows(short_run) if r.get("step") == 1]


@pytest.mark.slow
def test_a_resume_whose_checkpoint_fails_to_load_leaves_the_earlier_runs_files(short_run, tmp_path):
    """Resumed with other evaluation settings from a checkpoint that does not load: ``heldout.json`` and
    ``metrics.jsonl`` keep the earlier run's evaluations before and after training, and no checkpoint is set aside."""
    out = tmp_path / "run"
    shutil.copytree(short_run, out)
    (out / "checkpoint-1" / "optimizer.pt").write_bytes(b"not an optimizer state")
    found = {name: _digest(out / name) for name in ("heldout.json", "metrics.jsonl")}
    with pytest.raises(Exception):  # noqa: B017 - torch's own error for a corrupt file
        main([*SHORT, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-1"), *NEW_EVAL])
    assert {name: _digest(out / name) for name in found} == found
    assert (out / "checkpoint-2").is_dir() and not (out / "replaced").exists()


@pytest.mark.slow
def test_a_finished_run_whose_final_model_is_older_than_its_checkpoint_says_so(tmp_path, capsys):
    """A run extended from step 1 to step 2 without saving its final model: resuming it has nothing to train and
    says that output_dir still holds the model of step 1, not that its outputs are left as they are."""
    out = tmp_path / "run"
    assert main([*SHORT, "--output_dir", str(out), "--max_steps", "1"]) == 0
    resume = [*SHORT, "--output_dir", str(out), "--resume_from_checkpoint", "true"]
    assert main([*resume, "--save_final_model", "false"]) == 0
    capsys.readouterr()
    assert main(resume) == 0
    printed = last_line(capsys.readouterr().out)
    assert printed.startswith(f"egpo-trl train: nothing to train: {out / 'checkpoint-2'} is at step 2")
    assert f"{out} lacks the trained model of step 2 (it holds that of step 1): load the trained weights" in printed


@pytest.mark.slow
def test_ctrl_c_then_resume_is_exact_with_entropy_metrics_from_the_loss_forward(tmp_path, monkeypatch):
    """GRPO takes its egpo/entropy_* metrics from the loss's forwards (two micro-batches per step here): a run
    stopped between them and resumed logs the same metrics, those included, and ends with the same weights."""
    run = [
        *RUN, "--advantage_estimator", "grpo", "--steps_per_generation", "2", "--gradient_accumulation_steps", "2",
        "--per_device_train_batch_size", "2", "--model_init_kwargs", "{}",
    ]  # fmt: skip
    reference = tmp_path / "reference"
    assert main([*run, "--output_dir", str(reference)]) == 0
    ref_rows = _rows(reference)
    assert all(r["egpo/entropy_source"] == 4 and "egpo/entropy_mean" in r for r in ref_rows if "loss" in r)
    out = tmp_path / "run"
    # After the 3rd micro-batch: step 2's first micro-batch ran, its second has not.
    assert _interrupted_run(monkeypatch, [*run, "--output_dir", str(out)], after_calls=3) == 130
    assert main([*run, "--output_dir", str(out), "--resume_from_checkpoint", "true"]) == 0
    assert _rows(out) == ref_rows  # num_tokens too: the interrupted step's generation is not counted twice
    assert _digest(out / "model.safetensors") == _digest(reference / "model.safetensors")


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_resume_from_an_earlier_checkpoint_sets_the_later_steps_aside(reference, tmp_path, capsys):
    """Resuming a run from checkpoint-3 while checkpoint-4 and its records exist moves those to
    replaced/<time>-from-step-3/ (the resumed run trains step 4 again, exactly); a resume that fails before its first
    step leaves the folder as it was; repeated resumes keep each its own folder; --overwrite_output_dir removes them."""
    ref_out, ref_rows, ref_weights = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    found = _contents(out)
    broken = out / "checkpoint-3" / "model.safetensors"
    weights = broken.read_bytes()
    broken.unlink()  # the checkpoint does not load: the resume fails before its first step
    found_broken = _contents(out)
    with pytest.raises(Exception):  # noqa: B017 - Trainer's own error for a checkpoint without weights
        main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-3")])
    assert _contents(out) == found_broken and not (out / "replaced").exists()
    broken.write_bytes(weights)
    assert _contents(out) == found

    capsys.readouterr()
    assert main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-3")]) == 0
    (aside,) = (out / "replaced").iterdir()
    assert f"moved to {aside}" in capsys.readouterr().out
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-4", "metrics.jsonl"]
    copied = read_metrics(ref_out / "metrics.jsonl")
    assert read_metrics(aside / "metrics.jsonl") == [
        r for r in copied if r.get("step", 0) > 3 or r.get("heldout/stage") == "after"
    ]
    assert _contents(aside / "checkpoint-4") == _contents(ref_out / "checkpoint-4")  # as it was, not written over
    assert _rows(out) == ref_rows and _digest(out / "model.safetensors") == ref_weights
    assert (out / "checkpoint-4").is_dir()  # this run's own

    assert main([*RUN, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-3")]) == 0
    assert len(list((out / "replaced").iterdir())) == 2  # each resume its own folder
    assert _rows(out) == ref_rows

    assert main([*RUN, "--output_dir", str(out), "--overwrite_output_dir", "true", "--max_steps", "1"]) == 0
    assert not (out / "replaced").exists() and not (out / "checkpoint-3").exists()


def test_a_run_started_from_a_checkpoint_inside_output_dir_is_not_cleared_away(reference, tmp_path):
    """--overwrite_output_dir would clear the folder before the run loads the checkpoint it starts from, when that
    checkpoint lies inside it (one set aside in replaced/, say): refused, and nothing is removed."""
    ref_out, _, _ = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    aside = out / "replaced" / "20260101-000000-from-step-3"
    aside.mkdir(parents=True)
    (out / "checkpoint-4").rename(aside / "checkpoint-4")
    found = _contents(out)
    with pytest.raises(SystemExit, match="inside .* which --overwrite_output_dir would clear"):
        main([*RUN, "--output_dir", str(out), "--overwrite_output_dir", "true",
              "--resume_from_checkpoint", str(aside / "checkpoint-4")])  # fmt: skip
    assert _contents(out) == found
