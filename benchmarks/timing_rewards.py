"""Rewards for timing runs on random-weight models, given to ``egpo-trl train`` as an import path.

A random-weight model never writes a correct ``\\boxed{}``: every group is entirely incorrect, so EGPO's mixed-group
path and GRPO's loss are idle. :func:`coin_flip_reward` gives +1 or -1 from a hash of the completion's text, so
about half of each group is "correct" and the groups are mixed, as in a real run, while the reward stays a pure
function of the completion (the same text gets the same reward on every process and in every run)::

    egpo-trl train recipes/grpo_qwen15b.yaml --reward_funcs benchmarks.timing_rewards:coin_flip_reward ...

:func:`hard_prompts_coin_flip_reward` also makes one prompt in four entirely incorrect, for timing DAPO's dynamic
sampling when it has groups to replace.
"""

from __future__ import annotations

import hashlib


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: a list of messages
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def coin_flip_reward(completions, **kwargs) -> list[float]:
    """+1.0 or -1.0 for each completion, from the parity of a hash of its text."""
    return [1.0 if hashlib.sha256(_text(c).encode()).digest()[0] % 2 else -1.0 for c in completions]


def hard_prompts_coin_flip_reward(prompts, completions, **kwargs) -> list[float]:
    """:func:`coin_flip_reward`, but -1.0 for every completion of one prompt in four (from a hash of the prompt's
    text): those groups are entirely incorrect, as a problem too hard for the model gives, so that DAPO's dynamic
    sampling (``dynamic_sampling: true``) drops them and generates the shortfall in extra rounds, as in a real run.
    The same prompt gets the same verdict on every process, in every round and in every run."""
    flips = coin_flip_reward(completions)
    return [-1.0 if hashlib.sha256(_text(p).encode()).digest()[1] % 4 == 0 else r for p, r in zip(prompts, flips)]
