"""Shared fixtures: a tiny Qwen2 policy and a small prompt dataset, both built offline."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests run tiny models: one CPU thread is about as fast as several and does not slow to a crawl when other
# programs share the cores. Child processes (notebook kernels, torch.distributed workers) inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tiny_qwen2 import build_tiny_model  # noqa: E402,F401  (re-exported for the tests)
from vllm_cpu import install_cpu_weight_sync  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
install_cpu_weight_sync()  # vLLM colocate mode on the CPU build of vLLM (tests marked vllm); nothing elsewhere


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


# ----------------------------------------------------------------------------- shared test helpers
NAN = float("nan")
# Mixed group [+1, -1, +1, -1]: mean 0, unbiased std sqrt(4/3); TRL adds 1e-4 to the std.
A_MIXED = 1.0 / (math.sqrt(4.0 / 3.0) + 1e-4)


def t(*values):
    """A float32 tensor of the values."""
    return torch.tensor(values, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    """``actual`` equals ``expected`` (float32) to ``atol``."""
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# The settings the trainer tests share: 2 prompts x 4 completions of 12 tokens per step, on CPU.
TRAINER_TEST_SETTINGS = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=12,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    save_strategy="no",
    seed=0,
    data_seed=0,
    learning_rate=1e-3,
    log_completions=False,
)


def trainer_config(tmp_path, cls=None, **overrides):
    """An ``EGPOConfig`` (or ``cls``, e.g. TRL's ``GRPOConfig``) with the shared settings and ``overrides``."""
    from egpo_trl import EGPOConfig

    return (cls or EGPOConfig)(output_dir=str(tmp_path / "out"), **{**TRAINER_TEST_SETTINGS, **overrides})


def train_two_steps(tmp_path, model_dir: str, **overrides):
    """Train EGPO for two optimizer steps in float32 with eager attention (whose CPU results do not change with the
    sequence length) under ``overrides``: the trainer, its logged training rows and a copy of its final weights."""
    from egpo_trl import EGPOTrainer

    settings = dict(max_steps=2, bf16=False, model_init_kwargs={"attn_implementation": "eager"})
    args = trainer_config(tmp_path, **{**settings, **overrides})
    trainer = EGPOTrainer(model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    return trainer, rows, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def save_rank_records(trainer, out_dir) -> None:
    """Write ``trainer.records`` of this process to ``out_dir/records_rank{rank}.pt`` (multi-process test scripts)."""
    rank = trainer.accelerator.process_index
    torch.save(
        {"rank": rank, "world_size": trainer.accelerator.num_processes, "records": trainer.records},
        f"{out_dir}/records_rank{rank}.pt",
    )


def last_line(text: str) -> str:
    """The last line of a command's output."""
    return text.strip().splitlines()[-1]
