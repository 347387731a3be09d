"""EGPOTrainer as a drop-in for TRL's GRPOTrainer: what works the same, and what differs by design (with the fix)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from trl import GRPOConfig, GRPOTrainer

from egpo_trl import EGPOConfig, EGPOTrainer
from egpo_trl.advantages import GROUP_ALL_INCORRECT, GROUP_MIXED, normalize_then_sum_advantages
from egpo_trl.rewards import completion_text

pytestmark = pytest.mark.slow


def length_reward(completions, **kwargs):
    """A non-binary reward, as in TRL's own tests: the completion's length."""
    return [float(len(completion_text(c))) for c in completions]


def parity01_reward(completions, **kwargs):
    """``parity_reward`` as a 1/0 reward."""
    return [max(r, 0.0) for r in parity_reward(completions)]


def odd_answers_fail_reward(completions, answer, **kwargs):
    """1/0: every completion of a prompt with an odd answer is incorrect (entirely-incorrect groups); the others by
    parity."""
    return [0.0 if int(a) % 2 else r for a, r in zip(answer, parity01_reward(completions))]


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_default_args_are_built_as_grpo_trainer_does(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from transformers import AutoModelForCausalLM

    # Without args both trainers build their config with the library defaults, bf16 included, which a CPU-only
    # host refuses in the same way for both.
    errors = []
    for cls in (GRPOTrainer, EGPOTrainer):
        with pytest.raises(ValueError) as error:
            cls(model=tiny_model_dir, reward_funcs=parity_reward, train_dataset=make_prompt_dataset())
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "bf16" in errors[0]

    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    name = tiny_model_dir.rstrip("/").split("/")[-1]
    for model in (tiny_model_dir, AutoModelForCausalLM.from_pretrained(tiny_model_dir)):
        grpo = GRPOTrainer(model=model, reward_funcs=parity_reward, train_dataset=make_prompt_dataset())
        egpo = EGPOTrainer(model=model, reward_funcs=parity_reward, train_dataset=make_prompt_dataset())
        assert isinstance(egpo.args, EGPOConfig)
        assert grpo.args.output_dir == f"{name}-GRPO" and egpo.args.output_dir == f"{name}-EGPO"


def test_non_binary_correctness_reward_is_refused_with_the_fix(tmp_path, tiny_model_dir):
    trainer = EGPOTrainer(
        tiny_model_dir, length_reward, config(tmp_path, max_steps=1), train_dataset=make_prompt_dataset()
    )
    with pytest.raises(ValueError, match="binary correctness reward") as error:
        trainer.train()
    assert "egpo_correctness_reward" in str(error.value) and "advantage_estimator='grpo'" in str(error.value)

    # GRPO takes any reward, as in TRL; and a binary verifier named as the correctness reward lets EGPO use a
    # non-binary shaping reward beside it.
    for estimator, funcs in (("grpo", length_reward), ("egpo", [parity01_reward, length_reward])):
        correctness = "parity01_reward" if estimator == "egpo" else None
        args = config(
            tmp_path / estimator, max_steps=1, advantage_estimator=estimator, egpo_correctness_reward=correctness
        )
        trainer = EGPOTrainer(tiny_model_dir, funcs, args, train_dataset=make_prompt_dataset())
        before = [p.clone() for p in trainer.model.parameters()]
        trainer.train()
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters())), estimator


def test_normalize_then_sum_with_grpo_trains_exactly_like_trl(tmp_path, tiny_model_dir):
    kwargs = dict(max_steps=2, multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5])
    funcs = [parity_reward, length_reward]
    grpo = GRPOTrainer(
        tiny_model_dir, funcs, config(tmp_path / "g", GRPOConfig, **kwargs), train_dataset=make_prompt_dataset()
    )
    grpo.train()
    egpo = EGPOTrainer(
        tiny_model_dir,
        funcs,
        config(tmp_path / "e", advantage_estimator="grpo", egpo_shift_prompt_padding=False, **kwargs),
        train_dataset=make_prompt_dataset(),
    )
    egpo.train()
    assert losses(egpo) == losses(grpo)
    for p_grpo, p_egpo in zip(grpo.model.parameters(), egpo.model.parameters()):
        torch.testing.assert_close(p_grpo, p_egpo, rtol=0, atol=0)


def test_normalize_then_sum_with_egpo_uses_the_aggregated_advantages_on_mixed_groups(tmp_path, tiny_model_dir):
    args = config(
        tmp_path,
        max_steps=1,
        multi_objective_aggregation="normalize_then_sum",
        egpo_clamp="none",
        egpo_correctness_reward="parity_reward",
    )
    trainer = EGPOTrainer(tiny_model_dir, [parity_reward, length_reward], args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.egpo_last_batch
    result = batch["result"]
    expected = normalize_then_sum_advantages(batch["rewards_per_func"], trainer.reward_weights, 4)
    mixed = result.group_type == GROUP_MIXED
    assert mixed.any()
    torch.testing.assert_close(result.base_advantages[mixed], expected[mixed], rtol=0, atol=0)


def test_normalize_then_sum_is_refused_for_nsr_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="sum_then_normalize"):
        config(tmp_path, advantage_estimator="nsr", multi_objective_aggregation="normalize_then_sum")


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_nsr_advantage_follows_the_configured_scaling(tmp_path, tiny_model_dir, scale_rewards):
    args = config(tmp_path, max_steps=2, scale_rewards=scale_rewards, egpo_nsr_weighting="unit")
    trainer = EGPOTrainer(tiny_model_dir, odd_answers_fail_reward, args, train_dataset=make_prompt_dataset())
    seen = []
    original = trainer._egpo_finish

    def record(*a, **k):
        out = original(*a, **k)
        seen.append(trainer.egpo_last_batch)
        return out

    trainer._egpo_finish = record
    trainer.train()
    incorrect_groups = 0
    for batch in seen:
        result = batch["result"]
        rows = result.group_type == GROUP_ALL_INCORRECT
        incorrect_groups += int(rows.sum())
        rewards = batch["rewards_per_func"][:, 0]
        # -1 (Eq. 11) wherever the rewards are divided by a std; unscaled, half the correct-incorrect gap of 1/0.
        expected = {"group": -1.0, "batch": -1.0, "none": -0.5}[scale_rewards]
        torch.testing.assert_close(result.base_advantages[rows], torch.full_like(rewards[rows], float(expected)))
    assert incorrect_groups > 0


@pytest.mark.parametrize("scope", ["answer", "thinking"])
def test_entropy_scope_without_segment_falls_back_to_the_whole_completion(tmp_path, tiny_model_dir, scope, caplog):
    # The random tiny model never writes </think>: no completion has an answer segment; with "thinking" the whole
    # completion is thinking, so nothing falls back.
    completion = EGPOTrainer(
        tiny_model_dir, parity_reward, config(tmp_path / "c", max_steps=1), train_dataset=make_prompt_dataset()
    )
    completion.train()
    args = config(tmp_path / scope, max_steps=1, egpo_entropy_scope=scope)
    trainer = EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    with caplog.at_level("WARNING", logger="egpo_trl.trainer"):
        trainer.train()
    entropies = trainer.egpo_last_batch["entropies"]
    assert torch.isfinite(entropies).all()
    logged = trainer.state.log_history[0]["egpo/frac_entropy_scope_fallback"]
    if scope == "answer":
        torch.testing.assert_close(entropies, completion.egpo_last_batch["entropies"])
        assert logged == 1.0
        assert "entropy proxy is taken over the whole completion" in caplog.text
    else:
        assert logged == 0.0 and "whole completion" not in caplog.text


class SamplingLogpsEGPOTrainer(EGPOTrainer):
    """Adds a batch's ``sampling_per_token_logps`` (as vLLM returns them) of 0: an entropy proxy of exactly 0."""

    def _generate_round(self, inputs):
        output, rewards_per_func = super()._generate_round(inputs)
        output["sampling_per_token_logps"] = torch.zeros_like(output["completion_mask"], dtype=torch.float32)
        return output, rewards_per_func


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"top_k": 5},
        {"top_p": 0.9},
        {"generation_kwargs": {"min_p": 0.1}},
        {"generation_kwargs": {"temperature": 0.7}},  # vLLM would sample at 0.7, the proxy assumes the config's 1.0
        {"vllm_structured_outputs_regex": "[0-9]+"},
    ],
)
@pytest.mark.parametrize("entropy_logps", ["sampler", "policy"])
def test_sampling_logps_give_the_proxy_only_for_plain_sampling(tmp_path, tiny_model_dir, sampling, entropy_logps):
    args = config(tmp_path, max_steps=1, egpo_entropy_logps=entropy_logps, **sampling)
    trainer = SamplingLogpsEGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    batch = trainer.egpo_last_batch
    if not sampling and entropy_logps == "sampler":
        assert batch["entropy_source"] == "sampling_per_token_logps"
        assert (batch["entropies"] == 0).all()
    else:  # the default, or processed log-probs of another distribution: the policy's own pass gives H
        assert batch["entropy_source"] == "forward"
        assert (batch["entropies"] > 0).all()


