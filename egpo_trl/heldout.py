"""Held-out accuracy under sampling (``egpo-trl train`` before and after training), sampled with the evaluation's
:class:`~egpo_trl.evaluation.backends.TransformersBackend`."""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from egpo_trl.evaluation.backends import SamplingSettings, TransformersBackend
from egpo_trl.rewards import CORRECT_REWARD, boxed_accuracy_reward

logger = logging.getLogger(__name__)

NO_CORRECT_CAUSES = (
    "The usual causes: prompts given as plain text to a model that needs its chat template (give `prompt` as chat "
    "messages); an answer format that does not end in \\boxed{...} (ask for it in the prompt); or a reward function "
    "that does not score a correct completion as correct (try it on one)."
)


@dataclass
class HeldoutResult:
    """Accuracy over scored completions (NaN when none was scored), per ``level`` when the data has one, the number
    of unscored completions (reward ``None``), and the completions with their verdicts."""

    accuracy: float
    num_problems: int
    num_samples: int
    by_level: dict[str, float] = field(default_factory=dict)
    num_unscored: int = 0
    completions: list[str] = field(default_factory=list, repr=False)
    correct: list[bool | None] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("completions", "correct")}


def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 128,
    seed: int = 0,
) -> list[str]:
    """One sampled completion per prompt (``temperature=0`` greedy); ``seed`` seeds torch once, and the random states
    are restored afterwards."""
    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
    backend = TransformersBackend(model, tokenizer=tokenizer, batch_size=batch_size)
    chat = lambda p: tokenizer.apply_chat_template(p, add_generation_prompt=True, return_dict=False)  # noqa: E731
    ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else chat(p) for p in prompts]
    was_training = model.training
    model.eval()
    device_type = backend.device.type
    accelerator = device_type not in ("cpu", "meta")
    devices = list(range(getattr(torch, device_type).device_count())) if accelerator else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_type if accelerator else "cuda"):
            torch.manual_seed(seed)
            generations = backend.generate(ids, settings)
    finally:
        model.train(was_training)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return [g.text for g in generations]


def heldout_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Any,
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 128,
    seed: int = 0,
    reward_func: Callable[..., list[float | None]] = boxed_accuracy_reward,
) -> HeldoutResult:
    """Accuracy on ``dataset`` (``prompt``, ``answer``, optional ``level``) over ``num_samples`` completions each; a
    completion is correct when ``reward_func`` gives it ``+1``, and ``None`` verdicts are counted apart."""
    if len(dataset) == 0:
        raise ValueError("The held-out set is empty; give at least one problem.")
    repeat = lambda column: [value for value in dataset[column] for _ in range(num_samples)]  # noqa: E731
    completions = generate_completions(
        model, tokenizer, repeat("prompt"), max_new_tokens, temperature, top_p, top_k, batch_size, seed
    )
    rewards = reward_func(completions=completions, answer=repeat("answer"))
    correct = [None if reward is None else reward == CORRECT_REWARD for reward in rewards]
    scored = [ok for ok in correct if ok is not None]
    name = getattr(reward_func, "__name__", type(reward_func).__name__)
    if len(scored) < len(correct):
        logger.warning(
            "%d of %d held-out completions got no verdict (reward None, reward function %s); they are left out of "
            "the accuracy (num_unscored).",
            *(len(correct) - len(scored), len(correct), name),
        )
    if not any(scored):
        logger.warning(
            "No completion of the held-out set was correct (0 of %d, reward function %s). %s",
            *(len(scored), name, NO_CORRECT_CAUSES),
        )
    buckets: dict[str, list[bool]] = defaultdict(list)
    for level, ok in zip(repeat("level") if "level" in dataset.column_names else [], correct):
        if ok is not None:
            buckets[str(level)].append(ok)
    order = sorted(buckets, key=lambda level: (0, int(level), "") if level.isdigit() else (1, 0, level))
    by_level = {level: sum(buckets[level]) / len(buckets[level]) for level in order}
    accuracy = sum(scored) / len(scored) if scored else float("nan")
    unscored = len(correct) - len(scored)
    return HeldoutResult(accuracy, len(dataset), num_samples, by_level, unscored, completions, correct)
