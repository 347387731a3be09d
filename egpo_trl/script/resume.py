"""Stopping and resuming ``egpo-trl train``: Ctrl-C's checkpoint and resume command, later steps' records and
checkpoints set aside, the stored held-out evaluation and clock. The exact training state: :mod:`egpo_trl.resume_state`."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from egpo_trl.resume_state import finished_run_step
from egpo_trl.script.outputs import METRICS_FILE, REPLACED_DIR, read_metrics, write_metrics

__all__ = [
    "LAST_SAVED_FILE",
    "checkpoint_step",
    "discard_set_aside",
    "finished_message",
    "heldout_fingerprint",
    "interrupted_message",
    "later_checkpoints",
    "later_final_outputs",
    "missing_final_outputs",
    "put_back_later_history",
    "resume_checkpoint",
    "resumed_time",
    "resumes_own_run",
    "save_interrupted",
    "set_aside_later_history",
    "stored_heldout_after",
    "stored_heldout_before",
    "trainer_last_step",
]


def resume_checkpoint(training_args) -> str | None:
    """The checkpoint a run resumes from: ``resume_from_checkpoint`` with ``true``/``last``/``latest`` resolved to the
    last ``checkpoint-*`` in ``output_dir`` and ``false``/``none`` to ``None``; any other value unchanged."""
    from transformers.trainer_utils import get_last_checkpoint

    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last", "latest"):
        if not Path(training_args.output_dir).is_dir():
            raise SystemExit(
                f"egpo-trl train: resume_from_checkpoint=true but the folder {training_args.output_dir} does not "
                "exist. Give the earlier run's folder with --output_dir (a '{timestamp}' in a recipe's output_dir "
                "names a new folder on every run), or a checkpoint path."
            )
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            raise SystemExit(
                f"egpo-trl train: resume_from_checkpoint=true but {training_args.output_dir} has no checkpoint-* "
                "folder (a run saves them with --save_strategy steps or epoch); give a checkpoint path or start a "
                "new run, e.g. from its saved model with --model_name_or_path and a new --output_dir."
            )
    elif isinstance(resume, str) and resume.lower() in ("false", "none", ""):
        resume = None
    if isinstance(resume, (str, Path)) and not Path(resume).is_dir():
        raise SystemExit(
            f"egpo-trl train: resume_from_checkpoint={resume} is not a folder (a checkpoint removed by "
            "save_total_limit, or a typo?); give an existing checkpoint-* folder, or true for the last one in "
            "output_dir."
        )
    return resume


def resumes_own_run(checkpoint: str | Path | None, output_dir: str | Path) -> bool:
    """Whether resuming from ``checkpoint`` continues the run in ``output_dir``: the checkpoint is one of that
    folder's own ``checkpoint-<step>`` folders, directly inside it (both paths resolved; ``resume_from_checkpoint=
    true`` names the folder's own latest one)."""
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


def finished_message(training_args, checkpoint: str | Path, last_step: int | None = None) -> str | None:
    """Why resuming from ``checkpoint`` would train nothing (the run it belongs to has finished), or ``None``."""
    if last_step is None:
        finished = finished_run_step(training_args, checkpoint)
        if finished is None:
            return None
        step, total, setting = finished
    else:
        step, total = checkpoint_step(checkpoint), last_step
        if step < total:
            return None
        setting = f"num_train_epochs={training_args.num_train_epochs:g} over this run's data and batch sizes"
    fix = "--max_steps" if training_args.max_steps > 0 else "--num_train_epochs, or set --max_steps,"
    return (
        f"egpo-trl train: nothing to train: {checkpoint} is at step {step} and the run stops at step {total} "
        f"({setting}); the outputs in {training_args.output_dir} are left as they are (raise {fix} to train "
        "further)."
    )


def trainer_last_step(trainer) -> int | None:
    """The step a run sized by ``num_train_epochs`` stops at, counted as ``Trainer.train`` will count it (its own
    training dataloader and ``set_initial_training_values``: this run's data, batch sizes and processes), before
    anything is trained or written."""
    from transformers.trainer_utils import has_length

    args = trainer.args
    if args.max_steps > 0:
        return int(args.max_steps)
    if getattr(args, "auto_find_batch_size", False):
        return None
    dataloader = trainer.get_train_dataloader()
    if not has_length(dataloader):
        return None
    return int(trainer.set_initial_training_values(args, dataloader)[-1])


