"""Stopping and resuming ``egpo-trl train`` (the training state itself: :mod:`egpo_trl.resume_state`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from egpo_trl.script.outputs import HELDOUT_FILE, METRICS_FILE, REPLACED_DIR, read_metrics, write_metrics


def resume_checkpoint(training_args) -> str | None:
    """The checkpoint to resume from: ``true``/``last``/``latest``: the last in ``output_dir``; ``false``: ``None``."""
    from transformers.trainer_utils import get_last_checkpoint

    resume, output_dir = training_args.resume_from_checkpoint, training_args.output_dir
    if isinstance(resume, str) and resume.lower() in ("true", "last", "latest"):
        resume = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if resume is None:
            raise SystemExit(
                f"egpo-trl train: resume_from_checkpoint=true but {output_dir} has no checkpoint-* folder; give the "
                "earlier run's folder with --output_dir (a '{timestamp}' in it names a new folder on every run), a "
                "checkpoint path, or start a new run."
            )
    elif isinstance(resume, str) and resume.lower() in ("false", "none", ""):
        resume = None
    if isinstance(resume, (str, Path)) and not Path(resume).is_dir():
        raise SystemExit(
            f"egpo-trl train: resume_from_checkpoint={resume} is not a folder; give an existing checkpoint-* folder, "
            "or true for the last one in output_dir."
        )
    return resume


def resumes_own_run(checkpoint: str | Path | None, output_dir: str | Path) -> bool:
    """Whether ``checkpoint`` is one of ``output_dir``'s own ``checkpoint-<step>`` folders (it continues that run)."""
    if checkpoint is None:
        return False
    checkpoint = Path(checkpoint).resolve()
    return (
        checkpoint.parent == Path(output_dir).resolve()
        and re.fullmatch(r"checkpoint-\d+", checkpoint.name) is not None
    )


def checkpoint_step(checkpoint: str | Path) -> int:
    """The training step a ``checkpoint-*`` folder was saved at (its ``trainer_state.json``, else its name)."""
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    return int(Path(checkpoint).name.rsplit("-", 1)[-1])


def _final_steps(output_dir: str | Path) -> tuple[int, int | None]:
    """The steps of ``output_dir``'s final model (its ``trainer_state.json``) and evaluation after training."""
    state, heldout = Path(output_dir) / "trainer_state.json", Path(output_dir) / HELDOUT_FILE
    model = json.loads(state.read_text()).get("global_step") or 0 if state.is_file() else 0
    after = (json.loads(heldout.read_text()).get("after") or {}).get("step") or 0 if heldout.is_file() else None
    return model, after


def missing_final_outputs(output_dir: str | Path, step: int) -> str | None:
    """What ``output_dir`` lacks of the final outputs of a run that ended at ``step`` (``None``: nothing)."""
    model, after = _final_steps(output_dir)
    missing = [f"the trained model of step {step}" + (f" (it holds that of step {model})" if model else "")]
    missing = missing if model != step else []
    missing += [f"the held-out evaluation after step {step}"] if after not in (None, step) else []
    return " and ".join(missing) or None


def trainer_last_step(trainer) -> int:
    """The step the run stops at, counted as ``Trainer.train`` counts it (this run's data, batch sizes, processes)."""
    args = trainer.args
    if args.max_steps > 0:
        return int(args.max_steps)
    return int(trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1])


def nothing_to_train(training_args, resume, own_run: bool, trainer=None) -> bool:
    """Says so when ``resume`` is at the run's last step; refuses to replace final outputs of a later step."""
    args, output_dir = training_args, training_args.output_dir
    last_step, step = args.max_steps if trainer is None else trainer_last_step(trainer), checkpoint_step(resume)
    if step >= last_step:
        if os.environ.get("RANK", "0") == "0":
            if args.max_steps > 0:
                setting, fix = f"max_steps={args.max_steps}", "--max_steps"
            else:
                setting = f"num_train_epochs={args.num_train_epochs:g} over this run's data and batch sizes"
                fix = "--num_train_epochs, or set --max_steps,"
            missing = missing_final_outputs(output_dir, step)
            outputs = (
                f"{output_dir} lacks {missing}: load the trained weights from the checkpoint"
                if missing
                else f"the outputs in {output_dir} are left as they are, and the checkpoint holds the trained weights"
            )
            print(
                f"egpo-trl train: nothing to train: {resume} is at step {step} and the run stops at step {last_step} "
                f"({setting}); {outputs} (raise {fix} to train further).",
                flush=True,
            )
        return True
    model, after = _final_steps(output_dir) if own_run else (0, 0)
    later = [f"the trained model of step {model}"] if model > last_step else []
    later += [f"the held-out evaluation after training at step {after}"] if (after or 0) > last_step else []
    if later:
        raise SystemExit(
            f"egpo-trl train: resuming {resume}, this run ends at step {last_step}, but {output_dir} holds "
            f"{' and '.join(later)}, which this run's final outputs would replace. Raise "
            f"--max_steps/--num_train_epochs to train past them, or give another --output_dir to start a new run from "
            f"{resume}."
        )
    return False


