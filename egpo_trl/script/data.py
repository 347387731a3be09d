"""The training and held-out sets of a recipe: built-in synthetic tasks, local files and folders, Hub datasets."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from egpo_trl.input_checks import ANSWER_COLUMNS, QUESTION_COLUMNS, required_columns
from egpo_trl.script.args import TrainScriptArguments
from egpo_trl.script.resolve import resolve_reward_funcs

logger = logging.getLogger(__name__)


SYNTHETIC_DATASET_PREFIX = "synthetic:"


# The `datasets` builder of each local data file type.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def column_problem(columns: Sequence[str], script_args: TrainScriptArguments) -> str | None:
    """One line naming the columns the dataset lacks and the flags that fix it; ``None`` when nothing is missing."""
    columns = list(columns)
    problems, fixes = [], []
    if script_args.prompt_template is None and "prompt" not in columns:
        # Never the column the recipe names as the answer (answer_column), whatever its name.
        others = [c for c in columns if c != script_args.answer_column]
        question = next((c for c in QUESTION_COLUMNS if c in others), None)
        question = question or next((c for c in others if c not in ANSWER_COLUMNS), others[0] if others else "x")
        problems.append("no 'prompt' column")
        fixes.append(f"--prompt_template '{{{question}}} Put the final answer in \\boxed{{{{}}}}.'")
    answer = script_args.answer_column
    try:
        needs = required_columns(resolve_reward_funcs(script_args.reward_funcs)).get("answer")
    except SystemExit:
        needs = None  # reported where the reward functions are built
    if (answer != "answer" or needs) and answer not in columns:
        candidates = [c for c in ANSWER_COLUMNS if c in columns and c != answer]
        what = f" (the ground truth that {needs} needs)" if answer == "answer" else ""
        problems.append(f"no {answer!r} column{what}")
        fixes.append(f"--answer_column {candidates[0] if candidates else '<the column with the final answers>'}")
    if problems:
        return f"the dataset has {' and '.join(problems)} (its columns: {', '.join(columns)}); pass {' '.join(fixes)}."
    return None


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
    """The training set and the held-out set (``None`` when ``eval_size`` is 0)."""
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    from egpo_trl.data.synthetic import DEFAULT_INSTRUCTION, SYNTHETIC_TASKS

    args, name = script_args, script_args.dataset_name
    if name.startswith(SYNTHETIC_DATASET_PREFIX):
        task = name[len(SYNTHETIC_DATASET_PREFIX) :]
        if task not in SYNTHETIC_TASKS:
            raise SystemExit(
                f"egpo-trl train: unknown synthetic task {task!r}; built-in tasks: "
                + ", ".join(SYNTHETIC_DATASET_PREFIX + t for t in sorted(SYNTHETIC_TASKS))
            )
        build, options = SYNTHETIC_TASKS[task], dict(levels=args.synthetic_levels, seed=args.synthetic_seed)
        options.update(system_prompt=args.system_prompt, instruction=DEFAULT_INSTRUCTION)
        try:
            train = build(split="train", num_problems=args.synthetic_train_size, **options)
            heldout = build(split="test", num_problems=args.eval_size, **options) if args.eval_size else None
        except ValueError as error:
            raise SystemExit(f"egpo-trl train: {error}") from error
        if args.prompt_template is not None:
            train, heldout = (_prepare_columns(d, args) if d is not None else None for d in (train, heldout))
        return train, heldout

    path = Path(name).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        loaded = load_from_disk(str(path))
    elif path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise SystemExit(
                f"egpo-trl train: cannot read {path}: use a .json, .jsonl, .csv or .parquet file, or a folder "
                "written by Dataset.save_to_disk."
            )
        loaded = load_dataset(builder, data_files={args.dataset_train_split: str(path)})
    else:  # a folder of data files, or a Hub name
        loaded = load_dataset(str(path) if path.exists() else name, name=args.dataset_config)
    if isinstance(loaded, Dataset):
        loaded = DatasetDict({args.dataset_train_split: loaded})
    if args.dataset_train_split not in loaded:
        raise SystemExit(
            f"egpo-trl train: {name} has no split {args.dataset_train_split!r} (splits: {list(loaded)}); set "
            "dataset_train_split."
        )
    train, heldout = _prepare_columns(loaded[args.dataset_train_split], args), None
    if not args.eval_size:
        return train, None
    if "answer" not in train.column_names:
        logger.warning("The dataset has no 'answer' column: the held-out accuracy is skipped.")
    elif args.dataset_test_split in loaded and args.dataset_test_split != args.dataset_train_split:
        test = _prepare_columns(loaded[args.dataset_test_split], args)
        heldout = test.shuffle(seed=seed).select(range(min(args.eval_size, len(test))))
    elif args.eval_size >= len(train):
        raise SystemExit(
            f"egpo-trl train: eval_size={args.eval_size} would hold out the whole training split ({len(train)} rows); "
            "lower eval_size."
        )
    else:
        split = train.train_test_split(test_size=args.eval_size, seed=seed, shuffle=True)
        train, heldout = split["train"], split["test"]
    return train, heldout
