"""The baselines through EGPOTrainer on TRL's real machinery and a tiny Qwen2 built offline.

The DAPO recipe's settings (overlong penalty, clip-higher, dynamic sampling) train together; EDGE-GRPO's Shannon
entropies are the old policy's; NSR and GRPO go through the registry. Dynamic sampling and Guided Error Correction
have their own tests: tests/test_dynamic_sampling.py and tests/test_gec.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from recording import Recording, history
from trl import GRPOConfig, GRPOTrainer

from egpo_trl import EGPOTrainer
from egpo_trl.advantages import edge_grpo_advantages, nsr_advantages, sequence_mean
from egpo_trl.rewards import make_overlong_penalty_reward

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- DAPO: the recipe's settings
def test_dapo_recipe_settings_train_with_the_overlong_penalty(tmp_path, tiny_model_dir):
    args = config(
        tmp_path,
        max_steps=1,
        advantage_estimator="grpo",
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=4,
        overlong_buffer_length=4,
    )
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    assert trainer.reward_func_names == ["parity_reward", "overlong_penalty"]
    assert trainer.epsilon_high == 0.28
    trainer.train()
    generated = trainer.generated[0]
    lengths = generated["completion_mask"].sum(dim=1).tolist()
    expected = make_overlong_penalty_reward(12, 4)([None] * len(lengths), completion_ids=[[0] * n for n in lengths])
    torch.testing.assert_close(generated["batch"]["rewards_per_func"][:, 1], torch.tensor(expected))
    assert any(value < 0 for value in expected)
    # Dynamic sampling decides on correctness (the first reward), not on the length-shaped total.
    correctness = generated["batch"]["rewards_per_func"][:, 0].view(-1, 4) > 0
    assert (correctness.any(dim=1) & ~correctness.all(dim=1)).all()

    with pytest.raises(ValueError, match="reward_weights needs 2 entries"):
        EGPOTrainer(
            tiny_model_dir,
            parity_reward,
            config(tmp_path, overlong_buffer_length=4, reward_weights=[1.0]),
            train_dataset=make_prompt_dataset(),
        )


# ----------------------------------------------------------------------------- EDGE-GRPO
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_edge_grpo_uses_the_old_policy_shannon_entropy(tmp_path, tiny_model_dir, num_iterations):
    args = config(tmp_path, max_steps=1, advantage_estimator="edge_grpo", num_iterations=num_iterations)
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    reference = trainer.model.__class__.from_pretrained(tiny_model_dir).eval()
    trainer.train()
    generated = trainer.generated[0]
    batch = generated["batch"]
    # num_iterations=2: TRL's old-log-prob pass returns the entropies too, no pass of our own.
    assert batch["entropy_source"] == ("forward" if num_iterations == 1 else "old_per_token_logps")
    assert trainer.state.log_history[0]["egpo/entropy_extra_pass"] == float(num_iterations == 1)
    assert "egpo_token_entropies" not in trainer.consumed[0]

    # Shannon entropy of the full next-token distribution at the sampling temperature, recomputed independently.
    ids = torch.cat([generated["prompt_ids"], generated["completion_ids"]], dim=1)
    attention = torch.cat([generated["prompt_mask"], generated["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=attention).logits[:, generated["prompt_ids"].size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float() / args.temperature, dim=-1)
    token_entropy = -(logps.exp() * logps).sum(dim=-1)
    expected = sequence_mean(token_entropy, generated["completion_mask"])
    torch.testing.assert_close(batch["token_entropies"], expected, atol=1e-4, rtol=1e-4)

    rewards = batch["rewards_per_func"][:, 0]
    recomputed = edge_grpo_advantages(rewards, batch["token_entropies"], 4)
    torch.testing.assert_close(batch["result"].advantages, recomputed.advantages)
    torch.testing.assert_close(generated["advantages"], recomputed.advantages)


# ----------------------------------------------------------------------------- NSR and GRPO through the registry
def test_nsr_trains_on_incorrect_completions_only(tmp_path, tiny_model_dir):
    args = config(tmp_path, max_steps=1, advantage_estimator="nsr", egpo_entropy_metrics=False)
    trainer = Recording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.generated[0]["batch"]
    rewards = batch["rewards_per_func"][:, 0]
    torch.testing.assert_close(batch["result"].advantages, nsr_advantages(rewards, None, 4).advantages)
    assert set(batch["result"].advantages.tolist()) <= {0.0, -1.0} and (rewards < 0).any()
    assert batch["entropies"] is None and batch["entropy_source"] == "none"
    assert trainer.state.log_history[0]["egpo/entropy_extra_pass"] == 0.0
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_grpo_estimator_trains_exactly_like_trl(tmp_path, tiny_model_dir):
    grpo = GRPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(tmp_path / "trl", GRPOConfig, max_steps=2),
        train_dataset=make_prompt_dataset(),
    )
    grpo.train()
    ours = EGPOTrainer(
        tiny_model_dir,
        parity_reward,
        config(
            tmp_path / "ours",
            max_steps=2,
            advantage_estimator="grpo",
            egpo_entropy_metrics=False,
            egpo_shift_prompt_padding=False,
        ),
        train_dataset=make_prompt_dataset(),
    )
    ours.train()
    assert history(ours, "loss") == history(grpo, "loss")
    for a, b in zip(grpo.model.parameters(), ours.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- the entropy metrics' source
class SamplingLogpsRecording(Recording):
    """Returns sampling log-probs from the transformers generation, as vLLM does (every token -0.5)."""

    def _generate_single_turn(self, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        return completion_ids, logprobs if logprobs is not None else [[-0.5] * len(ids) for ids in completion_ids]


@pytest.mark.slow
@pytest.mark.parametrize("entropy_logps", ["policy", "sampler"])
def test_every_estimator_logs_the_entropy_metrics_from_the_source_egpo_uses(tmp_path, tiny_model_dir, entropy_logps):
    from egpo_trl.trainer import ENTROPY_SOURCE_CODES

    sources = {}
    # Under "policy", GRPO's source and EDGE-GRPO's have tests of their own (above and below).
    estimators = ("egpo", "grpo", "edge_grpo", "nsr") if entropy_logps == "sampler" else ("egpo", "nsr")
    for estimator in estimators:
        args = config(
            tmp_path / estimator, max_steps=1, advantage_estimator=estimator, egpo_entropy_logps=entropy_logps
        )
        trainer = SamplingLogpsRecording(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
        trainer.train()
        batch = trainer.generated[0]["batch"]
        sources[estimator] = batch["entropy_source"]
        assert trainer.state.log_history[0]["egpo/entropy_source"] == ENTROPY_SOURCE_CODES[batch["entropy_source"]]
        assert torch.isfinite(batch["entropies"]).all()
        assert "egpo/entropy_mean" in trainer.state.log_history[0]
    if entropy_logps == "sampler":  # vLLM's log-probs, for every estimator
        assert sources == dict.fromkeys(sources, "sampling_per_token_logps")
    else:
        # The policy's log-probs at the sampling weights: the estimators that use them run a pass of their own; for
        # GRPO and NSR, whose advantages do not read them, the loss's forward gives them (same values, next test).
        assert sources == {"egpo": "forward", "nsr": "training_forward"}


class PassOnlyRecording(Recording):
    """Never takes the entropy metrics from the loss's forward: the no-grad pass gives them, as for EGPO."""

    def _egpo_defers_entropy_metrics(self, mode):
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [
        dict(max_steps=1, per_device_train_batch_size=8),  # one micro-batch per generation batch
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),  # two, with TRL's shuffle between
        dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=2),
        dict(max_steps=1, dynamic_sampling=True, dynamic_sampling_max_rounds=4, loss_type="dapo"),  # rounds' batch
    ],
    ids=["one-micro-batch", "accumulation", "two-iterations", "dynamic-sampling"],
)
def test_grpo_entropy_metrics_from_the_loss_forward_equal_the_pass(tmp_path, tiny_model_dir, shape):
    """The free metrics are the old policy's: the same per-completion proxy and logged values as the no-grad pass
    EGPO runs, row for row, through TRL's shuffling and splitting (and a second iteration over the same rows)."""
    runs = {}
    for name, cls in (("loss", Recording), ("pass", PassOnlyRecording)):
        args = config(tmp_path / name, **{"max_steps": 2, "advantage_estimator": "grpo", **shape})
        trainer = cls(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
        trainer.train()
        runs[name] = trainer
    loss, passed = runs["loss"], runs["pass"]
    assert [g["batch"]["entropy_source"] for g in loss.generated] == ["training_forward"] * len(loss.generated)
    assert [g["batch"]["entropy_source"] for g in passed.generated] == ["forward"] * len(passed.generated)
    for a, b in zip(loss.generated, passed.generated, strict=True):
        torch.testing.assert_close(a["completion_ids"], b["completion_ids"])  # the same completions were sampled
        torch.testing.assert_close(a["batch"]["entropies"], b["batch"]["entropies"], rtol=1e-5, atol=1e-5)
    for a, b in zip(loss.state.log_history, passed.state.log_history, strict=True):
        for key in ("egpo/entropy_mean", "egpo/entropy_correct", "egpo/entropy_incorrect", "egpo/entropy_gap"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), key
        if "loss" in b:
            assert a["egpo/entropy_extra_pass"] == 0.0 and b["egpo/entropy_extra_pass"] == 1.0
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)  # training itself is unchanged


