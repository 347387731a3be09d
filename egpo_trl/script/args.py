"""The arguments of ``egpo-trl train``: :class:`TrainScriptArguments`, TRL's ``ModelConfig`` and the ``TrlParser`` over
them and :class:`~egpo_trl.EGPOConfig`, with one-line errors naming the fix."""

from __future__ import annotations

import difflib
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from egpo_trl.script.outputs import PLOT_FILE
from egpo_trl.script.recipe import MARKER_KEY, load_recipe


def _field(default: Any = None, help: str = "", default_factory: Any = MISSING) -> Any:
    return field(
        default=default if default_factory is MISSING else MISSING,
        default_factory=default_factory,
        metadata={"help": help},
    )


@dataclass
class TrainScriptArguments:
    """Recipe keys that are not training hyper-parameters: data, prompt, rewards, held-out check, launch."""

    dataset_name: str = _field(
        "synthetic:arithmetic",
        "What to train on: 'synthetic:<task>' (e.g. 'synthetic:arithmetic'), a local path (a Dataset.save_to_disk "
        "folder, a .json/.jsonl/.csv/.parquet file or a folder of them), or a Hugging Face Hub dataset.",
    )
    dataset_config: str | None = _field(None, "Configuration name of a Hub dataset (load_dataset(name, config)).")
    dataset_train_split: str = _field("train", "Split to train on.")
    dataset_test_split: str = _field(
        "test", "Split of the held-out problems; without it, eval_size problems are taken out of the training split."
    )
    synthetic_train_size: int = _field(2000, "Number of training problems generated for a synthetic task.")
    synthetic_levels: str = _field("1,2,3,4,5", "Difficulty levels of a synthetic task, comma-separated.")
    synthetic_seed: int = _field(0, "Seed of the synthetic problem generator (the held-out split never overlaps).")
    prompt_template: str | None = _field(
        None,
        "Python format string that builds each prompt from the dataset's columns, e.g. '{problem} Put the final "
        "answer in \\boxed{{}}.' (literal braces doubled). Without it the 'prompt' column is used as is.",
    )
    system_prompt: str | None = _field(None, "System message put before every conversational prompt.")
    answer_column: str = _field("answer", "Column with the ground truth; the reward functions receive it as 'answer'.")
    reward_funcs: list[str] = _field(
        help="Reward functions, by name (boxed_accuracy_reward: +1/-1 on the last \\boxed{}, paper Eq. 1; "
        "think_format_reward) or import path 'package.module:function' (the current folder is searched first). "
        "With several, egpo_correctness_reward names the one that decides correctness.",
        default_factory=lambda: ["boxed_accuracy_reward"],
    )
    eval_size: int = _field(
        200,
        "Held-out problems evaluated before and after training (0: none). The evaluation has its own seed and "
        "leaves the training run unchanged.",
    )
    eval_num_samples: int = _field(4, "Completions sampled per held-out problem; accuracy is their mean.")
    eval_temperature: float | None = _field(
        None, "Sampling temperature of the held-out evaluation (0: greedy; default: the training temperature)."
    )
    eval_batch_size: int = _field(128, "Prompts per generate call in the held-out evaluation.")
    overwrite_output_dir: bool = _field(
        False,
        "Replace an earlier run's outputs in output_dir; without it such an output_dir is refused unless the run "
        "resumes from a checkpoint.",
    )
    torch_num_threads: int | None = _field(None, "torch.set_num_threads for CPU work (unset or 0: torch's default).")
    save_final_model: bool = _field(True, "Save the trained model and tokenizer into output_dir at the end.")
    plot: bool = _field(True, f"Draw {PLOT_FILE} in output_dir at the end of training.")
    accelerate_config: str | None = _field(
        None,
        "Accelerate config file (e.g. recipes/accelerate/zero2.yaml). When set, `egpo-trl train <recipe>` prints "
        "and runs `accelerate launch --config_file <it> ... -m egpo_trl.train --config <recipe>`. Ignored inside "
        "a launch.",
    )
    num_processes: int | None = _field(
        None, "Processes of that launch, over all machines (default: the GPUs this machine sees x num_machines)."
    )
    main_process_port: int | None = _field(
        None, "Rendezvous port of that launch (default 29500); give each launch sharing a machine its own."
    )
    num_machines: int | None = _field(
        None, "Machines of that launch (default 1); run the same command on each, with its own --machine_rank."
    )
    machine_rank: int | None = _field(None, "This machine's rank in that launch, 0 to num_machines - 1.")
    main_process_ip: str | None = _field(None, "Address of the machine of rank 0, which every machine reaches.")
    max_prompt_length: int | None = _field(
        None, "Longest prompt, in tokens; only --dry-run uses it, to check the prompt and completion fit the model."
    )