def set_aside_later_history(output_dir: str | Path, step: int) -> Path | None:
    """Move the records and checkpoints after ``step`` into ``replaced/<time>-from-step-<step>/`` (``None``: none)."""
    output_dir = Path(output_dir)
    metrics = output_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.is_file() else []
    later = [r.get("step", 0) > step or r.get("heldout/stage") == "after" for r in records]
    checkpoints = later_checkpoints(output_dir, step)
    if not any(later) and not checkpoints:
        return None
    stamp, attempt = time.strftime("%Y%m%d-%H%M%S"), 1
    folder = output_dir / REPLACED_DIR / f"{stamp}-from-step-{step}"
    while folder.exists():
        attempt += 1
        folder = output_dir / REPLACED_DIR / f"{stamp}-from-step-{step}-{attempt}"
    folder.mkdir(parents=True)
    if any(later):
        write_metrics(folder / METRICS_FILE, [r for r, out in zip(records, later) if out])
        write_metrics(metrics, [r for r, out in zip(records, later) if not out])
    for checkpoint in checkpoints:
        checkpoint.rename(folder / checkpoint.name)
    return folder


def later_checkpoints(output_dir: str | Path, step: int) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir`` with N after ``step``, in step order (other names left out)."""
    numbered = [(c, c.name.rsplit("-", 1)[-1]) for c in Path(output_dir).glob("checkpoint-*") if c.is_dir()]
    return [c for c, n in sorted((c, int(n)) for c, n in numbered if n.isdigit() and int(n) > step)]


def save_interrupted(trainer) -> None:
    """On Ctrl-C, save a checkpoint of the last finished step so that the run can resume (one process only)."""
    step, output_dir = trainer.state.global_step, Path(trainer.args.output_dir)
    if trainer.accelerator.num_processes != 1 or step == 0 or (output_dir / f"checkpoint-{step}").is_dir():
        return
    print(
        f"\nInterrupted: saving a checkpoint of step {step} (Ctrl-C again to skip it)...", file=sys.stderr, flush=True
    )
    try:
        reason = trainer.save_interrupt_checkpoint()
        if reason is not None:
            print(f"Checkpoint not saved: {reason}.", file=sys.stderr, flush=True)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - a failed save must not hide the interruption
        shutil.rmtree(output_dir / f"checkpoint-{step}", ignore_errors=True)
        print(f"Checkpoint not saved ({type(error).__name__}).", file=sys.stderr, flush=True)


def _command_line(argv: Sequence[str], drop: Sequence[str] = (), add: Sequence[str] = ()) -> str:
    """``egpo-trl train ...`` for ``argv``, without the flags in ``drop`` (and their values), then ``add``."""
    args, index, argv = [], 0, list(argv)
    while index < len(argv):
        item = argv[index]
        if item.startswith("--") and item[2:].split("=", 1)[0] in drop:
            index += 1 if "=" in item else 2
            continue
        args.append(item)
        index += 1
    if args[:1] == ["--config"] and len(args) > 1:
        args = args[1:]
    return shlex.join(["egpo-trl", "train", *args, *add])


def interrupted_message(argv: Sequence[str], training_args) -> str:
    """What to run after Ctrl-C: the resume command when a checkpoint exists, else the command to start again."""
    from transformers.trainer_utils import get_last_checkpoint

    output_dir = str(training_args.output_dir)
    checkpoint = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    if checkpoint is None:
        return f"Interrupted before any checkpoint was saved; nothing to resume. Start again with:\n  {_command_line(argv)}"
    state = Path(checkpoint) / "trainer_state.json"
    state = json.loads(state.read_text()) if state.is_file() else {}
    if 0 < state.get("max_steps", 0) <= state.get("global_step", 0):  # stopped after the last step: nothing to resume
        missing = missing_final_outputs(output_dir, state["global_step"])
        return f"Interrupted after the last step: {checkpoint} holds the trained weights" + (
            f", but {output_dir} lacks {missing} (load the weights from the checkpoint)." if missing else "."
        )
    drop = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir")
    command = _command_line(argv, drop=drop, add=("--output_dir", output_dir, "--resume_from_checkpoint", "true"))
    return f"Interrupted; the last checkpoint is {checkpoint}. Resume the run with:\n  {command}"
