"""Held-out accuracy of a policy under sampling: the number ``egpo-trl train`` prints before and after training.

It samples the model in memory with the evaluation's transformers backend (no vLLM, no distributed evaluation): the
quick sanity check around a training run. Full benchmark evaluation lives in ``egpo-trl eval``.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from egpo_trl.evaluation.backends import SamplingSettings, TransformersBackend
from egpo_trl.rewards import CORRECT_REWARD, boxed_accuracy_reward

logger = logging.getLogger(__name__)

__all__ = ["HeldoutResult", "NO_CORRECT_CAUSES", "generate_completions", "heldout_accuracy"]

#: Why no completion is ever correct, usually: said when none is, before training (:func:`heldout_accuracy`) and in its
#: first steps (:class:`~egpo_trl.EGPOTrainer`).
NO_CORRECT_CAUSES = (
    "The usual causes: prompts given as plain text to a model that needs its chat template (give `prompt` as chat "
    "messages, [{'role': 'user', 'content': ...}], so that the template is applied); an answer format that does not "
    "end in \\boxed{...} (boxed_accuracy_reward reads a completion's last box: ask for it in the prompt, and check "
    "the `answer` column against it); or a reward function that does not score a correct completion as correct (try "
    "it on one)."
)


@dataclass
class HeldoutResult:
    """Outcome of :func:`heldout_accuracy`.

    Attributes:
        accuracy: mean over the scored completions of "the completion is correct" (pass@1 averaged over
            ``num_samples`` samples per problem); NaN when none was scored.
        num_problems: problems evaluated.
        num_samples: samples per problem.
        by_level: accuracy per value of the dataset's ``level`` column, when it has one.
        num_unscored: completions the reward function gave no verdict on (reward ``None``), left out of the
            accuracy.
        completions: the decoded completions, ``num_samples`` consecutive ones per problem.
        correct: whether each completion was correct (``None``: unscored), aligned with ``completions``.
    """

    accuracy: float
    num_problems: int
    num_samples: int
    by_level: dict[str, float] = field(default_factory=dict)
    num_unscored: int = 0
    completions: list[str] = field(default_factory=list, repr=False)
    correct: list[bool | None] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The summary numbers (without the completions), ready for JSON."""
        return {
            "accuracy": self.accuracy,
            "num_problems": self.num_problems,
            "num_samples": self.num_samples,
            "by_level": self.by_level,
            "num_unscored": self.num_unscored,
        }


def generate_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 128,
    seed: int | None = 0,
) -> list[str]:
    """Sample one completion per prompt (chat messages, rendered with the chat template, or plain text) with
    :class:`~egpo_trl.evaluation.backends.TransformersBackend`, in batches of ``batch_size``; the decoded texts.

    ``temperature=0`` decodes greedily; ``top_k=0`` and ``top_p=1`` disable those filters. ``seed`` seeds torch once
    before the first batch and restores torch's (CPU and the model's device), Python's and NumPy's random state
    afterwards, so that what runs next (a training run) draws the same numbers with or without this evaluation;
    ``None`` samples from the current state and leaves it advanced. The model's training mode is restored.
    """
    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)
    backend = TransformersBackend(model, tokenizer=tokenizer, batch_size=batch_size)
    ids = [
        tokenizer(prompt)["input_ids"]
        if isinstance(prompt, str)
        else tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        for prompt in prompts
    ]
    was_training = model.training
    model.eval()
    device = backend.device
    accelerator = device.type not in ("cpu", "meta")
    devices = list(range(getattr(torch, device.type).device_count())) if accelerator and seed is not None else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(
            devices=devices, device_type=device.type if accelerator else "cuda", enabled=seed is not None
        ):
            if seed is not None:
                torch.manual_seed(seed)
            generations = backend.generate(ids, settings)
    finally:
        model.train(was_training)
        if seed is not None:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
    return [generation.text for generation in generations]


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
    seed: int | None = 0,
    reward_func: Callable[..., list[float | None]] = boxed_accuracy_reward,
) -> HeldoutResult:
    """Accuracy of ``model`` on ``dataset`` under sampling: ``num_samples`` completions per problem.

    A completion is correct when ``reward_func`` (by default the paper's Eq. 1 outcome reward) gives it
    the "correct" reward ``+1``; one it gives ``None`` (no verdict) is left out of the accuracy and counted, with a
    warning. When none is correct, a warning names the usual causes (:data:`NO_CORRECT_CAUSES`).

    Args:
        model, tokenizer: the policy to evaluate.
        dataset: rows with ``prompt`` and ``answer`` (and optionally ``level``), e.g. a held-out split.
        max_new_tokens, temperature, top_p, top_k, batch_size, seed: see :func:`generate_completions`.
        num_samples: completions sampled per problem.
        reward_func: a reward function ``f(completions, answer=..., **columns) -> list[float | None]``.

    Returns:
        A :class:`HeldoutResult`.
    """
    if len(dataset) == 0:
        raise ValueError("The held-out set is empty; give at least one problem.")
    prompts = [prompt for prompt in dataset["prompt"] for _ in range(num_samples)]
    answers = [answer for answer in dataset["answer"] for _ in range(num_samples)]
    completions = generate_completions(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        batch_size=batch_size,
        seed=seed,
    )
    rewards = reward_func(completions=completions, answer=answers)
    correct = [None if reward is None else reward == CORRECT_REWARD for reward in rewards]
    scored = [ok for ok in correct if ok is not None]
    name = getattr(reward_func, "__name__", type(reward_func).__name__)
    if len(scored) < len(correct):
        logger.warning(
            "%d of %d held-out completions got no verdict (reward None, reward function %s); they are left out of "
            "the accuracy (num_unscored).",
            len(correct) - len(scored),
            len(correct),
            name,
        )
    if not any(scored):
        logger.warning(
            "No completion of the held-out set was correct (0 of %d, reward function %s). %s",
            len(scored),
            name,
            NO_CORRECT_CAUSES,
        )
    by_level: dict[str, float] = {}
    if "level" in dataset.column_names:
        buckets: dict[str, list[bool]] = defaultdict(list)
        for level, ok in zip((lvl for lvl in dataset["level"] for _ in range(num_samples)), correct):
            if ok is not None:
                buckets[str(level)].append(ok)
        order = sorted(buckets, key=lambda level: (0, int(level), "") if level.isdigit() else (1, 0, level))
        by_level = {level: sum(buckets[level]) / len(buckets[level]) for level in order}
    return HeldoutResult(
        accuracy=sum(scored) / len(scored) if scored else float("nan"),
        num_problems=len(dataset),
        num_samples=num_samples,
        by_level=by_level,
        num_unscored=len(correct) - len(scored),
        completions=completions,
        correct=correct,
    )