def make_parser():
    """The ``TrlParser`` over the three dataclasses; no argparse abbreviations, so a typo is an error."""
    from trl import ModelConfig, TrlParser

    from egpo_trl.config import EGPOConfig

    class _TrainParser(TrlParser):
        def set_defaults_with_config(self, **kwargs) -> list[str]:
            kwargs.pop(MARKER_KEY, None)  # the line that lets Python run a recipe, not a field
            return super().set_defaults_with_config(**kwargs)

        def error(self, message: str):  # argparse's error prints the whole (very long) usage first
            raise SystemExit(f"egpo-trl train: {message}. Run `egpo-trl train --help-all` for the list of fields.")

    parser = _TrainParser(
        (TrainScriptArguments, EGPOConfig, ModelConfig),
        prog="egpo-trl train",
        usage="egpo-trl train RECIPE.yaml [--dry-run] [--FIELD VALUE ...]",
        description="Train a policy with EGPO (or a baseline advantage estimator) from a YAML recipe. Fields are "
        "YAML keys or --flags; flags override the file.",
        allow_abbrev=False,
    )
    for action in parser._actions:
        if action.dest == "model_name_or_path":
            action.help = "Model to train: a Hub id, a local folder, or 'builtin:tiny-math-qwen2' (shipped)."
    parser._negative_number_matcher = re.compile(r"-\.?\d")  # `--learning_rate -1e-4` is a value, as in Python 3.13
    return parser


def _known_fields(parser) -> list[str]:
    return sorted({action.dest for action in parser._actions if action.dest not in ("help", None)})


def _unknown_field_error(parser, unknown: Sequence[str], where: str) -> SystemExit:
    names = [item[2:].split("=", 1)[0] for item in unknown if item.startswith("--")] or list(unknown)
    lines = []
    for name in names:
        close = difflib.get_close_matches(name, _known_fields(parser), n=3, cutoff=0.6)
        lines.append(f"  {name}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return SystemExit(
        f"egpo-trl train: unknown field(s) {where}:\n" + "\n".join(lines) + "\nRun `egpo-trl train --help-all` for "
        "the list of fields."
    )


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainScriptArguments, Any, Any]:
    """``(script_args, training_args, model_args)`` from ``--config recipe.yaml`` and the overrides after it, with
    ``{timestamp}`` in ``output_dir`` replaced (rank 0's time on every process); ``SystemExit`` in one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args):
            raise SystemExit(
                "egpo-trl train: --config needs a path to a YAML recipe, e.g. recipes/demo_tiny_cpu.yaml."
            )
        known = set(_known_fields(parser)) | {"env"}
        if unknown := [f"--{key}" for key in load_recipe(args[index + 1]) if key not in known]:
            raise _unknown_field_error(parser, unknown, f"in {Path(args[index + 1])}")
    try:
        script_args, training_args, model_args, _, from_cli = parser.parse_args_and_config(
            args, return_remaining_strings=True, separate_remaining_strings=True
        )  # the recipe's unknown keys are refused above
    except ValueError as error:
        if "divisible by num_generations" in str(error):  # input_checks.batch_shape_problem's line, as the API's
            raise SystemExit(f"egpo-trl train: {error}") from None
        hint = " On a machine without a GPU, set `use_cpu: true` and `bf16: false` (or pass --use_cpu --bf16 false)."
        hint = hint if "bf16" in str(error) or "use_cpu" in str(error) else ""
        raise SystemExit(f"egpo-trl train: invalid configuration: {error}{hint}") from error
    if from_cli:
        raise _unknown_field_error(parser, from_cli, "on the command line")
    if "{timestamp}" in str(training_args.output_dir):
        stamp = [time.strftime("%Y%m%d-%H%M%S")]
        state = getattr(training_args, "distributed_state", None)
        if state is not None and state.num_processes > 1:  # one folder for the launch: every process takes rank 0's
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(stamp)
        training_args.output_dir = str(training_args.output_dir).replace("{timestamp}", stamp[0])
    if model_args.model_name_or_path is None:
        raise SystemExit(
            "egpo-trl train: no model given; set model_name_or_path in the recipe or pass --model_name_or_path "
            "(a Hub id, a local folder, or builtin:tiny-math-qwen2)."
        )
    if script_args.torch_num_threads is not None and script_args.torch_num_threads < 0:
        raise SystemExit("egpo-trl train: torch_num_threads must be >= 0 (0 or unset keeps torch's default).")
    if script_args.eval_size < 0 or script_args.eval_num_samples < 1:
        raise SystemExit("egpo-trl train: eval_size must be >= 0 and eval_num_samples >= 1.")
    if isinstance(script_args.reward_funcs, str):  # a YAML scalar (TRL's parser keeps a recipe's value as written)
        raise SystemExit(f"egpo-trl train: reward_funcs must be a list, e.g. [{script_args.reward_funcs}].")
    # Reward functions that leave ambiguous which one decides correctness are refused before anything loads.
    from egpo_trl.correctness import correctness_reward_index, reward_func_names
    from egpo_trl.script.resolve import resolve_reward_funcs

    funcs = resolve_reward_funcs(script_args.reward_funcs)
    overlong = ["overlong_penalty"] if training_args.overlong_buffer_length is not None else []  # the trainer's own
    try:
        correctness_reward_index(funcs, training_args, names=reward_func_names(funcs) + overlong, quiet=True)
    except ValueError as error:
        raise SystemExit(f"egpo-trl train: {error}") from None
    return script_args, training_args, model_args


def option_value(argv: Sequence[str], name: str) -> str | None:
    """The last value of ``--name value`` / ``--name=value`` in ``argv`` (``None`` when absent)."""
    value = None
    for index, item in enumerate(argv):
        if item == f"--{name}" and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(f"--{name}="):
            value = item.split("=", 1)[1]
    return value