class CounterEnvironment:
    """A TRL environment (``environment_factory``) that owns its reward: 1/0, whether ``increment`` was called."""

    def reset(self, **kwargs):
        self.count = 0

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count > 0)


class EchoEnvironment:
    """A TRL environment without a reward of its own: the trainer's ``reward_funcs`` score its rollouts."""

    def reset(self, **kwargs):
        return "Echo."

    def shout(self, text: str) -> str:
        """
        Shout the given text.

        Args:
            text: Text to shout.

        Returns:
            The text in upper case.
        """
        return text.upper()


def tool_tokenizer(model_dir):
    """The tiny model's tokenizer with TRL's Qwen2.5 chat template, which renders tool calls (TRL requires one)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def test_environments_route_a_dataset_without_prompts_as_in_trl(tmp_path, tiny_model_dir, monkeypatch):
    # With a dict environment_factory, a dataset may have only the `environment` column: each environment's reset()
    # gives the prompt. Both trainers build the same reward sources and tools from it.
    from datasets import Dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 4})
    factory = {"counter": CounterEnvironment, "echo": EchoEnvironment}
    built = []
    for cls, args in (
        (GRPOTrainer, config(tmp_path / "grpo", GRPOConfig)),
        (EGPOTrainer, config(tmp_path / "egpo", egpo_correctness_reward="parity01_reward")),
    ):
        trainer = cls(
            tiny_model_dir,
            parity01_reward,
            args,
            train_dataset=dataset,
            processing_class=tool_tokenizer(tiny_model_dir),
            environment_factory=factory,
        )
        built.append((trainer.reward_func_names, sorted(tool.__name__ for tool in trainer.tools)))
    assert built[0] == built[1] == (["parity01_reward", "CounterEnvironment"], ["increment", "shout"])

    # Two reward sources (a reward function and an environment's get_reward) and none named as the correctness
    # reward: refused with the names to choose from, as with several reward functions.
    with pytest.raises(ValueError, match="one of: parity01_reward, CounterEnvironment"):
        EGPOTrainer(
            tiny_model_dir,
            parity01_reward,
            config(tmp_path / "ambiguous"),
            train_dataset=dataset,
            processing_class=tool_tokenizer(tiny_model_dir),
            environment_factory=factory,
        )
    # Without an environment the dataset still needs its prompts.
    with pytest.raises(ValueError, match="train_dataset has no 'prompt' column"):
        EGPOTrainer(tiny_model_dir, parity01_reward, config(tmp_path / "plain"), train_dataset=dataset)


def test_reward_argument_counts_are_refused_by_trl_with_its_message(tmp_path, tiny_model_dir):
    # Two reward functions and no egpo_correctness_reward would be refused as ambiguous; when TRL refuses the reward
    # arguments themselves, TRL's message comes first, the same as GRPOTrainer's.
    funcs = [parity01_reward, length_reward]
    for kwargs, overrides in (
        ({"reward_processing_classes": [None]}, {}),
        ({}, {"reward_weights": [1.0, 0.5, 0.5]}),
    ):
        errors = []
        for cls, config_cls in ((GRPOTrainer, GRPOConfig), (EGPOTrainer, None)):
            with pytest.raises(ValueError, match="must match") as error:
                cls(
                    tiny_model_dir,
                    funcs,
                    config(tmp_path, config_cls, **overrides),
                    train_dataset=make_prompt_dataset(),
                    **kwargs,
                )
            errors.append(str(error.value))
        assert errors[0] == errors[1]


def missing_logprobs_rollout(prompts, trainer):
    """A ``rollout_func`` whose output lacks the ``logprobs`` that TRL requires."""
    ids = [trainer.processing_class.encode("7")] * len(prompts)
    return {"prompt_ids": ids, "completion_ids": ids}


def test_rollout_func_output_is_checked_by_trl(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = config(tmp_path, max_steps=1)
    trainer = EGPOTrainer(
        tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset(), rollout_func=missing_logprobs_rollout
    )
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer.train()

    # The same from a trainer built without __init__, as TRL's own unit tests build one.
    from types import SimpleNamespace

    bare = object.__new__(EGPOTrainer)
    bare.accelerator, bare.model, bare.state = trainer.accelerator, trainer.model, trainer.state
    bare.args = SimpleNamespace(report_to=[])
    bare.use_vllm, bare.processing_class, bare.rollout_func = False, trainer.processing_class, missing_logprobs_rollout
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        bare._generate([[{"role": "user", "content": "1 + 1?"}]])
