"""Shared fixtures: a tiny Qwen2 policy and a small prompt dataset, both built offline."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests run tiny models: one CPU thread is about as fast as several and does not slow to a crawl when other
# programs share the cores. Child processes (notebook kernels, torch.distributed workers) inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from egpo_trl.testing import build_tiny_model  # noqa: E402,F401  (re-exported for the tests)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")))


def make_prompt_dataset(num_prompts: int = 8, conversational: bool = True):
    from datasets import Dataset

    rows = []
    for i in range(num_prompts):
        a, b = 3 + i, 7 + 2 * i
        question = f"What is {a} + {b}? Put the answer in \\boxed{{}}."
        prompt = [{"role": "user", "content": question}] if conversational else question
        rows.append({"prompt": prompt, "answer": str(a + b)})
    return Dataset.from_list(rows)


@pytest.fixture
def prompt_dataset():
    return make_prompt_dataset()


def parity_reward(completions, **kwargs):
    """A deterministic reward of the completion text that splits groups: +1 or -1 by the parity of its distinct characters.

    A random tiny model almost never writes a correct boxed answer, so training-mechanics tests use this
    reward to get mixed, all-correct and all-incorrect groups.
    """
    from egpo_trl.rewards import completion_text

    return [1.0 if len(set(completion_text(c))) % 2 == 0 else -1.0 for c in completions]
