"""``egpo-trl train RECIPE.yaml [--FIELD VALUE ...] [--dry-run]``: train a policy with EGPO (or a baseline) from a
YAML recipe whose keys are the fields of ``TrainScriptArguments``, ``EGPOConfig`` and TRL's ``ModelConfig``."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

# Names other code imports from here, and the module each lives in (imported on first use: `--help` stays fast).
_EXPORTS = {
    "egpo_trl.script.args": ("TrainScriptArguments", "make_parser", "parse_args"),
    "egpo_trl.script.callbacks": ("MetricsCallback",),
    "egpo_trl.script.data": ("load_datasets",),
    "egpo_trl.script.outputs": ("METRICS_FILE", "PLOT_FILE", "prepare_output_dir", "read_metrics"),
    "egpo_trl.script.plots": ("metrics_figure",),
    "egpo_trl.script.resolve": ("resolve_model_path", "resolve_reward_funcs"),
}
__all__ = ["HELP", "main", *(name for names in _EXPORTS.values() for name in names)]


def __getattr__(name: str):
    for module, names in _EXPORTS.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Static so that `--help` imports nothing; tests check each flag and default against the parser.
HELP = r"""usage: egpo-trl train RECIPE.yaml [--dry-run] [--FIELD VALUE ...]

Train a policy with EGPO (or a baseline advantage estimator) from a YAML recipe. Every field is a YAML key
of the recipe or a --flag; flags override the recipe.

examples:
  egpo-trl train recipes/demo_tiny_cpu.yaml                    the CPU demo (what `make demo` runs)
  egpo-trl train recipes/demo_tiny_cpu.yaml --max_steps 20 --seed 1
  egpo-trl train recipes/egpo_qwen15b.yaml --dry-run           check a GPU recipe, print its launch
  egpo-trl train recipes/egpo_qwen15b.yaml                     run it (prints, then runs, accelerate launch)
  accelerate launch recipes/egpo_qwen15b.yaml                  the same, with accelerate's own options if given

arguments:
  RECIPE.yaml, --config RECIPE.yaml  the YAML recipe (see recipes/)
  --dry-run             check the recipe, print the resolved settings and the launch command; trains nothing
  -h, --help            this help
  --help-all            every field (TRL's GRPOConfig, TrainingArguments, ModelConfig, the egpo_* ones)

fields most runs change [default]:
  --model_name_or_path          a Hub id, a local folder, or builtin:tiny-math-qwen2
  --dataset_name [synthetic:arithmetic]  synthetic:<task>, a local path (save_to_disk folder or data file) or a Hub id
  --prompt_template             format string that builds each prompt from the dataset's columns
  --answer_column [answer]      column with the ground truth (the rewards receive it as 'answer')
  --reward_funcs [boxed_accuracy_reward]  reward functions by name or import path 'package.module:function'
  --output_dir                  metrics, plot, checkpoints and model; '{timestamp}' is replaced by the start time
  --max_steps [-1]              optimizer steps (overrides num_train_epochs)
  --num_train_epochs [3.0]      epochs over the training set
  --learning_rate [1e-06]       AdamW's learning rate
  --per_device_train_batch_size [8]  completions per process per micro-batch
  --gradient_accumulation_steps [1]  micro-batches per optimizer step
  --num_generations [8]         completions per prompt (the group)
  --max_completion_length [512] longest completion, in tokens
  --temperature [1.0]           sampling temperature
  --seed [42]                   random seed
  --advantage_estimator [egpo]  egpo, grpo, nsr, edge_grpo (or one registered in egpo_trl.advantages)
  --egpo_lambda_min [0.8]       lower clip bound of the EGPO entropy weight (paper Eq. 9)
  --egpo_lambda_max [2.0]       upper clip bound of the EGPO entropy weight (paper Eq. 9)
  --egpo_clamp [asymmetric]     asymmetric (paper), symmetric, negative_only, positive_only or none
  --egpo_nsr [True]             all-incorrect groups get base advantage -1 (paper Sec. 3.2)
  --eval_size [200]             held-out problems evaluated before and after training (0: none)
  --resume_from_checkpoint      true: the last checkpoint-* in output_dir; or a checkpoint path
  --overwrite_output_dir [False]  replace an earlier run's outputs in output_dir
  --use_cpu [False]             train on the CPU (with --bf16 false for float32)
  --bf16                        bf16 mixed precision, on unless false; with use_cpu it runs under the CPU's bf16 autocast

launch (`accelerate launch` options; a recipe key or a flag):
  --accelerate_config           accelerate config file, e.g. recipes/accelerate/zero2.yaml (none: this process)
  --num_processes               processes over all machines (default: the GPUs this machine sees)
  --num_machines                machines of the launch; run the same command on each
  --machine_rank                this machine's rank, 0 to num_machines - 1
  --main_process_ip             address of the machine of rank 0
  --main_process_port           rendezvous port (default 29500)

Every field, with its full help: egpo-trl train --help-all
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``egpo-trl train`` and ``python -m egpo_trl.train``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(HELP, end="")
        return 0
    if not argv:
        raise SystemExit("egpo-trl train: give a recipe, e.g. `egpo-trl train recipes/demo_tiny_cpu.yaml` (the CPU "
                         "demo; recipes/ has the others), or see `egpo-trl train --help`.")  # fmt: skip
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from egpo_trl.launch import batch_summary, configure_tracking, dry_run, launch_if_requested, normalize_argv
    from egpo_trl.script.args import make_parser, parse_args

    if "--help-all" in argv:
        make_parser().print_help()
        return 0
    argv, is_dry_run = normalize_argv(argv)
    if is_dry_run:
        return dry_run(argv)
    if (returncode := launch_if_requested(argv)) is not None:
        return returncode
    from egpo_trl.script.outputs import remove_if_empty
    from egpo_trl.script.resume import interrupted_message
    from egpo_trl.script.run import run

    script_args, training_args, model_args = parse_args(argv)
    output_dir = Path(training_args.output_dir)
    created, main_process = not output_dir.exists(), os.environ.get("RANK", "0") == "0"
    if main_process:
        batch, differs = batch_summary(argv, training_args, training_args.world_size)
        print(f"Batch: {batch}." + (f" Note: {differs}" if differs else ""), flush=True)
    try:
        configure_tracking(training_args)
        run(script_args, training_args, model_args)
    except BaseException as error:
        if created:
            remove_if_empty(output_dir)  # what a run that failed early leaves
        if not isinstance(error, KeyboardInterrupt):
            raise
        if main_process:
            print(f"\n{interrupted_message(argv, training_args)}", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
