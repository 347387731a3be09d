"""The run's output folder: the files ``egpo-trl train`` writes there and the check that it holds no earlier run."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
HELDOUT_FILE = "heldout.json"
# What a resume set aside: the records and checkpoints of the steps after the checkpoint it resumed from.
REPLACED_DIR = "replaced"
# Files that mark a folder as holding the outputs of an earlier run.
RUN_FILES = (METRICS_FILE, HELDOUT_FILE, "trainer_state.json", "model.safetensors", "adapter_model.safetensors")


def prepare_output_dir(
    output_dir: str, overwrite: bool, resuming: bool, start_from: str | None = None
) -> Callable[[], None]:
    """Refuse a folder holding an earlier run, unless ``overwrite``; returns what clears it once the run has loaded."""
    path = Path(output_dir)
    if not path.is_dir() or resuming:
        return lambda: None
    checkpoints = sorted(p for p in path.glob("checkpoint-*") if p.is_dir())
    markers = [path / name for name in (*RUN_FILES, REPLACED_DIR) if (path / name).exists()]
    if not checkpoints and not markers:
        return lambda: None
    found = ", ".join(p.name for p in (checkpoints + markers)[:5])
    never_trained = not checkpoints and {m.name for m in markers} <= {METRICS_FILE, HELDOUT_FILE}
    try:  # what a start that failed before its first step left (a torn last line: a run that was killed)
        never_trained = never_trained and not any(
            "loss" in r or "reward" in r for r in read_metrics(path / METRICS_FILE)
        )
    except (OSError, ValueError):
        never_trained = False
    if not never_trained and overwrite and start_from and path.resolve() in Path(start_from).resolve().parents:
        raise SystemExit(
            f"egpo-trl train: the run starts from {start_from}, inside {path}, which --overwrite_output_dir would "
            "clear before it loads. Choose another --output_dir for the new run, or copy the checkpoint out first."
        )
    if not never_trained and not overwrite:
        if start_from is not None:
            raise SystemExit(
                f"egpo-trl train: {path} already holds another run ({found}), and {start_from} is not one of its "
                "checkpoints: a run started from it would write over that run. Choose a new --output_dir for it (a "
                "'{timestamp}' in it makes one per run), or replace the earlier run with --overwrite_output_dir true."
            )
        resume = "resume with --resume_from_checkpoint true, " if checkpoints else ""
        raise SystemExit(
            f"egpo-trl train: {path} already holds another run ({found}). Choose a new --output_dir (a "
            f"'{{timestamp}}' in it makes one per run), {resume}or replace it with --overwrite_output_dir true."
        )

    def clear() -> None:
        for folder in (*checkpoints, path / REPLACED_DIR):
            shutil.rmtree(folder, ignore_errors=True)  # every process of a launch may clear it
        for name in (*RUN_FILES, PLOT_FILE):
            (path / name).unlink(missing_ok=True)
        logger.warning("%s held an earlier run's outputs (%s): removed.", path, found)

    return clear


def refuse_output_dir_over_model(output_dir: str, model_name_or_path: str) -> None:
    """Refuse an ``output_dir`` that is the local model folder the run starts from (it would overwrite its weights)."""
    model = Path(str(model_name_or_path)).expanduser()
    if model.is_dir() and model.resolve() == Path(output_dir).expanduser().resolve():
        raise SystemExit(
            f"egpo-trl train: --output_dir {output_dir} is the model folder the run starts from "
            f"({model_name_or_path}): the run would write over the weights it loads. Choose another --output_dir (a "
            "'{timestamp}' in it makes one per run)."
        )


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_metrics(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Write ``records`` as the ``metrics.jsonl`` file ``path`` via a temporary file (a crash leaves the old one)."""
    temporary = Path(path).with_name(Path(path).name + ".tmp")
    temporary.write_text("".join(json.dumps(r, default=float) + "\n" for r in records))
    temporary.replace(path)


def remove_if_empty(path: Path) -> None:
    """Remove ``path`` when it holds no file at all (only empty folders): what a run that failed early leaves."""
    if path.is_dir() and not any(p.is_file() or p.is_symlink() for p in path.rglob("*")):
        shutil.rmtree(path, ignore_errors=True)
