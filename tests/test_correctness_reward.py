"""Which reward function decides correct versus incorrect when there are several.

A format bonus placed first must not decide correctness: the trainer takes the package's accuracy reward when that
is unambiguous, and otherwise refuses to start, before any model loads, naming the setting to add.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from trl.rewards import think_format_reward

from egpo_trl import EGPOTrainer
from egpo_trl.rewards import boxed_accuracy_reward
from egpo_trl.script.args import parse_args

DEMO_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo_tiny_cpu.yaml"


def no_model(tmp_path) -> str:
    """A folder that looks like a saved model but cannot load: an error about anything else came before loading."""
    folder = tmp_path / "unloadable-model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    return str(folder)


@pytest.mark.parametrize("order", ["format_first", "accuracy_first"])
def test_the_accuracy_reward_decides_in_either_order(tmp_path, tiny_model_dir, order, caplog):
    funcs = [think_format_reward, boxed_accuracy_reward]
    if order == "accuracy_first":
        funcs.reverse()
    expected = funcs.index(boxed_accuracy_reward)
    with caplog.at_level(logging.WARNING, logger="egpo_trl.correctness"):
        trainer = EGPOTrainer(
            tiny_model_dir, funcs, config(tmp_path, max_steps=1), train_dataset=make_prompt_dataset()
        )
    assert trainer._egpo_correctness_index == expected
    assert "'boxed_accuracy_reward', the package's accuracy reward, decides" in caplog.text
    trainer.train()
    batch = trainer.egpo_last_batch
    assert torch.equal(batch["result"].correct, batch["rewards_per_func"][:, expected] > 0)


@pytest.mark.parametrize(
    "funcs",
    [
        [think_format_reward, parity_reward],
        [parity_reward, think_format_reward],
        [boxed_accuracy_reward, functools.partial(boxed_accuracy_reward)],  # two accuracy rewards: which one?
    ],
    ids=["format_first", "format_last", "two_accuracy_rewards"],
)
def test_ambiguous_reward_functions_are_refused_before_the_model_loads(tmp_path, funcs):
    with pytest.raises(ValueError) as error:
        EGPOTrainer(no_model(tmp_path), funcs, config(tmp_path), train_dataset=make_prompt_dataset())
    message = str(error.value)
    assert "advantage_estimator='egpo'" in message and "`egpo_correctness_reward: <name>`" in message
    names = [getattr(f, "__name__", None) or f.func.__name__ for f in funcs]
    assert message.rstrip().splitlines()[-2].endswith(f"one of: {', '.join(names)}.")
    assert len(message.splitlines()) <= 4

    # Each feature that reads correctness is named; dynamic sampling on correctness with GRPO advantages too.
    args = config(tmp_path, advantage_estimator="grpo", dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"^dynamic_sampling_metric='correctness' type\(s\)"):
        EGPOTrainer(no_model(tmp_path), funcs, args, train_dataset=make_prompt_dataset())


def test_grpo_advantages_take_several_reward_functions_as_trl_does(tmp_path, tiny_model_dir, caplog):
    # Nothing reads the verdict but the egpo/* metrics: no refusal, the first function, and a warning that names the
    # metrics concerned and the setting that picks another.
    args = config(tmp_path, advantage_estimator="grpo")
    with caplog.at_level(logging.WARNING, logger="egpo_trl.correctness"):
        trainer = EGPOTrainer(
            tiny_model_dir, [think_format_reward, parity_reward], args, train_dataset=make_prompt_dataset()
        )
    assert trainer._egpo_correctness_index == 0
    assert "take the verdict from the first, 'think_format_reward'" in caplog.text
    assert "egpo/entropy_gap" in caplog.text and "Set egpo_correctness_reward" in caplog.text
    # With the package's accuracy reward among them, that one is taken, as for EGPO.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="egpo_trl.correctness"):
        trainer = EGPOTrainer(
            tiny_model_dir, [think_format_reward, boxed_accuracy_reward], args, train_dataset=make_prompt_dataset()
        )
    assert trainer._egpo_correctness_index == 1 and "take the verdict from the first" not in caplog.text


def test_one_reward_function_needs_no_setting_and_the_overlong_penalty_does_not_count(tmp_path, tiny_model_dir):
    args = config(tmp_path, overlong_buffer_length=4)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer.reward_func_names == ["parity_reward", "overlong_penalty"]
    assert trainer._egpo_correctness_index == 0
    trainer = EGPOTrainer(tiny_model_dir, [think_format_reward], config(tmp_path), train_dataset=make_prompt_dataset())
    assert trainer._egpo_correctness_index == 0


def test_the_named_correctness_reward_is_used_as_given(tmp_path, tiny_model_dir):
    funcs = [think_format_reward, parity_reward]
    args = config(tmp_path, egpo_correctness_reward="parity_reward")
    assert EGPOTrainer(tiny_model_dir, funcs, args, train_dataset=make_prompt_dataset())._egpo_correctness_index == 1
    # Named, it wins over the package's accuracy reward that would otherwise be inferred.
    args = config(tmp_path, egpo_correctness_reward="think_format_reward")
    trainer = EGPOTrainer(
        tiny_model_dir, [boxed_accuracy_reward, think_format_reward], args, train_dataset=make_prompt_dataset()
    )
    assert trainer._egpo_correctness_index == 1
    # A name that matches no reward function is refused before the model loads.
    args = config(tmp_path, egpo_correctness_reward="accuracy_reward")
    with pytest.raises(ValueError, match=r"names no reward function; set it to one of \['think_format_reward'"):
        EGPOTrainer(no_model(tmp_path), funcs, args, train_dataset=make_prompt_dataset())


def test_the_command_line_refuses_the_same_before_anything_loads():
    base = ["--config", str(DEMO_RECIPE)]
    with pytest.raises(SystemExit) as error:
        parse_args([*base, "--reward_funcs", "think_format_reward", "conftest:parity_reward"])
    message = str(error.value)
    assert message.startswith("egpo-trl train: advantage_estimator='egpo'")
    assert message.rstrip().splitlines()[-2].endswith("one of: think_format_reward, parity_reward.")
    for reward_funcs, extra in (
        (["think_format_reward", "boxed_accuracy_reward"], []),
        (["think_format_reward", "conftest:parity_reward"], ["--egpo_correctness_reward", "parity_reward"]),
        (["conftest:parity_reward"], ["--overlong_buffer_length", "20"]),  # the trainer's penalty does not count
    ):
        script_args, training_args, _ = parse_args([*base, "--reward_funcs", *reward_funcs, *extra])
        assert script_args.reward_funcs == reward_funcs


def test_completions_without_a_verdict_are_counted_and_never_incorrect(tmp_path, tiny_model_dir):
    """``None`` from the correctness reward (boxed_accuracy_reward when math-verify gave no verdict) is logged as
    egpo/frac_unscored; those completions get no NSR advantage, as they are not incorrect."""

    def verifier(completions, **kwargs):
        return [None if i % 4 == 0 else -1.0 for i in range(len(completions))]

    trainer = EGPOTrainer(tiny_model_dir, verifier, config(tmp_path, max_steps=1), train_dataset=make_prompt_dataset())
    trainer.train()
    assert trainer.state.log_history[0]["egpo/frac_unscored"] == 0.25
    batch = trainer.egpo_last_batch
    unscored = torch.isnan(batch["rewards_per_func"][:, 0])
    assert unscored.tolist() == [True, False, False, False] * 2
    advantages = batch["result"].advantages
    assert (advantages[unscored] == 0).all() and (advantages[~unscored] < 0).all()
