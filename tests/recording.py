"""Helpers of the training tests: a trainer that records its batches, and readers of what it recorded."""

from __future__ import annotations

import torch
from conftest import make_prompt_dataset

from egpo_trl import EGPOTrainer


class Recording(EGPOTrainer):
    """Keeps each generation batch handed to TRL and each batch the loss consumed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated, self.consumed = [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.generated.append(
            {"batch": self.egpo_last_batch, **{k: v.clone() for k, v in output.items() if torch.is_tensor(v)}}
        )
        return output

    def _compute_loss(self, model, inputs):
        self.consumed.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return super()._compute_loss(model, inputs)


def rows(ids, mask):
    return [tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask)]


def texts(trainer, generated):
    """Prompt and completion texts of a generation batch, decoded the way TRL decodes them for the rewards."""
    tokenizer = trainer.processing_class
    prompts = tokenizer.batch_decode(generated["prompt_ids"], skip_special_tokens=True)
    ids = [r[m.bool()] for r, m in zip(generated["completion_ids"], generated["completion_mask"])]
    return prompts, tokenizer.batch_decode(ids, skip_special_tokens=True)


def answers_of(trainer, prompts):
    """The ground truth of each decoded prompt, looked up in make_prompt_dataset by its decoded chat prompt."""
    tokenizer = trainer.processing_class
    lookup = {}
    for row in make_prompt_dataset():
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        lookup[tokenizer.decode(ids, skip_special_tokens=True)] = row["answer"]
    return [lookup[prompt] for prompt in prompts]


def history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]
