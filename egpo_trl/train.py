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

Ctrl-C saves a checkpoint of the last finished step (one process) and prints the command that resumes the run.

A run prints the held-out accuracy before and after training and writes into ``output_dir``:

* ``metrics.jsonl``: one JSON object per logged step (TRL's metrics and the ``egpo/*`` ones) and one
  per held-out evaluation (``heldout/*`` keys),
* ``training_curves.png``: reward, accuracy, the entropy gap (incorrect minus correct) and the
  group-type fractions over the steps,
* ``heldout.json``: the held-out accuracies, overall and per level,
* the trained model and tokenizer (``save_final_model``).

``output_dir`` may contain ``{timestamp}``, replaced by the start time (``20260101-120000``), so that
repeated runs of one recipe never write into each other's folder.
"""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_MODEL_PREFIX",
    "SYNTHETIC_DATASET_PREFIX",
    "MetricsCallback",
    "TrainScriptArguments",
    "build_trainer",
    "load_datasets",
    "main",
    "make_parser",
    "parse_args",
    "plot_metrics",
    "prepare_output_dir",
    "resolve_model_path",
    "resolve_reward_funcs",
    "run",
]

BUILTIN_MODEL_PREFIX = "builtin:"
SYNTHETIC_DATASET_PREFIX = "synthetic:"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curves.png"
HELDOUT_FILE = "heldout.json"
# Reward functions whose values are +1 (correct) / -1 (incorrect): accuracy = (mean + 1) / 2.
_PLUS_MINUS_ONE = ("boxed_accuracy_reward",)
# Files that mark a folder as holding the outputs of an earlier run.
_RUN_MARKERS = (METRICS_FILE, HELDOUT_FILE, "trainer_state.json", "model.safetensors", "adapter_model.safetensors")


@dataclass
class TrainScriptArguments:
    """Arguments of ``egpo-trl train`` that are not training hyper-parameters: data, prompt, rewards, held-out check.

    Every field is a YAML key of a recipe and a ``--flag``; its ``help`` (shown by ``--help``) is the
    reference. The main ones:

    Parameters:
        dataset_name (`str`, *optional*, defaults to ``"synthetic:arithmetic"``):
            ``synthetic:<task>`` for a built-in synthetic task, a local path, or a Hub dataset name.
        prompt_template (`str`, *optional*):
            Format string that rebuilds each prompt from the dataset's columns; otherwise the ``prompt``
            column is used as is.
        reward_funcs (`list[str]`, *optional*, defaults to ``["boxed_accuracy_reward"]``):
            Reward functions by name (``boxed_accuracy_reward``, ``think_format_reward``) or import path.
        eval_size (`int`, *optional*, defaults to ``200``):
            Held-out problems evaluated before and after training; the held-out set never overlaps the
            training set.
        overwrite_output_dir (`bool`, *optional*, defaults to ``False``):
            Allow replacing an earlier run's outputs in ``output_dir``.
    """

    dataset_name: str = field(
        default="synthetic:arithmetic",
        metadata={
            "help": "What to train on: 'synthetic:<task>' for a built-in synthetic task ('synthetic:arithmetic'), a "
            "local path (a Dataset.save_to_disk folder, a .json/.jsonl/.csv/.parquet file or a folder of them), or a "
            "dataset name on the Hugging Face Hub."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name of a Hub dataset (load_dataset(name, config))."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "Split the held-out problems come from. When the dataset has no such split, eval_size problems "
            "are held out of the training split (and removed from it)."
        },
    )
    synthetic_train_size: int = field(
        default=2000, metadata={"help": "Number of training problems generated for a synthetic task."}
    )
    synthetic_levels: str = field(
        default="1,2,3,4,5", metadata={"help": "Difficulty levels of a synthetic task, comma-separated."}
    )
    synthetic_seed: int = field(
        default=0,
        metadata={
            "help": "Seed of the synthetic problem generator. The held-out split never overlaps the training split, "
            "whatever the seed."
        },
    )
    prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "Python format string that rebuilds each prompt from the dataset's columns, e.g. '{problem} Put "
            "the final answer in \\boxed{{}}.' (double the braces of literal ones). Without it the 'prompt' column is "
            "used as is."
        },
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "System message put before every conversational prompt."}
    )
    answer_column: str = field(
        default="answer",
        metadata={"help": "Column with the ground truth; the reward functions receive it as 'answer'."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed_accuracy_reward"],
        metadata={
            "help": "Reward functions, by name (boxed_accuracy_reward: +1/-1 on the last \\boxed{}, paper Eq. 1; "
            "think_format_reward) or import path 'package.module:function'. The first one decides correctness "
            "unless egpo_correctness_reward names another."
        },
    )
    eval_size: int = field(
        default=200,
        metadata={"help": "Held-out problems evaluated before and after training (0 skips the evaluation)."},
    )
    eval_num_samples: int = field(
        default=4, metadata={"help": "Completions sampled per held-out problem; accuracy is their mean."}
    )
    eval_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Sampling temperature of the held-out evaluation (0 for greedy). Defaults to the training "
            "'temperature', so the numbers measure the policy that training samples from."
        },
    )
    eval_batch_size: int = field(
        default=128, metadata={"help": "Prompts per generate call in the held-out evaluation."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the outputs of an earlier run in output_dir (its checkpoints, metrics and model). "
            "Without it, a run refuses an output_dir that holds them, unless it resumes from a checkpoint."
        },
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "Threads torch uses for CPU work (torch.set_num_threads). Unset or 0 keeps torch's default (one "
            "per core). On a small CPU model 1 is about as fast and does not slow to a crawl when other programs "
            "compete for the cores."
        },
    )
    save_final_model: bool = field(
        default=True, metadata={"help": "Save the trained model and tokenizer into output_dir at the end."}
    )
    plot: bool = field(default=True, metadata={"help": f"Draw {PLOT_FILE} in output_dir at the end of training."})
    accelerate_config: str | None = field(
        default=None,
        metadata={
            "help": "Accelerate config file (e.g. recipes/accelerate/zero2.yaml). When set, `egpo-trl train <recipe>` "
            "runs `accelerate launch --config_file <it> --num_processes <num_processes> -m egpo_trl.train --config "
            "<recipe>` (and prints that command) instead of training in its own process. Ignored inside a launch."
        },
    )
    num_processes: int | None = field(
        default=None,
        metadata={
            "help": "Processes (GPUs) of that launch. Defaults to the GPUs this machine sees, else the accelerate "
            "config's num_processes."
        },
    )
    main_process_port: int | None = field(
        default=None,
        metadata={
            "help": "Port of that launch's rendezvous (accelerate's --main_process_port; default 29500). Give each of "
            "several launches on one machine its own, e.g. two 4-GPU runs on an 8-GPU node."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest prompt of the dataset, in tokens (prompts are not truncated). Only used by --dry-run to "
            "check that max_prompt_length + max_completion_length fits the model's context; the OpenR1-Stable-10k "
            "builder drops prompts over 1024 tokens."
        },
    )


def _model_config_class():
    from trl import ModelConfig

    @dataclass
    class EGPOModelConfig(ModelConfig):
        """TRL's ``ModelConfig`` whose ``model_name_or_path`` also accepts the shipped models (``builtin:<name>``)."""

        model_name_or_path: str | None = field(
            default=None,
            metadata={
                "help": "Model to train: a Hub id, a local folder, or 'builtin:tiny-math-qwen2' for the tiny math "
                "model shipped with egpo_trl."
            },
        )

    EGPOModelConfig.__name__ = "ModelConfig"
    return EGPOModelConfig


def make_parser():
    """The ``TrlParser`` over :class:`TrainScriptArguments`, :class:`~egpo_trl.EGPOConfig` and ``ModelConfig``.

    Flags must be spelled out (no argparse abbreviations), so that a typo is reported instead of being
    matched to a similar field.
    """
    from trl import TrlParser

    from egpo_trl.config import EGPOConfig

    class _TrainParser(TrlParser):
        def error(self, message: str):  # argparse's error prints the whole (very long) usage first
            raise SystemExit(f"egpo-trl train: {message}. Run `egpo-trl train --help-all` for the list of fields.")

    return _TrainParser(
        (TrainScriptArguments, EGPOConfig, _model_config_class()),
        prog="egpo-trl train",
        usage="egpo-trl train RECIPE.yaml [--dry-run] [--FIELD VALUE ...]",
        description="Train a policy with EGPO (or a baseline advantage estimator) from a YAML recipe. Fields are "
        "YAML keys or --flags; flags override the file.",
        epilog="Example: egpo-trl train --config recipes/demo_tiny_cpu.yaml --seed 1 --max_steps 20",
        allow_abbrev=False,
    )


def _known_fields(parser) -> list[str]:
    return sorted({action.dest for action in parser._actions if action.dest not in ("help", None)})


def _unknown_field_error(parser, unknown: Sequence[str], where: str) -> SystemExit:
    names = [item[2:].split("=", 1)[0] for item in unknown if item.startswith("--")] or list(unknown)
    known = _known_fields(parser)
    lines = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        lines.append(f"  {name}{hint}")
    return SystemExit(
        f"egpo-trl train: unknown field(s) {where}:\n" + "\n".join(lines) + "\nRun `egpo-trl train --help-all` for "
        "the list of fields."
    )


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainScriptArguments, Any, Any]:
    """Parse ``--config recipe.yaml`` and command-line overrides into the three argument dataclasses.

    Returns:
        ``(script_args, training_args, model_args)``: a :class:`TrainScriptArguments`, an
        :class:`~egpo_trl.EGPOConfig` and a ``ModelConfig``, with ``{timestamp}`` in ``output_dir``
        already replaced.

    Raises:
        SystemExit: with a message naming the fix, for a missing config file, an unknown field (with
            close matches) or a value a config class rejects.
    """
    import yaml

    args = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    if "--config" in args:
        index = args.index("--config")
        if index + 1 >= len(args):
            raise SystemExit(
                "egpo-trl train: --config needs a path to a YAML recipe, e.g. recipes/demo_tiny_cpu.yaml."
            )
        config_path = Path(args[index + 1])
        if not config_path.is_file():
            raise SystemExit(f"egpo-trl train: the recipe {config_path} does not exist; check the path.")
        try:
            recipe = yaml.safe_load(config_path.read_text())
        except yaml.YAMLError as error:
            raise SystemExit(f"egpo-trl train: {config_path} is not valid YAML: {error}") from error
        if not isinstance(recipe, dict):
            raise SystemExit(f"egpo-trl train: {config_path} must be a YAML mapping of field: value.")
        known = set(_known_fields(parser)) | {"env"}
        unknown = [f"--{key}" for key in recipe if key not in known]
        if unknown:
            raise _unknown_field_error(parser, unknown, f"in {config_path}")
    try:
        script_args, training_args, model_args, from_file, from_cli = parser.parse_args_and_config(
            args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except ValueError as error:
        if "generation_batch_size" in str(error):
            problem = _batch_problem_from_argv(args)
            if problem:
                raise SystemExit(f"egpo-trl train: {problem}") from None
        hint = ""
        if "bf16" in str(error) or "use_cpu" in str(error):
            hint = (
                " On a machine without a GPU, set `use_cpu: true` and `bf16: false` (or pass --use_cpu --bf16 false)."
            )
        raise SystemExit(f"egpo-trl train: invalid configuration: {error}{hint}") from error
    if from_file:
        raise _unknown_field_error(parser, from_file, "in the config file")
    if from_cli:
        raise _unknown_field_error(parser, from_cli, "on the command line")
    if "{timestamp}" in str(training_args.output_dir):
        training_args.output_dir = str(training_args.output_dir).replace("{timestamp}", time.strftime("%Y%m%d-%H%M%S"))
    if model_args.model_name_or_path is None:
        raise SystemExit(
            "egpo-trl train: no model given; set model_name_or_path in the recipe or pass --model_name_or_path "
            "(a Hub id, a local folder, or builtin:tiny-math-qwen2)."
        )
    if script_args.torch_num_threads is not None and script_args.torch_num_threads < 0:
        raise SystemExit("egpo-trl train: torch_num_threads must be >= 0 (0 or unset keeps torch's default).")
    if script_args.eval_size < 0 or script_args.eval_num_samples < 1:
        raise SystemExit("egpo-trl train: eval_size must be >= 0 and eval_num_samples >= 1.")
    return script_args, training_args, model_args


def batch_shape_problem(
    per_device_train_batch_size: int,
    processes: int,
    gradient_accumulation_steps: int,
    num_generations: int,
    steps_per_generation: int | None = None,
    generation_batch_size: int | None = None,
) -> str | None:
    """What is wrong with a batch that cannot be cut into groups of ``num_generations``, in the fields users set.

    TRL checks ``generation_batch_size`` (per_device_train_batch_size x processes x steps_per_generation, where
    steps_per_generation defaults to gradient_accumulation_steps); this names those fields instead and suggests a
    per_device_train_batch_size that works. ``None`` when the batch is fine.
    """
    steps_name, steps = "gradient_accumulation_steps", gradient_accumulation_steps
    if steps_per_generation:
        steps_name, steps = "steps_per_generation", steps_per_generation
    if generation_batch_size:
        if generation_batch_size % num_generations == 0:
            return None
        return (
            f"generation_batch_size={generation_batch_size} is not a multiple of num_generations={num_generations}; "
            "set it to a multiple (or leave it unset)."
        )
    total = per_device_train_batch_size * processes * steps
    if total % num_generations == 0:
        return None
    unit = num_generations // math.gcd(num_generations, processes * steps)
    suggestion = max(unit, math.ceil(per_device_train_batch_size / unit) * unit)
    return (
        f"per_device_train_batch_size {per_device_train_batch_size} x {processes} process(es) x {steps_name} {steps} = "
        f"{total} completions per generation, not a multiple of num_generations={num_generations} (every prompt needs "
        f"a whole group); set per_device_train_batch_size to a multiple of {unit}, e.g. --per_device_train_batch_size "
        f"{suggestion}."
    )


def _batch_problem_from_argv(argv: Sequence[str]) -> str | None:
    """:func:`batch_shape_problem` for the values of the recipe and the command line (the latter wins)."""
    import yaml

    from egpo_trl.config import EGPOConfig
    from egpo_trl.launch import _option

    recipe: dict[str, Any] = {}
    path = _option(argv, "config")
    if path and Path(path).is_file():
        recipe = yaml.safe_load(Path(path).read_text()) or {}
    defaults = {f.name: f.default for f in EGPOConfig.__dataclass_fields__.values()}

    def value(name: str):
        raw = _option(argv, name)
        raw = recipe.get(name, defaults.get(name)) if raw is None else raw
        try:
            return int(raw) if raw is not None and str(raw).lower() not in ("none", "null", "") else None
        except (TypeError, ValueError):
            return None

    per_device, accumulation, groups = (
        value("per_device_train_batch_size"),
        value("gradient_accumulation_steps"),
        value("num_generations"),
    )
    if not per_device or not accumulation or not groups:
        return None
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return batch_shape_problem(
        per_device, processes, accumulation, groups, value("steps_per_generation"), value("generation_batch_size")
    )


# ---------------------------------------------------------------------------------------------- model and data
def resolve_model_path(name_or_path: str) -> str:
    """``builtin:<name>`` -> the path of a model shipped in ``egpo_trl/assets``; anything else unchanged."""
    if not name_or_path.startswith(BUILTIN_MODEL_PREFIX):
        return name_or_path
    name = name_or_path[len(BUILTIN_MODEL_PREFIX) :]
    assets = Path(__file__).resolve().parent / "assets"
    path = assets / name
    if not (path / "config.json").is_file():
        available = (
            sorted(p.name for p in assets.iterdir() if (p / "config.json").is_file()) if assets.is_dir() else []
        )
        raise SystemExit(
            f"egpo-trl train: no shipped model {name!r}; shipped models: {available or 'none'}. Rebuild the tiny model "
            "with `make tiny-model` if its files are missing."
        )
    return str(path)


def resolve_reward_funcs(names: Sequence[str]) -> list[Callable[..., list[float]]]:
    """Reward functions from names defined in :mod:`egpo_trl.rewards` or import paths ``pkg.module:func``.

    The names are those of ``egpo_trl.rewards.REWARD_FUNCS`` when that registry exists, else
    ``boxed_accuracy_reward`` and ``think_format_reward``.
    """
    from egpo_trl import rewards

    registry: dict[str, Callable[..., list[float]]] = dict(
        getattr(rewards, "REWARD_FUNCS", None)
        or {name: getattr(rewards, name) for name in ("boxed_accuracy_reward", "think_format_reward")}
    )
    funcs = []
    for name in names:
        if name in registry:
            funcs.append(registry[name])
            continue
        module_name, sep, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(
                f"egpo-trl train: unknown reward function {name!r}; use one of {sorted(registry)} or an import path "
                "such as 'my_package.rewards:my_reward'."
            )
        try:
            func = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise SystemExit(f"egpo-trl train: cannot import reward function {name!r}: {error}") from error
        if not callable(func):
            raise SystemExit(f"egpo-trl train: {name!r} is not callable.")
        funcs.append(func)
    if not funcs:
        raise SystemExit("egpo-trl train: reward_funcs is empty; give at least one (e.g. boxed_accuracy_reward).")
    return funcs


def _load_any(script_args: TrainScriptArguments):
    """A ``DatasetDict`` (or ``Dataset``) for a local path or Hub name."""
    from datasets import load_dataset, load_from_disk

    name = script_args.dataset_name
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            return load_from_disk(str(path))
        if path.is_file():
            builder = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
            if builder is None:
                raise SystemExit(
                    f"egpo-trl train: cannot read {path}: use a .json, .jsonl, .csv or .parquet file, or a folder "
                    "written by Dataset.save_to_disk."
                )
            return load_dataset(builder, data_files={script_args.dataset_train_split: str(path)})
        return load_dataset(str(path), name=script_args.dataset_config)
    return load_dataset(name, name=script_args.dataset_config)


_QUESTION_COLUMNS = ("problem", "question", "query", "instruction", "input", "text", "prompt_text")
_ANSWER_COLUMNS = ("answer", "final_answer", "solution", "ground_truth", "gt", "target", "label", "output")


def _reward_columns(reward_funcs: Sequence[str]) -> dict[str, str]:
    """Dataset columns the reward functions require (parameters without a default), mapped to a function name."""
    import inspect

    passed = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "kwargs"}
    needed: dict[str, str] = {}
    try:
        funcs = resolve_reward_funcs(reward_funcs)
    except SystemExit:
        return needed  # reported where the reward functions are built
    for func in funcs:
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        for parameter in parameters:
            required = parameter.default is inspect.Parameter.empty and parameter.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            )
            if required and parameter.name not in passed:
                needed.setdefault(parameter.name, getattr(func, "__name__", str(func)))
    return needed


def column_problem(columns: Sequence[str], script_args: TrainScriptArguments) -> str | None:
    """One line naming what the dataset lacks (a prompt, the answer column the reward needs) and the flags that fix
    it, from the dataset's actual columns; ``None`` when nothing is missing.
    """
    columns = list(columns)
    problems, fixes = [], []
    if script_args.prompt_template is None and "prompt" not in columns:
        question = next((c for c in _QUESTION_COLUMNS if c in columns), None)
        question = question or next((c for c in columns if c not in _ANSWER_COLUMNS), columns[0] if columns else "x")
        problems.append("no 'prompt' column")
        fixes.append(f"--prompt_template '{{{question}}} Put the final answer in \\boxed{{{{}}}}.'")
    answer = script_args.answer_column
    renamed = answer != "answer"
    needs_answer = "answer" in _reward_columns(script_args.reward_funcs)
    if (renamed or needs_answer) and answer not in columns:
        candidates = [c for c in _ANSWER_COLUMNS if c in columns and c != answer]
        what = f"no {answer!r} column" + (
            "" if renamed else f" (the ground truth that {_reward_columns(script_args.reward_funcs)['answer']} needs)"
        )
        problems.append(what)
        fixes.append(f"--answer_column {candidates[0] if candidates else '<the column with the final answers>'}")
    if not problems:
        return None
    return f"the dataset has {' and '.join(problems)} (its columns: {', '.join(columns)}); pass {' '.join(fixes)}."


def _prepare_columns(dataset, script_args: TrainScriptArguments):
    """Build/normalise the ``prompt`` and ``answer`` columns the trainer and the rewards use."""
    from egpo_trl.data.synthetic import format_prompt

    columns = dataset.column_names
    problem = column_problem(columns, script_args)
    if problem:
        raise SystemExit(f"egpo-trl train: {problem}")
    if script_args.answer_column != "answer":
        if "answer" in columns:
            dataset = dataset.remove_columns("answer")
        dataset = dataset.rename_column(script_args.answer_column, "answer")
        columns = dataset.column_names
    template, system = script_args.prompt_template, script_args.system_prompt
    if template is not None:

        def render(row):
            try:
                text = template.format(**row)
            except KeyError as error:
                raise SystemExit(
                    f"egpo-trl train: prompt_template refers to {error}, which is not a column (columns: {columns})."
                ) from None
            return {"prompt": format_prompt(text, system_prompt=system, instruction=None)}

        dataset = dataset.map(render, desc="Rendering prompts")
    elif system:

        def add_system(row):
            prompt = row["prompt"]
            if isinstance(prompt, str):
                return {"prompt": format_prompt(prompt, system_prompt=system, instruction=None)}
            return {"prompt": [{"role": "system", "content": system}] + [m for m in prompt if m["role"] != "system"]}

        dataset = dataset.map(add_system, desc="Adding the system prompt")
    return dataset


def load_datasets(script_args: TrainScriptArguments, seed: int = 0):
    """The training set and the held-out set (``None`` when ``eval_size`` is 0).

    For a synthetic task the held-out problems come from its ``test`` split, disjoint from training
    by construction. Otherwise they come from ``dataset_test_split`` when the dataset has it, else
    from ``eval_size`` rows taken out of the training split.
    """
    from datasets import Dataset, DatasetDict

    from egpo_trl.data.synthetic import DEFAULT_INSTRUCTION, SYNTHETIC_TASKS

    name = script_args.dataset_name
    if name.startswith(SYNTHETIC_DATASET_PREFIX):
        task = name[len(SYNTHETIC_DATASET_PREFIX) :]
        if task not in SYNTHETIC_TASKS:
            raise SystemExit(
                f"egpo-trl train: unknown synthetic task {task!r}; built-in tasks: "
                + ", ".join(SYNTHETIC_DATASET_PREFIX + t for t in sorted(SYNTHETIC_TASKS))
            )
        build = SYNTHETIC_TASKS[task]
        options = dict(
            levels=script_args.synthetic_levels,
            seed=script_args.synthetic_seed,
            system_prompt=script_args.system_prompt,
            instruction=DEFAULT_INSTRUCTION,
        )
        try:
            train = build(split="train", num_problems=script_args.synthetic_train_size, **options)
            heldout = (
                build(split="test", num_problems=script_args.eval_size, **options) if script_args.eval_size else None
            )
        except ValueError as error:
            raise SystemExit(f"egpo-trl train: {error}") from error
        if script_args.prompt_template is not None:
            train = _prepare_columns(train, script_args)
            heldout = _prepare_columns(heldout, script_args) if heldout is not None else None
        return train, heldout

    loaded = _load_any(script_args)
    if isinstance(loaded, Dataset):
        loaded = DatasetDict({script_args.dataset_train_split: loaded})
    if script_args.dataset_train_split not in loaded:
        raise SystemExit(
            f"egpo-trl train: {name} has no split {script_args.dataset_train_split!r} (splits: {list(loaded)}); set "
            "dataset_train_split."
        )
    train = _prepare_columns(loaded[script_args.dataset_train_split], script_args)
    heldout = None
    if script_args.eval_size:
        if "answer" not in train.column_names:
            logger.warning("The dataset has no 'answer' column: the held-out accuracy is skipped.")
        elif (
            script_args.dataset_test_split in loaded
            and script_args.dataset_test_split != script_args.dataset_train_split
        ):
            test = _prepare_columns(loaded[script_args.dataset_test_split], script_args)
            heldout = test.shuffle(seed=seed).select(range(min(script_args.eval_size, len(test))))
        else:
            if script_args.eval_size >= len(train):
                raise SystemExit(
                    f"egpo-trl train: eval_size={script_args.eval_size} would hold out the whole training split "
                    f"({len(train)} rows); lower eval_size."
                )
            split = train.train_test_split(test_size=script_args.eval_size, seed=seed, shuffle=True)
            train, heldout = split["train"], split["test"]
    return train, heldout


def _is_local_path(name: str) -> bool:
    """Whether a model name can only mean a local folder (a Hub id is ``owner/name``)."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") != 1
        or name.endswith("/")
        or "\\" in name
        or Path(name.split("/", 1)[0]).is_dir()  # outputs/run-1 where outputs/ exists
    )


def check_model_exists(
    name_or_path: str, revision: str | None = None, trust_remote_code: bool = False, prog: str = "egpo-trl train"
) -> str:
    """Fail in one line, before anything loads, when the model is neither a local folder nor on the Hub.

    Local folders (and ``builtin:`` names) are checked on disk; other names are looked up as Hub ids by fetching
    their config only (from the local cache when offline).

    Returns:
        The resolved path or Hub id.

    Raises:
        SystemExit: naming the model and what to give instead.
    """
    try:
        path = resolve_model_path(name_or_path)
    except SystemExit as error:
        raise SystemExit(str(error).replace("egpo-trl train:", f"{prog}:", 1)) from None
    local = Path(path).expanduser()
    if local.exists():
        if local.is_dir() and not any((local / name).is_file() for name in ("config.json", "adapter_config.json")):
            raise SystemExit(
                f"{prog}: {path} has no config.json, so it is not a saved model; give the folder that save_pretrained "
                "wrote (a trained run's output_dir, or one of its checkpoint-* folders)."
            )
        return path
    fix = "give a local model folder, a Hub id such as Qwen/Qwen2.5-Math-1.5B, or builtin:tiny-math-qwen2"
    if _is_local_path(path):
        raise SystemExit(f"{prog}: the model {path} does not exist; check the path, or {fix}.")
    from transformers import AutoConfig

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        text = str(error)
        if "couldn't connect" in text or "offline" in text.lower() or "cached files" in text:
            reason = "no network (or HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
        elif "gated" in text.lower():
            reason = "it is a gated model: accept its licence on the Hub and log in with `hf auth login`"
        elif "not a valid model identifier" in text or "Repository Not Found" in text or "404" in text:
            reason = "no such model on the Hugging Face Hub"
        else:
            reason = " ".join(text.split())[:200]
        raise SystemExit(
            f"{prog}: cannot find the model {path}: it is not a local folder, and {reason}. To fix it, {fix}."
        ) from None
    finally:
        hub_logger.setLevel(level)
    return path


# ---------------------------------------------------------------------------------------------- output folder
def prepare_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    """Refuse (or, with ``overwrite``, clear) an output folder holding an earlier run's checkpoints or outputs.

    Nothing is deleted unless ``overwrite`` is set; then only the earlier run's checkpoints and the files
    this command writes are removed. Resuming keeps everything.
    """
    path = Path(output_dir)
    if not path.is_dir() or resuming:
        return
    checkpoints = sorted(p for p in path.glob("checkpoint-*") if p.is_dir())
    markers = [path / name for name in _RUN_MARKERS if (path / name).exists()]
    if not checkpoints and not markers:
        return
    found = ", ".join(p.name for p in (checkpoints + markers)[:5])
    if not overwrite:
        raise SystemExit(
            f"egpo-trl train: {path} already holds another run ({found}). Choose a new --output_dir (a "
            "'{timestamp}' in it makes one per run), resume with --resume_from_checkpoint true, or replace it with "
            "--overwrite_output_dir true."
        )
    for checkpoint in checkpoints:
        shutil.rmtree(checkpoint)
    for name in (*_RUN_MARKERS, PLOT_FILE):
        if (path / name).is_file():
            (path / name).unlink()
    logger.warning("overwrite_output_dir: removed the earlier run's outputs in %s (%s)", path, found)


# ---------------------------------------------------------------------------------------------- metrics and plot
def _train_accuracy(logs: dict[str, float], correctness_name: str | None) -> float | None:
    """Fraction of correct completions from a ``+1/-1`` reward's mean: ``(mean + 1) / 2``."""
    key = f"rewards/{correctness_name}/mean" if correctness_name else None
    if key and key in logs:
        return (logs[key] + 1.0) / 2.0
    return None


class MetricsCallback(TrainerCallback):
    """Appends every log (TRL's metrics and the ``egpo/*`` ones) as one JSON line to ``path``.

    Only the main process writes. Each line holds ``step``, ``epoch``, ``time_s`` (seconds since the
    start of training) and the logged numbers. With a ``+1/-1`` correctness reward (the paper's
    Eq. 1), ``accuracy`` = ``(mean reward + 1) / 2`` is added: the fraction of correct completions.

    Args:
        path: the JSON lines file (appended to, so a resumed run continues it).
        correctness_name: name of the reward function that decides correctness (TRL logs its mean as
            ``rewards/<name>/mean``).
        accuracy_from_reward: whether that reward is ``+1/-1``, so that ``accuracy`` can be derived.
    """

    def __init__(self, path: str | Path, correctness_name: str | None = None, accuracy_from_reward: bool = True):
        self.path = Path(path)
        self.correctness_name = correctness_name
        self.accuracy_from_reward = accuracy_from_reward
        self.start = time.time()

    def write(self, record: dict[str, Any]) -> None:
        """Append one record."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, default=float) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch, "time_s": round(time.time() - self.start, 2)}
        record.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if self.accuracy_from_reward:
            accuracy = _train_accuracy(logs, self.correctness_name)
            if accuracy is not None:
                record["accuracy"] = accuracy
        self.write(record)


class CompactProgressCallback(ProgressCallback):
    """The Trainer's progress bar, with the key metrics as its postfix instead of a printed dict per log."""

    def __init__(self, correctness_name: str | None = None):
        super().__init__()
        self.correctness_name = correctness_name

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        postfix = {}
        if "reward" in logs:
            postfix["reward"] = f"{logs['reward']:.2f}"
        accuracy = _train_accuracy(logs, self.correctness_name)
        if accuracy is not None:
            postfix["acc"] = f"{accuracy:.2f}"
        if "egpo/frac_mixed" in logs:
            postfix["mixed"] = f"{logs['egpo/frac_mixed']:.2f}"
        if "egpo/entropy_gap" in logs:
            postfix["H gap"] = f"{logs['egpo/entropy_gap']:+.3f}"
        self.training_bar.set_postfix(postfix, refresh=False)


def _checkpoint_step(checkpoint: str | Path) -> int:
    """The training step a ``checkpoint-*`` folder was saved at (its ``trainer_state.json``, else its name)."""
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    return int(Path(checkpoint).name.rsplit("-", 1)[-1])


def _truncate_metrics(path: Path, step: int) -> int:
    """Drop the records a resumed run will write again: training steps after ``step`` and the final evaluation.

    Resuming from ``checkpoint-N`` replays the steps after N, so without this ``metrics.jsonl`` would hold them
    twice (and the curves would run back in time). Returns the number of records dropped.
    """
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= step and r.get("heldout/stage") != "after"]
    if len(kept) != len(records):
        path.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))
    return len(records) - len(kept)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter windows at the start), the same length as ``values``."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def plot_metrics(records: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw reward, accuracy, entropy gap and group-type fractions over the steps into a PNG file.

    Per-step values are drawn faintly, with a trailing moving average on top (the per-step numbers of a
    small batch are noisy).

    Args:
        records: ``metrics.jsonl`` records (training logs have ``reward``; held-out evaluations have
            ``heldout/accuracy``). The entropy gap is ``egpo/entropy_gap`` (incorrect minus correct), or
            the difference of ``egpo/entropy_incorrect`` and ``egpo/entropy_correct``.
        path: where to write the PNG.
        title: figure title.

    Returns:
        ``path`` as a ``Path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = metrics_figure(records, title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def metrics_figure(records: Sequence[dict[str, Any]], title: str = ""):
    """The matplotlib figure :func:`plot_metrics` saves (four panels, labelled axes, one point per step)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # One point per step: the last record of a step wins (a resumed run's file may repeat the replayed steps).
    train = sorted(
        {r["step"]: r for r in records if "reward" in r and "heldout/accuracy" not in r}.values(),
        key=lambda r: r["step"],
    )
    heldout = sorted(
        {r.get("heldout/stage", r["step"]): r for r in records if "heldout/accuracy" in r}.values(),
        key=lambda r: r["step"],
    )
    window = max(1, len(train) // 12)

    def series(key: str, rows=train):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in points], [p[1] for p in points]

    def draw(ax, steps, values, color, label=None):
        if window > 1:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, _moving_average(values, window), color=color, linewidth=2, label=label)
        else:
            ax.plot(steps, values, color=color, linewidth=2, label=label)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    steps, values = series("reward")
    draw(ax, steps, values, "tab:blue")
    ax.set_title("Mean reward of the training batches")
    ax.set_ylabel("mean reward")

    ax = axes[0][1]
    steps, values = series("accuracy")
    if steps:
        draw(ax, steps, values, "tab:green", "training batches")
    steps, values = series("heldout/accuracy", heldout)
    if steps:
        ax.plot(steps, values, "o--", color="black", markersize=7, label="held-out")
        for step, value in zip(steps, values):
            ax.annotate(f"{value:.1%}", (step, value), textcoords="offset points", xytext=(4, 6))
    ax.set_title("Accuracy")
    ax.set_ylabel("fraction of correct completions")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")

    ax = axes[1][0]
    steps, values = series("egpo/entropy_gap")
    if not steps:
        steps_c, correct = series("egpo/entropy_correct")
        paired = dict(zip(steps_c, correct))
        steps_i, incorrect = series("egpo/entropy_incorrect")
        steps = [step for step in steps_i if step in paired]
        values = [value - paired[step] for step, value in zip(steps_i, incorrect) if step in paired]
    if steps:
        draw(ax, steps, values, "tab:red")
        ax.axhline(0.0, color="gray", linewidth=0.8)
    else:
        ax.text(0.5, 0.5, "no egpo/entropy_* metrics logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Entropy gap: incorrect minus correct completions")
    ax.set_ylabel("entropy gap (nats per token)")

    ax = axes[1][1]
    drawn = False
    for key, label, color in (
        ("egpo/frac_all_correct", "all correct", "tab:green"),
        ("egpo/frac_mixed", "mixed", "tab:orange"),
        ("egpo/frac_all_incorrect", "all incorrect", "tab:red"),
    ):
        steps, values = series(key)
        if steps:
            draw(ax, steps, values, color, label)
            drawn = True
    if drawn:
        ax.legend(loc="best")
        ax.set_ylim(0, 1)
    else:
        ax.text(0.5, 0.5, "no egpo/frac_* metrics logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Group types (fraction of prompts)")
    ax.set_ylabel("fraction of prompts")

    for ax in (a for row in axes for a in row):
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    return fig


# ---------------------------------------------------------------------------------------------- training
def build_trainer(script_args: TrainScriptArguments, training_args, model_args, train_dataset):
    """An :class:`~egpo_trl.EGPOTrainer` for the resolved arguments (the model is loaded here)."""
    from trl import get_peft_config, get_quantization_config

    from egpo_trl.trainer import EGPOTrainer

    model_path = resolve_model_path(model_args.model_name_or_path)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    quantization_config = get_quantization_config(model_args)
    model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}
    if training_args.model_init_kwargs:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    trainer = EGPOTrainer(
        model=model_path,
        reward_funcs=resolve_reward_funcs(script_args.reward_funcs),
        args=training_args,
        train_dataset=train_dataset,
        quantization_config=quantization_config,
        peft_config=get_peft_config(model_args),
    )
    return trainer


def _shards_parameters(trainer) -> bool:
    """Whether the weights are sharded across processes (DeepSpeed ZeRO-3 or FSDP)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None and plugin.zero_stage == 3)


def _correctness_name(trainer) -> str | None:
    index = getattr(trainer, "_egpo_correctness_index", 0)
    names = getattr(trainer, "reward_func_names", [])
    return names[index] if names else None


def _heldout(trainer, script_args, training_args, heldout, label: str):
    from egpo_trl.heldout import heldout_accuracy

    temperature = training_args.temperature if script_args.eval_temperature is None else script_args.eval_temperature
    model = trainer.accelerator.unwrap_model(trainer.model)
    start = time.time()
    result = heldout_accuracy(
        model,
        trainer.processing_class,
        heldout,
        max_new_tokens=training_args.max_completion_length,
        num_samples=script_args.eval_num_samples,
        temperature=temperature,
        top_p=training_args.top_p,
        top_k=training_args.top_k or 0,
        batch_size=script_args.eval_batch_size,
        seed=training_args.seed,
    )
    levels = "  ".join(f"L{level} {acc:.0%}" for level, acc in result.by_level.items())
    print(
        f"Held-out accuracy {label}: {result.accuracy:.1%} ({result.num_problems} problems x {result.num_samples} "
        f"samples, T={temperature:g}, {time.time() - start:.0f}s){'   ' + levels if levels else ''}",
        flush=True,
    )
    return result, temperature


def run(script_args: TrainScriptArguments, training_args, model_args) -> dict[str, Any]:
    """Train with resolved arguments: held-out accuracy, training, held-out accuracy, metrics, plot, model.

    ``torch_num_threads`` applies for the duration of the run; torch's thread count is restored after.

    Returns:
        A summary: ``output_dir``, ``heldout_before``/``heldout_after`` (accuracies or ``None``),
        ``train_runtime_s``, ``wall_time_s`` and the paths of the files written.
    """
    import torch

    threads = torch.get_num_threads()
    if script_args.torch_num_threads:
        torch.set_num_threads(script_args.torch_num_threads)
    try:
        return _run(script_args, training_args, model_args)
    finally:
        torch.set_num_threads(threads)


def _run(script_args: TrainScriptArguments, training_args, model_args) -> dict[str, Any]:
    from transformers.trainer_utils import get_last_checkpoint

    wall_start = time.time()
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
    prepare_output_dir(training_args.output_dir, script_args.overwrite_output_dir, resuming=resume is not None)

    check_model_exists(model_args.model_name_or_path, model_args.model_revision, training_args.trust_remote_code)
    train_dataset, heldout = load_datasets(script_args, seed=training_args.seed)
    trainer = build_trainer(script_args, training_args, model_args, train_dataset)
    is_main = trainer.accelerator.is_main_process
    output_dir = Path(training_args.output_dir)
    metrics_path, plot_path, heldout_path = (
        output_dir / METRICS_FILE,
        output_dir / PLOT_FILE,
        output_dir / HELDOUT_FILE,
    )
    correctness_name = _correctness_name(trainer)
    metrics = MetricsCallback(metrics_path, correctness_name, accuracy_from_reward=correctness_name in _PLUS_MINUS_ONE)
    if resume is not None and metrics_path.is_file() and trainer.accelerator.is_main_process:
        _truncate_metrics(metrics_path, _checkpoint_step(resume))
    trainer.add_callback(metrics)
    if not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(CompactProgressCallback(correctness_name))

    if heldout is not None and _shards_parameters(trainer):
        logger.warning("The held-out check runs on one process and cannot generate with sharded weights: skipped.")
        heldout = None
    if is_main:
        length = (
            f"{training_args.max_steps} steps"
            if training_args.max_steps > 0
            else f"{training_args.num_train_epochs:g} epoch(s)"
        )
        print(
            f"{training_args.advantage_estimator.upper()} on {model_args.model_name_or_path}: {len(train_dataset)} "
            f"training prompts from {script_args.dataset_name}, {training_args.num_generations} completions per "
            f"prompt, {length}. Outputs: {output_dir}/",
            flush=True,
        )
    summary: dict[str, Any] = {"output_dir": str(output_dir), "heldout_before": None, "heldout_after": None}
    heldout_records: dict[str, Any] = {}
    if heldout is not None and is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        result, temperature = _heldout(trainer, script_args, training_args, heldout, "before training")
        summary["heldout_before"] = result.accuracy
        heldout_records["before"] = {**result.to_dict(), "temperature": temperature, "step": 0}
        if resume is None:
            metrics.write({"step": 0, "heldout/accuracy": result.accuracy, "heldout/stage": "before"})
    trainer.accelerator.wait_for_everyone()

    try:
        train_output = trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        _save_interrupted(trainer)
        raise
    summary["train_runtime_s"] = train_output.metrics.get("train_runtime")

    if heldout is not None and is_main:
        result, temperature = _heldout(trainer, script_args, training_args, heldout, "after training")
        summary["heldout_after"] = result.accuracy
        step = trainer.state.global_step
        heldout_records["after"] = {**result.to_dict(), "temperature": temperature, "step": step}
        metrics.write({"step": step, "heldout/accuracy": result.accuracy, "heldout/stage": "after"})
    if script_args.save_final_model:
        trainer.save_model(str(output_dir))
    if is_main:
        files = [metrics_path]
        if heldout_records:
            heldout_path.write_text(json.dumps(heldout_records, indent=2) + "\n")
            files.append(heldout_path)
        if script_args.plot and metrics_path.exists():
            title = (
                f"{trainer.args.advantage_estimator.upper()} on {script_args.dataset_name}, seed {training_args.seed}"
            )
            plot_metrics(read_metrics(metrics_path), plot_path, title=title)
            files.append(plot_path)
        summary["files"] = [str(f) for f in files]
        summary["wall_time_s"] = round(time.time() - wall_start, 1)
        before, after = summary["heldout_before"], summary["heldout_after"]
        print("")
        if before is not None and after is not None:
            print(
                f"Held-out accuracy: {before:.1%} before -> {after:.1%} after training "
                f"({100 * (after - before):+.1f} points)."
            )
        print(f"Done in {summary['wall_time_s']:.0f}s. Outputs in {output_dir}/:")
        for path in files:
            print(f"  {path}")
        if script_args.save_final_model:
            print(f"  {output_dir}/ (trained model and tokenizer)")
    trainer.accelerator.wait_for_everyone()
    return summary


def _save_interrupted(trainer) -> None:
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


def _interrupted_message(argv: Sequence[str], training_args) -> str:
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


def _remove_if_empty(path: Path) -> None:
    """Remove ``path`` when it holds no file at all (only empty folders): what a run that failed early leaves."""
    if not path.is_dir() or any(p.is_file() or p.is_symlink() for p in path.rglob("*")):
        return
    shutil.rmtree(path, ignore_errors=True)


SHORT_HELP_FIELDS = (
    "model_name_or_path",
    "dataset_name",
    "prompt_template",
    "answer_column",
    "reward_funcs",
    "output_dir",
    "max_steps",
    "num_train_epochs",
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "temperature",
    "seed",
    "advantage_estimator",
    "egpo_lambda_min",
    "egpo_lambda_max",
    "egpo_clamp",
    "egpo_nsr",
    "eval_size",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "use_cpu",
    "bf16",
    "accelerate_config",
    "num_processes",
)


_SHORT_HELP_TEXT = {
    "output_dir": "Where the run's metrics, plot, checkpoints and model go; '{timestamp}' in it is replaced by the "
    "start time.",
    "resume_from_checkpoint": "'true' continues the run from the last checkpoint-* in output_dir; or a checkpoint "
    "path.",
    "use_cpu": "Train on the CPU (with bf16 false).",
    "bf16": "bf16 mixed precision; needs a GPU that supports it.",
}


def short_help() -> str:
    """``egpo-trl train --help``: how to run a recipe and the fields most runs change (``--help-all``: every field)."""
    import dataclasses
    import re
    import textwrap

    from egpo_trl.config import EGPOConfig

    parser = make_parser()
    actions = {action.dest: action for action in parser._actions}
    defaults = {}
    for cls in (_model_config_class(), EGPOConfig, TrainScriptArguments):
        for item in dataclasses.fields(cls):
            if item.default is not dataclasses.MISSING:
                defaults[item.name] = item.default
            elif item.default_factory is not dataclasses.MISSING:
                defaults[item.name] = item.default_factory()

    def first_sentence(text: str) -> str:
        text = " ".join((text or "").split()).replace("%%", "%")
        match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!Eq)(?<!Sec)\. (?=[A-Z`(])", text)
        return text if match is None else text[: match.start() + 1]

    lines = [
        "usage: egpo-trl train RECIPE.yaml [--dry-run] [--FIELD VALUE ...]",
        "",
        "Train a policy with EGPO (or a baseline advantage estimator) from a YAML recipe. Every field is a YAML key",
        "of the recipe or a --flag; flags override the recipe.",
        "",
        "examples:",
        "  egpo-trl train recipes/demo_tiny_cpu.yaml                    the CPU demo (what `make demo` runs)",
        "  egpo-trl train recipes/demo_tiny_cpu.yaml --max_steps 20 --seed 1",
        "  egpo-trl train recipes/egpo_qwen15b.yaml --dry-run           check a GPU recipe, print its launch",
        "  egpo-trl train recipes/egpo_qwen15b.yaml                     run it (prints, then runs, accelerate launch)",
        "",
        "arguments:",
        "  RECIPE.yaml, --config RECIPE.yaml",
        "                        the YAML recipe (see recipes/)",
        "  --dry-run             check the recipe and print the resolved settings and launch command; trains nothing",
        "  -h, --help            this help",
        f"  --help-all            all {len(_known_fields(parser))} fields (TRL's GRPOConfig, TrainingArguments, "
        "ModelConfig, egpo_*)",
        "",
        "fields most runs change [default]:",
    ]
    for name in SHORT_HELP_FIELDS:
        action = actions.get(name)
        if action is None:
            continue
        default = defaults.get(name)
        shown = (
            ""
            if default in (None, "", [], ())
            else f" [{', '.join(default) if isinstance(default, list) else default}]"
        )
        lines.append(f"  --{name}{shown}")
        lines += textwrap.wrap(
            _SHORT_HELP_TEXT.get(name) or first_sentence(action.help),
            width=110,
            initial_indent=" " * 6,
            subsequent_indent=" " * 6,
        )
    lines += ["", "Every field, with its full help: egpo-trl train --help-all"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``egpo-trl train`` and ``python -m egpo_trl.train``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from egpo_trl.launch import configure_tracking, dry_run, launch_if_requested, normalize_argv

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
    try:
        configure_tracking(training_args)
        run(script_args, training_args, model_args)
    except KeyboardInterrupt:
        if created:
            _remove_if_empty(output_dir)
        if main_process:
            print(f"\n{_interrupted_message(argv, training_args)}", file=sys.stderr, flush=True)
        return 130
    except BaseException:
        if created:
            _remove_if_empty(output_dir)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