def later_final_outputs(output_dir: str | Path, step: int) -> str | None:
    """The final outputs in ``output_dir`` of a run that finished after ``step`` (its trained model, dated by the
    ``trainer_state.json`` beside it, its held-out evaluation after training, or the end-of-training record that
    Trainer logs to ``metrics.jsonl`` when a run finishes), or ``None``: what a run that ends at ``step`` in that
    folder would replace."""
    from egpo_trl.script.outputs import HELDOUT_FILE, METRICS_FILE

    output_dir = Path(output_dir)
    later = []
    saved = _saved_step(output_dir / FINAL_STATE_FILE)
    if saved is not None and saved > step:
        later.append(f"the trained model of step {saved}")
    heldout = output_dir / HELDOUT_FILE
    if heldout.is_file():
        after = (json.loads(heldout.read_text()).get("after") or {}).get("step")
        if isinstance(after, int) and after > step:
            later.append(f"the held-out evaluation after training at step {after}")
    metrics = output_dir / METRICS_FILE
    if metrics.is_file():
        ends = [r["step"] for r in read_metrics(metrics) if "train_runtime" in r and isinstance(r.get("step"), int)]
        if ends and max(ends) > step:
            later.append(f"the end-of-training record of step {max(ends)} in {METRICS_FILE}")
    return " and ".join(later) or None


#: The weight files ``save_model`` writes (one of them), and the file it writes last.
_MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
LAST_SAVED_FILE = "training_args.bin"


def missing_final_outputs(
    output_dir: str | Path, save_final_model: bool, heldout: bool, step: int | None = None
) -> list[str]:
    """The outputs a finished run writes after its last step that ``output_dir`` lacks (empty when none is missing)."""
    from egpo_trl.script.outputs import HELDOUT_FILE

    output_dir = Path(output_dir)
    missing = []
    model_saved = (
        any((output_dir / name).is_file() for name in _MODEL_FILES) and (output_dir / LAST_SAVED_FILE).is_file()
    )
    if save_final_model and not (model_saved and _saved_step(output_dir / FINAL_STATE_FILE) in (None, step)):
        missing.append("the trained model")
    if heldout and (output_dir / HELDOUT_FILE).is_file():
        records = json.loads((output_dir / HELDOUT_FILE).read_text())
        after = records.get("after")
        if records.get("before") and (not after or (step is not None and after.get("step", step) != step)):
            missing.append("the held-out evaluation after training")
    return missing


#: Written into output_dir after the final model (``Trainer.save_state``): its ``global_step`` dates that model.
FINAL_STATE_FILE = "trainer_state.json"


def _saved_step(path: Path) -> int | None:
    """``global_step`` of a ``trainer_state.json`` (``None`` when there is none: a run from before it was written)."""
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text())["global_step"])
    except (ValueError, KeyError, TypeError):
        return -1  # unreadable: the model it dates cannot be trusted to be the last step's


def stored_heldout_after(output_dir: str | Path, settings: dict) -> dict | None:
    """The held-out evaluation after training stored in ``output_dir``'s ``heldout.json``, when it was made with
    the same ``settings`` (as :func:`stored_heldout_before`; a ``step`` among them must match too); else ``None``."""
    return _stored_heldout(output_dir, "after", settings)


