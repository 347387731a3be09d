"""``egpo-trl train``: train a policy with EGPO (or a baseline estimator) from a YAML recipe.

Usage::

    egpo-trl train --config recipes/demo_tiny_cpu.yaml [--field value ...]
    egpo-trl train recipes/egpo_qwen15b.yaml            # a recipe naming accelerate_config: accelerate launch
    egpo-trl train recipes/egpo_qwen15b.yaml --dry-run  # check the recipe and print the launch command
    python -m egpo_trl.train --config recipes/demo_tiny_cpu.yaml
    accelerate launch --config_file recipes/accelerate/ddp.yaml -m egpo_trl.train --config <recipe>

The YAML keys are the fields of :class:`TrainScriptArguments` (model, dataset, prompt, rewards,
held-out evaluation), of :class:`~egpo_trl.EGPOConfig` (every ``GRPOConfig`` and ``TrainingArguments``
field plus the ``egpo_*`` ones) and of TRL's ``ModelConfig`` (dtype, attention, LoRA). Flags on the
command line override the file, as with TRL's own scripts. ``--help`` shows the usual ones, ``--help-all``
every field.

Ctrl-C saves a checkpoint of the last finished step (one process) and prints the command that resumes the run; the
resumed run continues exactly as the uninterrupted one would have (README, "Resuming").

A run prints the held-out accuracy before and after training and writes into ``output_dir``:

* ``metrics.jsonl``: one JSON object per logged step (TRL's metrics and the ``egpo/*`` ones) and one
  per held-out evaluation (``heldout/*`` keys),
* ``training_curves.png``: reward, accuracy, the entropy gap (incorrect minus correct) and the
  group-type fractions over the steps,
* ``heldout.json``: the held-out accuracies, overall and per level,
* the trained model and tokenizer (``save_final_model``),
* ``replaced/<time>-from-step-N/``, on a resume from ``checkpoint-N`` of a run that had gone further: the
  records and checkpoints of its later steps, which the resumed run trains again.

``output_dir`` may contain ``{timestamp}``, replaced by the start time (``20260101-120000``, the first process's for
every process of a launch), so that repeated runs of one recipe never write into each other's folder.

The run's first line gives the optimizer step's batch over all processes, and says when it differs from the recipe's
own (e.g. twice the processes: halve ``gradient_accumulation_steps`` to keep it).

This module is the command; the pieces live in :mod:`egpo_trl.script` (arguments, data, callbacks, plots,
output folder, the run) and :mod:`egpo_trl.launch` (``accelerate launch``, ``--dry-run``). The names below are
re-exported from there, so ``from egpo_trl.train import parse_args, read_metrics, ...`` keeps working.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from egpo_trl.launch import batch_summary, configure_tracking, dry_run, launch_if_requested, normalize_argv
from egpo_trl.script.args import TrainScriptArguments, batch_shape_problem, make_parser, parse_args
from egpo_trl.script.callbacks import CompactProgressCallback, MetricsCallback
from egpo_trl.script.data import SYNTHETIC_DATASET_PREFIX, column_problem, load_datasets
from egpo_trl.script.help import SHORT_HELP_FIELDS, short_help
from egpo_trl.script.outputs import (
    HELDOUT_FILE,
    METRICS_FILE,
    PLOT_FILE,
    prepare_output_dir,
    read_metrics,
    remove_if_empty,
)
from egpo_trl.script.plots import metrics_figure, plot_metrics
from egpo_trl.script.resolve import (
    BUILTIN_MODEL_PREFIX,
    check_model_exists,
    resolve_model_path,
    resolve_reward_funcs,
)
from egpo_trl.script.resume import interrupted_message
from egpo_trl.script.run import build_trainer, run

__all__ = [
    "BUILTIN_MODEL_PREFIX",
    "HELDOUT_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "SHORT_HELP_FIELDS",
    "SYNTHETIC_DATASET_PREFIX",
    "CompactProgressCallback",
    "MetricsCallback",
    "TrainScriptArguments",
    "batch_shape_problem",
    "build_trainer",
    "check_model_exists",
    "column_problem",
    "load_datasets",
    "main",
    "make_parser",
    "metrics_figure",
    "parse_args",
    "plot_metrics",
    "prepare_output_dir",
    "read_metrics",
    "resolve_model_path",
    "resolve_reward_funcs",
    "run",
    "short_help",
]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``egpo-trl train`` and ``python -m egpo_trl.train``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help-all" in argv:
        make_parser().print_help()
        return 0
    if "-h" in argv or "--help" in argv:
        print(short_help())
        return 0
    if not argv:
        raise SystemExit(
            "egpo-trl train: give a recipe, e.g. `egpo-trl train recipes/demo_tiny_cpu.yaml` (the CPU demo; recipes/ "
            "has the others), or see `egpo-trl train --help`."
        )
    argv, is_dry_run = normalize_argv(argv)
    if is_dry_run:
        return dry_run(argv)
    returncode = launch_if_requested(argv)
    if returncode is not None:
        return returncode
    script_args, training_args, model_args = parse_args(argv)
    output_dir = Path(training_args.output_dir)
    created = not output_dir.exists()
    main_process = os.environ.get("RANK", "0") == "0"
    if main_process:
        batch, differs = batch_summary(argv, training_args, training_args.world_size)
        print(f"Batch: {batch}." + (f" Note: {differs}" if differs else ""), flush=True)
    try:
        configure_tracking(training_args)
        run(script_args, training_args, model_args)
    except KeyboardInterrupt:
        if created:
            remove_if_empty(output_dir)
        if main_process:
            print(f"\n{interrupted_message(argv, training_args)}", file=sys.stderr, flush=True)
        return 130
    except BaseException:
        if created:
            remove_if_empty(output_dir)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
