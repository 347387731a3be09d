"""Stopping and resuming a run: the checkpoint saved on Ctrl-C, the command that resumes, and ``metrics.jsonl``
cut back to the checkpoint a run resumes from.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from egpo_trl.script.outputs import read_metrics

__all__ = ["checkpoint_step", "interrupted_message", "resume_checkpoint", "save_interrupted", "truncate_metrics"]


def resume_checkpoint(training_args) -> str | None:
    """The checkpoint a run resumes from: ``resume_from_checkpoint`` with ``true``/``last``/``latest`` resolved to the
    last ``checkpoint-*`` in ``output_dir`` and ``false``/``none`` to ``None``; any other value unchanged.

    Raises:
        SystemExit: for ``true`` when ``output_dir`` holds no checkpoint.
    """
    from transformers.trainer_utils import get_last_checkpoint

    resume = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last", "latest"):
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            raise SystemExit(
                f"egpo-trl train: resume_from_checkpoint=true but {training_args.output_dir} has no checkpoint-* "
                "folder; give a checkpoint path or start a new run."
            )
    elif isinstance(resume, str) and resume.lower() in ("false", "none", ""):
        resume = None
    return resume


def checkpoint_step(checkpoint: str | Path) -> int:
    """The training step a ``checkpoint-*`` folder was saved at (its ``trainer_state.json``, else its name)."""
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    return int(Path(checkpoint).name.rsplit("-", 1)[-1])


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the records a resumed run will write again: training steps after ``step`` and the final evaluation.

    Resuming from ``checkpoint-N`` replays the steps after N, so without this ``metrics.jsonl`` would hold them
    twice (and the curves would run back in time). Returns the number of records dropped.
    """
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= step and r.get("heldout/stage") != "after"]
    if len(kept) != len(records):
        path.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))
    return len(records) - len(kept)


def save_interrupted(trainer) -> None:
    """On Ctrl-C, save a checkpoint of the last finished step so that the run can resume (one process only).

    The weights, optimizer and scheduler are those of the last finished optimizer step (a step cut short has not
    changed them). With several processes nothing is saved: the run resumes from its last regular checkpoint.
    """
    step = trainer.state.global_step
    output_dir = Path(trainer.args.output_dir)
    if trainer.accelerator.num_processes != 1 or step == 0 or (output_dir / f"checkpoint-{step}").is_dir():
        return
    print(
        f"\nInterrupted: saving a checkpoint of step {step} (Ctrl-C again to skip it)...", file=sys.stderr, flush=True
    )
    try:
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