def heldout_fingerprint(heldout) -> str:
    """A SHA-256 of the held-out problems (each row's ``prompt`` and ``answer``, in order)."""
    import hashlib

    digest = hashlib.sha256()
    for prompt, answer in zip(heldout["prompt"], heldout["answer"], strict=True):
        digest.update(json.dumps([prompt, answer], sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def stored_heldout_before(output_dir: str | Path, settings: dict) -> dict | None:
    """The held-out evaluation before training that a run stored in ``output_dir``'s ``heldout.json``, when it was
    made with the same ``settings`` (every key must hold the same value in the stored record: the problems'
    fingerprint, the model, the number of problems and samples, the sampling settings); else ``None``."""
    return _stored_heldout(output_dir, "before", settings)


def _stored_heldout(output_dir: str | Path, stage: str, settings: dict) -> dict | None:
    from egpo_trl.script.outputs import HELDOUT_FILE

    heldout = Path(output_dir) / HELDOUT_FILE
    if not heldout.is_file():
        return None
    record = json.loads(heldout.read_text()).get(stage)
    if record and all(record.get(key) == value for key, value in settings.items()):
        return record
    return None


def resumed_time(path: Path, step: int) -> float:
    """The ``time_s`` of the last training record at or before ``step`` in ``metrics.jsonl`` (0 when none)."""
    if not path.is_file():
        return 0.0
    times = [r["time_s"] for r in read_metrics(path) if "time_s" in r and r.get("step", 0) <= step]
    return float(times[-1]) if times else 0.0


def set_aside_later_history(output_dir: str | Path, step: int) -> Path | None:
    """Move what ``output_dir`` holds of the steps after ``step`` out of the way of a run resumed from that step."""
    output_dir = Path(output_dir)
    metrics = output_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.is_file() else []
    replayed = [r.get("step", 0) > step or r.get("heldout/stage") == "after" for r in records]
    cut = [r for r, out in zip(records, replayed, strict=True) if out]
    later = later_checkpoints(output_dir, step)
    if not cut and not later:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = output_dir / REPLACED_DIR / f"{stamp}-from-step-{step}"
    attempt = 1
    while folder.exists():
        attempt += 1
        folder = output_dir / REPLACED_DIR / f"{stamp}-from-step-{step}-{attempt}"
    folder.mkdir(parents=True)
    if cut:
        write_metrics(folder / METRICS_FILE, cut)
        write_metrics(metrics, [r for r, out in zip(records, replayed, strict=True) if not out])
    for checkpoint in later:
        checkpoint.rename(folder / checkpoint.name)
    return folder


def put_back_later_history(output_dir: str | Path, folder: Path, keep_records: bool = False) -> None:
    """Undo :func:`set_aside_later_history` for a resume that trained nothing: its checkpoints go back (where no
    checkpoint of that name has been made since), and ``folder`` goes once it holds nothing else."""
    output_dir = Path(output_dir)
    for checkpoint in sorted(folder.glob("checkpoint-*")):
        if not (output_dir / checkpoint.name).exists():
            checkpoint.rename(output_dir / checkpoint.name)
    if not keep_records:
        discard_set_aside(folder)


def discard_set_aside(folder: Path) -> None:
    """Remove the records :func:`set_aside_later_history` copied into ``folder`` (the caller has them back in
    ``metrics.jsonl``), then ``folder`` and ``replaced/`` when nothing else is left in them."""
    (folder / METRICS_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # replaced/, when nothing else is in it


def later_checkpoints(output_dir: str | Path, step: int) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir`` with N after ``step``, in step order (other names left out)."""
    numbered = [(c, c.name.rsplit("-", 1)[-1]) for c in Path(output_dir).glob("checkpoint-*") if c.is_dir()]
    return [c for c, n in sorted((c, int(n)) for c, n in numbered if n.isdigit() and int(n) > step)]


def save_interrupted(trainer) -> None:
    """On Ctrl-C, save a checkpoint of the last finished step so that the run can resume (one process only)."""
    step = trainer.state.global_step
    output_dir = Path(trainer.args.output_dir)
    if trainer.accelerator.num_processes != 1 or step == 0 or (output_dir / f"checkpoint-{step}").is_dir():
        return
    print(
        f"\nInterrupted: saving a checkpoint of step {step} (Ctrl-C again to skip it)...", file=sys.stderr, flush=True
    )
    try:
        if hasattr(trainer, "save_interrupt_checkpoint"):
            reason = trainer.save_interrupt_checkpoint()
            if reason is not None:
                print(f"Checkpoint not saved: {reason}.", file=sys.stderr, flush=True)
        else:
            trainer._save_checkpoint(trainer.model, trial=None)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - a failed save must not hide the interruption
        shutil.rmtree(output_dir / f"checkpoint-{step}", ignore_errors=True)
        print(f"Checkpoint not saved ({type(error).__name__}).", file=sys.stderr, flush=True)


def _command_line(argv: Sequence[str], drop: Sequence[str] = (), add: Sequence[str] = ()) -> str:
    """``egpo-trl train ...`` for ``argv``, without the flags in ``drop`` (and their values), then ``add``."""
    import shlex

    args, index = [], 0
    argv = list(argv)
    while index < len(argv):
        item = argv[index]
        name = item[2:].split("=", 1)[0] if item.startswith("--") else None
        if name in drop:
            index += 1 if "=" in item else 2
            continue
        args.append(item)
        index += 1
    if args[:1] == ["--config"] and len(args) > 1:
        args = args[1:]
    return " ".join(shlex.quote(part) for part in ["egpo-trl", "train", *args, *add])


def interrupted_message(argv: Sequence[str], training_args) -> str:
    """What to run after Ctrl-C: the resume command when a checkpoint exists, else the command to start again."""
    from transformers.trainer_utils import get_last_checkpoint

    output_dir = str(training_args.output_dir)
    checkpoint = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    if checkpoint is None:
        again = _command_line(argv)
        return f"Interrupted before any checkpoint was saved; nothing to resume. Start again with:\n  {again}"
    command = _command_line(
        argv,
        drop=("output_dir", "resume_from_checkpoint", "overwrite_output_dir"),
        add=("--output_dir", output_dir, "--resume_from_checkpoint", "true"),
    )
    return f"Interrupted; the last checkpoint is {checkpoint}. Resume the run with:\n  {command}"
