"""Shared fixtures: a tiny Qwen2 policy and a small prompt dataset, both built offline."""

from __future__ import annotations

import os
import string

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def build_tiny_model(path: str, seed: int = 0, hidden_size: int = 32, num_layers: int = 2) -> str:
    """Write a character-level tokenizer and a randomly initialised Qwen2 causal LM to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = sorted(set(string.printable) - set("\x0b\x0c"))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    return path


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
