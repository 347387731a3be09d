"""A run in which no completion is ever correct says so, once, with the usual causes: plain-text prompts given to the
shipped tiny model (which answers only through its chat template) score -1 on every completion, in training and in
the held-out check before it."""

from __future__ import annotations

import logging

import pytest
from conftest import trainer_config as config

from egpo_trl import EGPOTrainer
from egpo_trl.data.synthetic import make_arithmetic_dataset
from egpo_trl.rewards import boxed_accuracy_reward
from egpo_trl.tiny_model import tiny_model_path
from egpo_trl.trainer import NO_CORRECT_WARNING_STEPS

CAUSES = ("plain text to a model that needs its chat template", "does not end in \\boxed{...}", "reward function")


def datasets():
    """Two-step sums in chat messages, as the shipped model was trained on, and the same questions as plain text."""
    chat = make_arithmetic_dataset("train", 16, levels=2, seed=0).select_columns(["prompt", "answer"])
    return chat, chat.map(lambda row: {"prompt": row["prompt"][-1]["content"]})


def warnings_of(caplog, logger: str, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.getMessage().startswith(start)]


@pytest.mark.slow
def test_training_says_once_that_no_completion_was_correct(tmp_path, caplog):
    chat, text = datasets()
    for dataset, expected, steps in ((text, 1, NO_CORRECT_WARNING_STEPS + 1), (chat, 0, NO_CORRECT_WARNING_STEPS)):
        caplog.clear()
        args = config(tmp_path, max_steps=steps, max_completion_length=48)
        trainer = EGPOTrainer(tiny_model_path(), boxed_accuracy_reward, args, train_dataset=dataset)
        with caplog.at_level(logging.WARNING, logger="egpo_trl.trainer"):
            trainer.train()
        rewards = [row["rewards/boxed_accuracy_reward/mean"] for row in trainer.state.log_history if "loss" in row]
        told = warnings_of(caplog, "egpo_trl.trainer", "No completion of the first")
        assert len(told) == expected, (rewards, told)  # once, not at every later step
        if expected:
            assert rewards == [-1.0] * steps
            assert f"the first {NO_CORRECT_WARNING_STEPS} optimizer steps" in told[0]
            assert f"({NO_CORRECT_WARNING_STEPS * 8} completions" in told[0]
            assert all(cause in told[0] for cause in CAUSES), told[0]
        else:
            assert max(rewards) > -1.0


@pytest.mark.slow
def test_guided_error_correction_does_not_hide_that_no_completion_was_correct(tmp_path, caplog):
    """Guided Error Correction injects the reference answer into incorrect completions, which then score +1: the
    check reads the completions as sampled."""
    _, text = datasets()
    args = config(
        tmp_path, max_steps=NO_CORRECT_WARNING_STEPS + 1, max_completion_length=48, edge_gec=True,
        edge_gec_reflect_prob=0.0, edge_gec_answer_prob=1.0, edge_gec_solution_prob=0.0,
        edge_gec_answer_template=" \\boxed{{answer}}.",
    )  # fmt: skip
    trainer = EGPOTrainer(tiny_model_path(), boxed_accuracy_reward, args, train_dataset=text)
    with caplog.at_level(logging.WARNING, logger="egpo_trl.trainer"):
        trainer.train()
    rewards = [row["rewards/boxed_accuracy_reward/mean"] for row in trainer.state.log_history if "loss" in row]
    assert min(rewards) > -1.0  # the injected answers are correct
    told = warnings_of(caplog, "egpo_trl.trainer", "No completion of the first")
    assert len(told) == 1 and f"({NO_CORRECT_WARNING_STEPS * 8} completions" in told[0], told


@pytest.mark.slow
def test_the_heldout_check_says_when_no_completion_was_correct(caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from egpo_trl.heldout import heldout_accuracy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    chat, text = datasets()
    for dataset, expected in ((text, 1), (chat, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="egpo_trl.heldout"):
            result = heldout_accuracy(model, tokenizer, dataset, max_new_tokens=48)
        told = warnings_of(caplog, "egpo_trl.heldout", "No completion of the held-out set was correct")
        assert len(told) == expected and (result.accuracy == 0.0) == bool(expected), (result.accuracy, told)
        if expected:
            assert "(0 of 16," in told[0] and all(cause in told[0] for cause in CAUSES), told[0]
