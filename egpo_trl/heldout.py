"""Held-out accuracy of a policy under sampling: the number ``egpo-trl train`` prints before and after training.

This is a small, self-contained sampler on top of ``model.generate`` (no vLLM, no distributed
evaluation), meant for the quick sanity check around a training run and for building the shipped
tiny model. Full benchmark evaluation lives in ``egpo-trl eval``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

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
        accuracy: mean over problems and samples of "the completion is correct" (pass@1 averaged over
            ``num_samples`` samples per problem).
        num_problems: problems evaluated.
        num_samples: samples per problem.
        by_level: accuracy per value of the dataset's ``level`` column, when it has one.
        completions: the decoded completions, ``num_samples`` consecutive ones per problem.
        correct: whether each completion was correct, aligned with ``completions``.
    """

    accuracy: float
    num_problems: int
    num_samples: int
    by_level: dict[str, float] = field(default_factory=dict)
    completions: list[str] = field(default_factory=list, repr=False)
    correct: list[bool] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The summary numbers (without the completions), ready for JSON."""
        return {
            "accuracy": self.accuracy,
            "num_problems": self.num_problems,
            "num_samples": self.num_samples,
            "by_level": self.by_level,
        }


@torch.no_grad()
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
    """Sample one completion per prompt with ``model.generate`` and decode it (special tokens dropped).

    Args:
        model: a causal LM (its training mode is restored afterwards).
        tokenizer: its tokenizer; conversational prompts are rendered with its chat template.
        prompts: chat messages (``[{"role": ..., "content": ...}, ...]``) or plain strings.
        max_new_tokens: generation budget per completion.
        temperature: sampling temperature; ``0`` means greedy decoding.
        top_p: nucleus sampling threshold (``1.0`` disables it).
        top_k: top-k filtering (``0`` disables it).
        batch_size: prompts per ``generate`` call.
        seed: seeds torch's generator before sampling, for reproducible numbers, and restores the random state of
            torch (CPU and the model's device), Python and NumPy afterwards: what runs next (a training run) draws
            the same numbers with or without this evaluation. ``None`` samples from the current state and leaves
            it advanced.

    Returns:
        One decoded completion per prompt, in order.
    """
    if seed is None:
        return _generate(model, tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, batch_size)
    device = next(model.parameters()).device
    with _random_state_kept(device):
        torch.manual_seed(seed)
        return _generate(model, tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, batch_size)


@contextmanager
def _random_state_kept(device: torch.device) -> Iterator[None]:
    """Restore torch's (CPU and every device of ``device``'s type: ``torch.manual_seed`` seeds them all), Python's
    and NumPy's random state on exit."""
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    accelerator = device.type not in ("cpu", "meta")
    devices = list(range(getattr(torch, device.type).device_count())) if accelerator else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _generate(model, tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, batch_size) -> list[str]:
    """:func:`generate_completions` from the current random state."""
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    sampling = temperature > 0
    gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": sampling}
    if sampling:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    eos_ids = model.generation_config.eos_token_id
    if eos_ids is None:
        eos_ids = tokenizer.eos_token_id
    outputs: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = list(prompts[start : start + batch_size])
            if batch and not isinstance(batch[0], str):
                encoded = tokenizer.apply_chat_template(
                    batch,
                    add_generation_prompt=True,
                    tokenize=True,
                    padding=True,
                    return_dict=True,
                    return_tensors="pt",
                )
            else:
                encoded = tokenizer(batch, padding=True, return_tensors="pt")
            encoded = {
                key: value.to(device) for key, value in encoded.items() if key in ("input_ids", "attention_mask")
            }
            generated = model.generate(
                **encoded, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, **gen_kwargs
            )
            new_tokens = generated[:, encoded["input_ids"].shape[1] :]
            outputs.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return outputs


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
    reward_func: Callable[..., list[float]] = boxed_accuracy_reward,
) -> HeldoutResult:
    """Accuracy of ``model`` on ``dataset`` under sampling: ``num_samples`` completions per problem.

    A completion is correct when ``reward_func`` (by default the paper's Eq. 1 outcome reward) gives it
    the "correct" reward ``+1``. When none is, a warning names the usual causes (:data:`NO_CORRECT_CAUSES`).

    Args:
        model, tokenizer: the policy to evaluate.
        dataset: rows with ``prompt`` and ``answer`` (and optionally ``level``), e.g. a held-out split.
        max_new_tokens, temperature, top_p, top_k, batch_size, seed: see :func:`generate_completions`.
        num_samples: completions sampled per problem.
        reward_func: a reward function ``f(completions, answer=..., **columns) -> list[float]``.

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
    correct = [reward == CORRECT_REWARD for reward in rewards]
    if not any(correct):
        logger.warning(
            "No completion of the held-out set was correct (0 of %d, reward function %s). %s",
            len(correct),
            getattr(reward_func, "__name__", type(reward_func).__name__),
            NO_CORRECT_CAUSES,
        )
    by_level: dict[str, float] = {}
    if "level" in dataset.column_names:
        buckets: dict[str, list[bool]] = defaultdict(list)
        for level, ok in zip((lvl for lvl in dataset["level"] for _ in range(num_samples)), correct):
            buckets[str(level)].append(ok)
        order = sorted(buckets, key=lambda level: (0, int(level), "") if level.isdigit() else (1, 0, level))
        by_level = {level: sum(buckets[level]) / len(buckets[level]) for level in order}
    return HeldoutResult(
        accuracy=sum(correct) / len(correct),
        num_problems=len(dataset),
        num_samples=num_samples,
        by_level=by_level,
        completions=completions,
        correct=correct,
    )
