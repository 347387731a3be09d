"""Which reward function decides correct (> 0) versus incorrect; among several, ``egpo_correctness_reward`` names it
as TRL names it (``rewards/<name>/mean``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from egpo_trl.rewards import boxed_accuracy_reward

logger = logging.getLogger(__name__)

# Taken as the correctness reward when exactly one of several reward functions is one of these.
ACCURACY_REWARDS: tuple[Callable[..., list[float]], ...] = (boxed_accuracy_reward,)
_SHAPING_NAMES = ("overlong_penalty",)  # the trainer's own shaping term, never a verifier


def _unwrap(func: Any) -> Any:
    while isinstance(func, functools.partial):
        func = func.func
    return func


def reward_func_name(func: Any) -> str:
    """The name TRL 1.16's ``GRPOTrainer`` gives the reward function ``func`` (a callable, a model or a model id)."""
    if isinstance(func, str):
        return func.split("/")[-1]
    config = getattr(func, "config", None)
    if config is not None and hasattr(func, "forward"):  # a reward model (nn.Module)
        return str(getattr(config, "_name_or_path", "")).split("/")[-1]
    func = _unwrap(func)
    return getattr(func, "__name__", type(func).__name__)


def reward_func_names(reward_funcs: Any) -> list[str]:
    """:func:`reward_func_name` of each reward function (``None``, one or a list)."""
    return [reward_func_name(func) for func in _as_list(reward_funcs)]


def _as_list(reward_funcs: Any) -> list[Any]:
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]


def binary_correctness_features(args: Any) -> list[str]:
    """The settings of ``args`` that read the binary correct/incorrect verdict, as named in errors."""
    from egpo_trl.advantages import get_advantage_estimator

    estimator = get_advantage_estimator(args.advantage_estimator)
    features = {f"advantage_estimator={args.advantage_estimator!r}": getattr(estimator, "binary_correctness", False)}
    features["dynamic_sampling_metric='correctness'"] = (
        args.dynamic_sampling and args.dynamic_sampling_metric == "correctness"
    )
    features["edge_gec"] = args.edge_gec
    return [name for name, needed in features.items() if needed]


def correctness_reward_index(
    reward_funcs: Any,
    args: Any,
    *,
    names: Sequence[str] | None = None,
    complete: bool = True,
    quiet: bool = False,
) -> int | None:
    """The index of the reward function that decides correct versus incorrect: ``egpo_correctness_reward``'s, the only
    candidate's, the package's accuracy reward among several, or (when only metrics read it) the first; else a
    ValueError naming the fix. ``complete=False``: an unknown name gives ``None``."""
    funcs = _as_list(reward_funcs)
    names = list(names) if names is not None else reward_func_names(funcs)
    chosen = args.egpo_correctness_reward
    if chosen is not None:
        if chosen in names:
            return names.index(chosen)
        if not complete:
            return None
        raise ValueError(
            f"egpo_correctness_reward={chosen!r} names no reward function; set it to one of {names}, the names of "
            "the reward functions (their __name__, or a reward model's id after its last '/')."
        )
    candidates = [i for i, name in enumerate(names) if name not in _SHAPING_NAMES]
    if len(candidates) <= 1:
        return candidates[0] if candidates else 0
    accuracy = [i for i in candidates if i < len(funcs) and _unwrap(funcs[i]) in ACCURACY_REWARDS]
    features = binary_correctness_features(args)
    speak = not quiet and int(getattr(args, "process_index", 0) or 0) == 0
    if len(accuracy) == 1:
        index = accuracy[0]
        if speak:
            (logger.warning if features else logger.info)(
                "Several reward functions (%s) and no egpo_correctness_reward: %r, the package's accuracy reward, "
                "decides correct (> 0) versus incorrect. Set egpo_correctness_reward to choose another.",
                *(", ".join(names), names[index]),
            )
        return index
    if features:
        listed = ", ".join(names[i] for i in candidates)
        raise ValueError(
            f"{', '.join(features)} type(s) each completion as correct or incorrect from ONE reward function, and "
            f"there are several ({listed}) with no egpo_correctness_reward to say which.\n"
            "Name the binary verifier (+1/-1 or 1/0): `egpo_correctness_reward: <name>` in the recipe, "
            "`--egpo_correctness_reward <name>` or EGPOConfig(egpo_correctness_reward='<name>'), with <name> one of: "
            f"{listed}.\nThe other reward functions still add to the rewards."
        )
    if speak:  # only the metrics read the verdict
        logger.warning(
            "Several reward functions (%s) and no egpo_correctness_reward: the metrics that split completions into "
            "correct and incorrect (egpo/frac_*, egpo/entropy_gap, ...) take the verdict from the first, %r. Set "
            "egpo_correctness_reward to name the verifier.",
            *(", ".join(names[i] for i in candidates), names[candidates[0]]),
        )
    return candidates[0]
