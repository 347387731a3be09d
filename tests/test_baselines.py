"""The baselines' estimators against hand-computed numbers from their papers' equations, and their settings.

NSR: Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning".
EDGE-GRPO: Zhang et al. 2025, arXiv 2507.21848 (entropy-driven advantage).
DAPO: Yu et al. 2025 (soft overlong punishment, Eq. 13).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from conftest import A_MIXED, NAN, close, t
from hypothesis import given, settings
from hypothesis import strategies as st

from egpo_trl import EGPOConfig
from egpo_trl.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ALL_CORRECT,
    GROUP_ALL_INCORRECT,
    GROUP_MIXED,
    AdvantageOutput,
    edge_grpo_advantages,
    entropy_input,
    get_advantage_estimator,
    get_entropy_input,
    grpo_advantages,
    nsr_advantages,
    register_advantage_estimator,
    sequence_mean,
)
from egpo_trl.rewards import make_overlong_penalty_reward


# ----------------------------------------------------------------------------- registry
def test_every_method_is_registered_with_the_entropy_it_reads():
    assert set(ADVANTAGE_ESTIMATORS) >= {"egpo", "grpo", "nsr", "edge_grpo"}
    assert get_advantage_estimator("nsr") is nsr_advantages
    assert get_advantage_estimator("edge_grpo") is edge_grpo_advantages
    reads = {name: get_entropy_input(get_advantage_estimator(name)) for name in ("egpo", "grpo", "nsr", "edge_grpo")}
    assert reads == {"egpo": "nll", "grpo": "none", "nsr": "none", "edge_grpo": "shannon"}


def test_adding_an_estimator_is_one_function_and_one_registry_line():
    @register_advantage_estimator("test_sign_only")
    @entropy_input("none")
    def sign_only(rewards, entropies, num_generations, *, correct=None, **_):
        signs = torch.sign(rewards)
        ones = torch.ones_like(rewards)
        group_type = torch.full_like(rewards, GROUP_MIXED, dtype=torch.long)
        return AdvantageOutput(signs, ones, signs, ones, group_type, rewards > 0)

    try:
        assert get_advantage_estimator("test_sign_only") is sign_only
        assert get_entropy_input(sign_only) == "none"
        assert EGPOConfig(output_dir="unused", report_to=[], use_cpu=True, advantage_estimator="test_sign_only")
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_sign_only")(lambda *a, **k: None)
    finally:
        del ADVANTAGE_ESTIMATORS["test_sign_only"]


def test_entropy_input_refuses_unknown_kinds():
    with pytest.raises(ValueError, match="Unknown entropy input"):
        entropy_input("renyi")


# ----------------------------------------------------------------------------- NSR
# NSR objective: A_i = -1 on incorrect completions, 0 on correct ones, no group baseline.
def test_nsr_penalises_every_incorrect_completion_whatever_its_group():
    rewards = t(1, -1, -1, 1, -1, -1, -1, -1, 1, 1, 1, 1)
    out = nsr_advantages(rewards, None, 4)
    close(out.advantages, [0, -1, -1, 0, -1, -1, -1, -1, 0, 0, 0, 0])
    close(out.weights, [1.0] * 12)
    assert out.group_type.tolist() == [GROUP_MIXED] * 4 + [GROUP_ALL_INCORRECT] * 4 + [GROUP_ALL_CORRECT] * 4


def test_weighted_reinforce_gives_correct_completions_lambda():
    out = nsr_advantages(t(1, -1, 1, 1), None, 4, positive_weight=0.1)
    close(out.advantages, [0.1, -1.0, 0.1, 0.1])


def test_nsr_reads_correctness_not_the_shaped_reward_and_skips_unscored_rows():
    # Accuracy +1 plus a length penalty -1.5 sums to -0.5, yet the completion is correct: no penalty.
    out = nsr_advantages(t(-0.5, -1.0, NAN, 0.5), None, 4, correct=torch.tensor([True, False, False, True]))
    close(out.advantages, [0.0, -1.0, 0.0, 0.0])


def test_nsr_with_zero_one_rewards():
    close(nsr_advantages(t(1, 0, 0, 1), None, 2).advantages, [0, -1, -1, 0])


def test_nsr_refuses_a_negative_positive_weight():
    with pytest.raises(ValueError, match="positive_weight"):
        nsr_advantages(t(1, -1), None, 2, positive_weight=-0.1)


# ----------------------------------------------------------------------------- EDGE-GRPO
# Group: rewards [+1, -1, +1, -1], Shannon entropies P = [2.0, 0.5, 0.2, 1.0]; mean P = 0.925.
# EDA: A^_i = A_i * mean(P) / P_i, weights [0.4625, 1.85, 4.625, 0.925].
REWARDS = t(1, -1, 1, -1)
P = t(2.0, 0.5, 0.2, 1.0)
EDA_WEIGHTS = [0.4625, 1.85, 4.625, 0.925]


def test_edge_grpo_scales_grpo_advantages_by_mean_entropy_over_entropy():
    out = edge_grpo_advantages(REWARDS, P, 4, entropy_eps=0.0)
    close(out.weights, EDA_WEIGHTS)
    close(out.raw_weights, EDA_WEIGHTS)
    close(out.base_advantages, [A_MIXED, -A_MIXED, A_MIXED, -A_MIXED])
    close(out.advantages, [w * a for w, a in zip(EDA_WEIGHTS, [A_MIXED, -A_MIXED, A_MIXED, -A_MIXED])])


def test_edge_grpo_has_no_clamp_nor_asymmetry():
    # A confident incorrect completion (low entropy) is pushed down harder than an uncertain one: unlike EGPO.
    out = edge_grpo_advantages(REWARDS, P, 4, entropy_eps=0.0)
    assert out.advantages[1] < out.advantages[3] < 0
    assert out.weights.max() > 2.0 and out.weights.min() < 0.8


def test_edge_grpo_batch_normalisation_uses_the_batch_mean():
    # Second group: P = [1, 1, 1, 1]; batch mean = (3.7 + 4) / 8 = 0.9625.
    rewards = torch.cat([REWARDS, REWARDS])
    entropies = torch.cat([P, torch.ones(4)])
    group = edge_grpo_advantages(rewards, entropies, 4, entropy_eps=0.0)
    batch = edge_grpo_advantages(rewards, entropies, 4, entropy_eps=0.0, entropy_normalization="batch")
    close(group.weights, EDA_WEIGHTS + [1.0] * 4)
    close(batch.weights, [0.9625 / p for p in [2.0, 0.5, 0.2, 1.0]] + [0.9625] * 4)


def test_edge_grpo_keeps_uniform_groups_at_zero():
    out = edge_grpo_advantages(t(1, 1, 1, 1, -1, -1, -1, -1), torch.cat([P, P]), 4)
    close(out.advantages, [0.0] * 8)


def test_edge_grpo_invalid_entropies_keep_weight_one_and_leave_the_mean():
    # valid P = [0.5, 0.2, 1.0]: mean 1.7 / 3
    out = edge_grpo_advantages(REWARDS, t(NAN, 0.5, 0.2, 1.0), 4, entropy_eps=0.0)
    mean = 1.7 / 3
    close(out.weights, [1.0, mean / 0.5, mean / 0.2, mean / 1.0])
    close(edge_grpo_advantages(REWARDS, torch.zeros(4), 4).weights, [1.0] * 4)


def test_edge_grpo_entropy_eps_enters_the_denominator():
    out = edge_grpo_advantages(t(1, -1), t(1.0, 1.0), 2, entropy_eps=0.25)
    close(out.weights, [0.8, 0.8])


def test_edge_grpo_follows_scale_rewards():
    out = edge_grpo_advantages(t(1, 0, 0, 0), torch.ones(4), 4, scale_rewards="none")
    close(out.advantages, [0.75, -0.25, -0.25, -0.25])


def test_edge_grpo_refuses_an_unknown_normalisation():
    with pytest.raises(ValueError, match="entropy_normalization"):
        edge_grpo_advantages(REWARDS, P, 4, entropy_normalization="global")


@st.composite
def batches(draw):
    n = draw(st.integers(min_value=2, max_value=8))
    g = draw(st.integers(min_value=1, max_value=4))
    rewards = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n * g, max_size=n * g))
    entropies = draw(st.lists(st.floats(min_value=1e-2, max_value=5.0), min_size=n * g, max_size=n * g))
    return torch.tensor(rewards), torch.tensor(entropies), n


@settings(max_examples=100, deadline=None)
@given(batches(), st.floats(min_value=0.1, max_value=10.0))
def test_edge_grpo_is_grpo_when_entropies_are_equal_and_keeps_the_sign(batch, level):
    rewards, entropies, n = batch
    grpo = grpo_advantages(rewards, None, n)
    flat = edge_grpo_advantages(rewards, torch.full_like(entropies, level), n, entropy_eps=0.0)
    torch.testing.assert_close(flat.advantages, grpo.advantages, rtol=1e-6, atol=1e-6)
    edge = edge_grpo_advantages(rewards, entropies, n)
    assert torch.equal(torch.sign(edge.advantages), torch.sign(grpo.advantages))


def test_sequence_mean_averages_scored_tokens_only():
    values = torch.tensor([[1.0, 3.0, NAN], [2.0, 4.0, 6.0]])
    close(sequence_mean(values, torch.tensor([[1, 1, 0], [1, 1, 1]])), [2.0, 4.0])
    assert math.isnan(sequence_mean(torch.ones(1, 2), torch.zeros(1, 2))[0])


# ----------------------------------------------------------------------------- DAPO overlong punishment
@pytest.mark.parametrize(
    ("length", "expected"), [(50, 0.0), (80, 0.0), (85, -0.25), (90, -0.5), (100, -1.0), (130, -1.0)]
)
def test_soft_overlong_punishment_by_hand(length, expected):
    # L_max = 100, L_cache = 20: 0 up to 80 tokens, then ((100 - 20) - |y|) / 20 down to -1.
    reward = make_overlong_penalty_reward(max_length=100, buffer_length=20)
    assert reward(["a"], completion_ids=[[1] * length]) == [pytest.approx(expected)]
    half = make_overlong_penalty_reward(100, 20, penalty_factor=0.5)
    assert half(["a"], completion_ids=[[1] * length]) == [pytest.approx(expected * 0.5)]


def test_overlong_penalty_reward_is_named_and_checks_its_inputs():
    reward = make_overlong_penalty_reward(max_length=10, buffer_length=4)
    assert reward.__name__ == "overlong_penalty"
    with pytest.raises(ValueError, match="completion_ids"):
        reward(["a"])
    with pytest.raises(ValueError, match="buffer_length"):
        make_overlong_penalty_reward(max_length=10, buffer_length=11)


# ----------------------------------------------------------------------------- config
def make(tmp_path, **kwargs):
    return EGPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)


def test_baseline_defaults(tmp_path):
    config = make(tmp_path)
    assert config.dynamic_sampling is False and config.dynamic_sampling_max_rounds == 10
    assert config.dynamic_sampling_metric == "correctness" and config.overlong_buffer_length is None
    assert config.nsr_positive_weight == 0.0 and config.edge_grpo_entropy_normalization == "group"
    assert config.edge_gec is False and config.egpo_entropy_metrics is True
    assert (config.edge_gec_reflect_prob, config.edge_gec_answer_prob, config.edge_gec_solution_prob) == (
        0.5,
        0.25,
        0.25,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"advantage_estimator": "dapo"}, "advantage_estimator='dapo' is not supported"),
        ({"max_steps": 0}, "max_steps=0 is not a length"),
        ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds must be an integer >= 1"),
        ({"dynamic_sampling_metric": "acc"}, "dynamic_sampling_metric='acc'"),
        ({"overlong_buffer_length": 0}, "overlong_buffer_length must be an integer >= 1"),
        ({"overlong_buffer_length": 400, "max_completion_length": 256}, "longer than max_completion_length"),
        ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor must be a number >= 0"),
        ({"nsr_positive_weight": -0.1}, "nsr_positive_weight must be a number >= 0"),
        ({"edge_grpo_entropy_normalization": "global"}, "edge_grpo_entropy_normalization='global'"),
        ({"edge_gec_scope": "all"}, "edge_gec_scope='all'"),
        ({"edge_gec_reflect_prob": 1.5}, r"edge_gec_reflect_prob must be a number in \[0.0, 1.0\]"),
        ({"edge_gec_reflect_prob": 0.6, "edge_gec_answer_prob": 0.6}, "sum to at most 1"),
        ({"edge_gec_answer_template": "the answer is"}, "must contain '{answer}'"),
        # the placeholder as the box's content loses the box's braces: "\\boxed13", which no reward reads
        ({"edge_gec_answer_template": "The answer is \\boxed{answer}."}, "whose last box does not hold the answer"),
        ({"advantage_estimator": "nsr", "multi_objective_aggregation": "normalize_then_sum"}, "sum_then_normalize"),
    ],
)
def test_bad_baseline_settings_are_refused_with_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kwargs)


@pytest.mark.parametrize("template", [" The answer is \\boxed{{answer}}.", " So the answer is {answer}."])
def test_answer_templates_that_give_the_answer_are_accepted(tmp_path, template):
    assert make(tmp_path, edge_gec_answer_template=template).edge_gec_answer_template == template


# ----------------------------------------------------------------------------- recipes
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
METHOD_PREFIXES = ("advantage_estimator", "egpo_", "nsr_", "edge_", "dynamic_sampling", "overlong_")
METHOD_FIELDS = {"loss_type", "epsilon", "epsilon_high", "output_dir"}


@pytest.mark.parametrize("method", ["grpo", "dapo", "edge_grpo", "nsr"])
def test_baseline_recipes_differ_from_the_egpo_recipe_only_in_the_method(tmp_path, method):
    import yaml

    egpo = yaml.safe_load((RECIPES / "demo_tiny_cpu.yaml").read_text())
    baseline = yaml.safe_load((RECIPES / f"tiny_cpu_{method}.yaml").read_text())

    def shared(recipe):
        return {k: v for k, v in recipe.items() if not k.startswith(METHOD_PREFIXES) and k not in METHOD_FIELDS}

    assert shared(baseline) == shared(egpo)
    assert baseline["advantage_estimator"] == {"dapo": "grpo"}.get(method, method)
    fields = {f.name for f in dataclasses.fields(EGPOConfig)}
    method_keys = {k: v for k, v in baseline.items() if k in fields and k not in shared(baseline)}
    method_keys.pop("output_dir")
    config = make(tmp_path, max_completion_length=baseline["max_completion_length"], **method_keys)
    assert config.advantage_estimator == baseline["advantage_estimator"]
