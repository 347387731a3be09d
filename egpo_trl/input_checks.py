"""Checks of what a training run is given, shared by ``egpo-trl train`` and the Python API, made before any model
loads: training values that cannot work, the dataset's columns against the reward functions, and the batch shape."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Keyword arguments TRL 1.16's GRPOTrainer passes to reward functions itself: not dataset columns.
_PASSED_TO_REWARDS = set("prompts completions completion_ids trainer_state log_extra log_metric environments".split())
# Column names datasets commonly give their questions and their reference answers: the renames a message suggests.
QUESTION_COLUMNS = ("problem", "question", "query", "instruction", "input", "text", "prompt_text")
ANSWER_COLUMNS = ("answer", "final_answer", "solution", "ground_truth", "gt", "target", "label", "output")
_ASSETS = Path(__file__).resolve().parent / "assets"


def training_value_problems(args) -> list[str]:
    """What is wrong with an :class:`~egpo_trl.EGPOConfig`'s values that TRL would only find mid-run (or never)."""
    problems = []

    def need(ok: bool, name: str, rule: str) -> None:
        if not ok:
            problems.append(f"{name} must be {rule}, got {getattr(args, name)!r}")

    need(args.learning_rate >= 0, "learning_rate", ">= 0 (the paper recipes use 1e-6, the CPU demo 1e-4)")
    need(args.weight_decay >= 0, "weight_decay", ">= 0")
    need(0 <= args.adam_beta1 < 1, "adam_beta1", "in [0, 1)")
    need(0 <= args.adam_beta2 < 1, "adam_beta2", "in [0, 1)")
    need(args.adam_epsilon >= 0, "adam_epsilon", ">= 0")
    need(args.per_device_train_batch_size >= 1, "per_device_train_batch_size", ">= 1")
    need(args.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", ">= 1")
    need(args.steps_per_generation is None or args.steps_per_generation > 0, "steps_per_generation", ">= 1 (or unset)")
    need(args.max_completion_length is None or args.max_completion_length >= 1, "max_completion_length", ">= 1")
    need(args.num_iterations >= 1, "num_iterations", ">= 1")
    need(args.temperature > 0, "temperature", "> 0 (GRPO samples its completions; 1.0 in the paper)")
    need(0 < args.top_p <= 1, "top_p", "in (0, 1]")
    need(args.top_k is None or args.top_k >= -1, "top_k", ">= -1 (0, -1 or unset: off)")
    if args.top_k == -1 and not getattr(args, "use_vllm", False):
        problems.append(
            "top_k=-1 turns top-k off in vLLM only; transformers' generation (use_vllm is off) refuses it mid-run: "
            "use top_k=0"
        )
    need(args.min_p is None or 0 <= args.min_p <= 1, "min_p", "in [0, 1] (or unset)")
    need(args.repetition_penalty > 0, "repetition_penalty", "> 0 (1.0: off)")
    need(args.epsilon >= 0, "epsilon", ">= 0 (0.2 in the paper)")
    need(args.epsilon_high is None or args.epsilon_high >= 0, "epsilon_high", ">= 0 (or unset: epsilon)")
    need(args.beta >= 0, "beta", ">= 0 (the KL coefficient; 0 in the paper)")
    if args.max_steps <= 0:
        need(args.num_train_epochs > 0, "num_train_epochs", "> 0 when max_steps is unset (nothing would train)")
    save = str(getattr(args.save_strategy, "value", args.save_strategy))
    if save == "steps":
        need(args.save_steps > 0, "save_steps", "> 0 with save_strategy steps (or save_strategy: no)")
    return problems


# ``generation_kwargs`` keys TRL 1.16 sets itself on every generation call, with the field that sets them instead.
_TRL_GENERATION_KWARGS = {
    "logprobs": None,
    "n": "num_generations",
    "num_return_sequences": "num_generations",
    "max_tokens": "max_completion_length",
    "max_new_tokens": "max_completion_length",
}


def generation_kwargs_problem(args: Any) -> str | None:
    """One line naming what in ``args.generation_kwargs`` cannot work, with the fix; ``None`` when nothing."""
    kwargs = args.generation_kwargs or {}
    vllm_mode = getattr(args, "vllm_mode", None) if getattr(args, "use_vllm", False) else None
    same = {"logprobs": 0, "num_return_sequences": 1, **({} if vllm_mode == "server" else {"n": 1})}  # TRL's own pass
    problems = []
    keys = [key for key in _TRL_GENERATION_KWARGS if key in kwargs and (key not in same or kwargs[key] != same[key])]
    if keys:
        settings = list(dict.fromkeys(_TRL_GENERATION_KWARGS[key] for key in keys if _TRL_GENERATION_KWARGS[key]))
        instead = f" and set {' and '.join(settings)} instead" if settings else ""
        why = "TRL asks vLLM for the sampled token's log-prob alone; with more it would keep the most probable token's"
        logprobs = f" ({why})" if "logprobs" in keys else ""
        problems.append(
            f"sets {', '.join(keys)}, which TRL sets itself on every generation{logprobs}: remove "
            f"{'it' if len(keys) == 1 else 'them'}{instead}"
        )
    greedy = []
    if kwargs.get("do_sample") is False:
        greedy.append(f"do_sample={kwargs['do_sample']!r}")
    if isinstance(kwargs.get("num_beams"), int) and kwargs["num_beams"] > 1:
        greedy.append(f"num_beams={kwargs['num_beams']}")
    if isinstance(kwargs.get("temperature"), (int, float)) and kwargs["temperature"] <= 0:
        greedy.append(f"temperature={kwargs['temperature']}")
    if kwargs.get("top_k") == 1:
        greedy.append("top_k=1")
    if greedy:
        problems.append(
            f"sets {', '.join(greedy)}, which does not sample: a group's completions would be identical and get no "
            "advantage; remove it (the temperature field sets the sampling temperature)"
        )
    if kwargs.get("seed") is not None and vllm_mode == "colocate":
        problems.append(
            "sets seed, which colocated vLLM gives every copy of a prompt, so a group's completions would be "
            "identical: remove it (or use vllm_mode='server', which samples a prompt's group in one request)"
        )
    return f"generation_kwargs {'; it '.join(problems)}." if problems else None


def batch_shape_problem(
    per_device: int, processes: int, accumulation: int, num_generations: int, steps_per_generation=None, gen_batch=None
) -> str | None:
    """What is wrong with a batch that cannot be cut into groups of ``num_generations``, in the fields users set."""
    steps_name, steps = "gradient_accumulation_steps", accumulation
    if steps_per_generation:
        steps_name, steps = "steps_per_generation", steps_per_generation
    if gen_batch:
        if gen_batch % num_generations == 0:
            return None
        return (
            f"generation_batch_size={gen_batch} is not divisible by num_generations={num_generations}; "
            "set it to a multiple (or leave it unset)."
        )
    total = per_device * processes * steps
    if total % num_generations == 0:
        return None
    unit = num_generations // math.gcd(num_generations, processes * steps)
    suggestion = max(unit, math.ceil(per_device / unit) * unit)
    return (
        f"per_device_train_batch_size {per_device} x {processes} process(es) x {steps_name} {steps} = "
        f"{total} completions per generation, not divisible by num_generations={num_generations} (every prompt needs "
        f"a whole group); set per_device_train_batch_size to a multiple of {unit}, e.g. {suggestion}."
    )


def model_problem(name: str) -> str | None:
    """Why the model ``name`` cannot be loaded, seen without the network; ``None`` otherwise."""
    path = Path(name).expanduser()
    if path.is_dir() and not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
        return (
            f"{name} has no config.json, so it is not a saved model; give the folder that save_pretrained wrote (a "
            "trained run's output_dir, or one of its checkpoint-* folders)."
        )
    # A Hub id is ``owner/name``; anything else (or a path under an existing folder) can only be a local folder.
    local = name.startswith((".", "/", "~")) or name.count("/") != 1 or name.endswith("/") or "\\" in name
    if not path.exists() and (local or Path(name.split("/", 1)[0]).is_dir()):
        return (
            f"the model {name} does not exist; check the path, or give a local model folder, a Hub id such as "
            "Qwen/Qwen2.5-Math-1.5B, or builtin:tiny-math-qwen2."
        )
    return None


def resolve_model_name(model: Any) -> Any:
    """``builtin:<name>`` and ``egpo_trl/assets/<name>`` -> the shipped model's folder; a model that cannot be loaded
    is a ``ValueError``; anything else unchanged."""
    if not isinstance(model, str):
        return model
    parts = Path(model).parts
    if model.startswith("builtin:") or (not Path(model).exists() and parts[:-1] == ("egpo_trl", "assets")):
        name = model.removeprefix("builtin:") if model.startswith("builtin:") else parts[-1]
        if not (_ASSETS / name / "config.json").is_file():
            shipped = sorted(p.name for p in _ASSETS.glob("*") if (p / "config.json").is_file())
            raise ValueError(
                f"no shipped model {name!r}; shipped models: {shipped or 'none'}. Rebuild the tiny model with `make "
                "tiny-model` if its files are missing."
            )
        return str(_ASSETS / name)
    if problem := model_problem(model):
        raise ValueError(problem)
    return model


def required_columns(reward_funcs: Sequence[Any]) -> dict[str, str]:
    """Dataset columns the reward functions need, each mapped to the name of a function that needs it."""
    needed: dict[str, str] = {}
    import torch

    for func in reward_funcs:
        if isinstance(func, (str, torch.nn.Module)) or not callable(func):
            continue  # a reward model (an id, a path or a loaded module): it reads the prompt and completion only
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in parameters:
            required = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
            if required and p.name not in _PASSED_TO_REWARDS:
                needed.setdefault(p.name, getattr(func, "__name__", repr(func)))
    return needed


def _dataset_problem(dataset: Any, reward_funcs: Sequence[Any], args: Any, environment: bool) -> str | None:
    """One line naming the columns ``train_dataset`` lacks, what expects each and the rename that supplies it."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # a DatasetDict
        return (
            f"train_dataset is a DatasetDict with splits {list(columns)}; pass one split, e.g. "
            f"train_dataset=dataset[{next(iter(columns), 'train')!r}]."
        )
    if not columns:
        return None  # an IterableDataset without known features, or a plain iterable: checked by TRL as it reads
    # What expects each column, and the setting that makes it expected.
    needed = {} if environment else {"prompt": ["the trainer (the prompts: text or chat messages)"]}
    for column, func in required_columns(reward_funcs).items():
        needed.setdefault(column, []).append(f"{func} (its {column!r} parameter; reward_funcs)")
    if getattr(args, "edge_gec", False):
        needed.setdefault("answer", []).append("edge_gec=True (the reference answers)")
    missing = [column for column in needed if column not in columns]
    if not missing:
        return None
    described = [f"{c!r} column, which {' and '.join(needed[c])} need{'s' * (len(needed[c]) == 1)}" for c in missing]
    renames, to_add, untaken = [], [], [c for c in columns if c not in needed]
    for column in missing:
        likely = {"prompt": QUESTION_COLUMNS, "answer": ANSWER_COLUMNS}.get(column, ())
        source = next((c for c in likely if c in untaken), None)
        if source is None:
            to_add.append(repr(column))
        else:
            untaken.remove(source)
            renames.append(f".rename_column({source!r}, {column!r})")
    fixes = [f"dataset{''.join(renames)}"] if renames else []
    fixes += [f"add {' and '.join(to_add)} (e.g. with dataset.map)"] if to_add else []
    return (
        f"train_dataset has no {'; no '.join(described)}. Its columns: {', '.join(columns)}. Rename or add them, "
        f"e.g. {'; '.join(fixes)}."
    )


def stochastic_settings(config: dict, prefix: str = "") -> list[str]:
    """The keys of a model or adapter config dict that set a dropout, jitter, layer-drop or drop-path above 0."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += stochastic_settings(value, f"{prefix}{key}.")
            continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        words = ("dropout", "pdrop", "jitter", "layerdrop", "drop_path", "stochastic_depth")
        if isinstance(key, str) and numeric and value > 0 and any(word in key for word in words):
            found.append(f"{prefix}{key}")
    return found


def config_makes_forward_random(config: dict) -> bool:
    """Whether a model or adapter config dict makes a training-mode forward random."""
    return bool(stochastic_settings(config))


def _cached_model_config(model: str) -> dict | None:
    """The ``config.json`` of a model folder, or of a Hub model already in the local cache; ``None`` otherwise."""
    import json

    from transformers.utils import cached_file

    try:
        path = cached_file(model, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
        config = json.loads(Path(path).read_text()) if path else None
    except Exception:  # noqa: BLE001 - not a model id, or not cached: the trainer checks the loaded model instead
        return None
    return config if isinstance(config, dict) else None


def loss_forward_input_problems(model: Any, peft_config: Any, model_init_kwargs: dict | None) -> list[str]:
    """What makes ``egpo_entropy_logps="loss_forward"`` impossible, seen before the model loads (random forwards)."""
    problems = []
    if peft_config is not None:
        values = peft_config if isinstance(peft_config, dict) else getattr(peft_config, "to_dict", dict)()
        if isinstance(values, dict) and config_makes_forward_random(values):
            problems.append(
                "the PEFT adapter's training forward is random (a dropout above 0, e.g. lora_dropout, TRL's default "
                "0.05); set it to 0 (--lora_dropout 0)"
            )
    config = _cached_model_config(model) if isinstance(model, str) else None
    keys = sorted(stochastic_settings({**config, **(model_init_kwargs or {})})) if config is not None else []
    if keys:
        problems.append(
            f"the model's config sets a random training forward ({', '.join(keys)} above 0); set "
            f"{'them' if len(keys) != 1 else 'it'} to 0 through model_init_kwargs"
        )
    return problems


def check_trainer_inputs(model: Any, reward_funcs: Any, args: Any, pos_args: Sequence[Any], kwargs: dict) -> Any:
    """What ``EGPOTrainer.__init__`` checks before the model loads; returns the model, ``builtin:`` names resolved."""
    model = resolve_model_name(model)
    if args is None:
        return model
    if problems := training_value_problems(args):
        raise ValueError(f"EGPOConfig: {'; '.join(problems)}.")
    if getattr(args, "egpo_entropy_logps", None) == "loss_forward":
        peft_config = kwargs.get("peft_config", pos_args[7] if len(pos_args) > 7 else None)
        if problems := loss_forward_input_problems(model, peft_config, getattr(args, "model_init_kwargs", None)):
            args._validate_loss_forward(problems)  # one error with the arguments' own problems, naming the fix
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    dataset = pos_args[0] if pos_args else kwargs.get("train_dataset")
    if dataset is not None:
        environment = kwargs.get("environment_factory", pos_args[10] if len(pos_args) > 10 else None) is not None
        if problem := _dataset_problem(dataset, funcs, args, environment):
            raise ValueError(problem)
    per_device, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if problem := batch_shape_problem(
        per_device, args.world_size, steps, args.num_generations, args.steps_per_generation
    ):
        raise ValueError(problem)
    return model