@pytest.mark.slow
def test_grpo_entropy_metrics_take_the_pass_when_the_policy_has_dropout(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.1)
    args = config(tmp_path, max_steps=1, advantage_estimator="grpo")
    trainer = Recording(model, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    assert trainer.generated[0]["batch"]["entropy_source"] == "forward"
    assert trainer.state.log_history[0]["egpo/entropy_extra_pass"] == 1.0


def test_stochastic_training_forwards_are_recognised_from_the_config():
    from egpo_trl.input_checks import config_makes_forward_random

    assert not config_makes_forward_random({"attention_dropout": 0.0, "id2label": {0: "LABEL_0"}, "use_cache": True})
    assert config_makes_forward_random({"attention_dropout": 0.1})
    assert config_makes_forward_random(
        {"router_jitter_noise": 0.01}
    )  # mixture-of-experts routing noise in training mode
    assert config_makes_forward_random({"text_config": {"layerdrop": 0.1}})  # sub-configs too
    assert config_makes_forward_random({"drop_path_rate": 0.1})
    from egpo_trl.input_checks import stochastic_settings

    assert stochastic_settings({"attention_dropout": 0.1, "text_config": {"layerdrop": 0.1}, "dropout": 0}) == [
        "attention_dropout",
        "text_config.layerdrop",
    ]
