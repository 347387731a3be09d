"""The advantage math against hand-computed numbers from the paper's equations, and its invariants."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import A_MIXED, NAN, close, t
from hypothesis import given, settings
from hypothesis import strategies as st

from egpo_trl.advantages import (
    GROUP_ALL_CORRECT,
    GROUP_ALL_INCORRECT,
    GROUP_MIXED,
    GROUP_UNSCORED,
    egpo_advantages,
    get_advantage_estimator,
    grpo_advantages,
    sequence_entropy,
)


# ----------------------------------------------------------------------------- Eq. 5
def test_sequence_entropy_is_mean_nll_of_scored_tokens():
    logps = torch.tensor([[-0.5, -1.5, -9.0], [-2.0, -4.0, -6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    close(sequence_entropy(logps, mask), [1.0, 4.0])


def test_sequence_entropy_ignores_nan_and_inf_at_unscored_positions():
    logps = torch.tensor([[-1.0, NAN, -float("inf")]])
    close(sequence_entropy(logps, torch.tensor([[1, 0, 0]])), [1.0])


def test_sequence_entropy_of_empty_completion_is_nan():
    out = sequence_entropy(torch.zeros(2, 3), torch.tensor([[0, 0, 0], [1, 0, 0]]))
    assert math.isnan(out[0]) and out[1] == 0


def test_sequence_entropy_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        sequence_entropy(torch.zeros(2, 3), torch.ones(2, 4))


# ----------------------------------------------------------------------------- Eq. 8-12 by hand
# Group: rewards [+1, -1, +1, -1], entropies [2.0, 0.5, 0.2, 1.0]; mean H = 0.925
# raw w^ = 0.925 / H = [0.4625, 1.85, 4.625, 0.925]; clip to [0.8, 2.0] = [0.8, 1.85, 2.0, 0.925]
REWARDS = t(1, -1, 1, -1)
ENTROPIES = t(2.0, 0.5, 0.2, 1.0)
BASE = [A_MIXED, -A_MIXED, A_MIXED, -A_MIXED]


@pytest.mark.parametrize(
    ("clamp", "expected_weights"),
    [
        ("asymmetric", [1.0, 1.0, 2.0, 0.925]),  # Eq. 9: correct max(1, clip), incorrect min(1, clip)
        ("symmetric", [0.8, 1.85, 2.0, 0.925]),  # C1: clip only
        ("negative_only", [0.8, 1.0, 2.0, 0.925]),  # C2: only the incorrect side capped at 1
        ("positive_only", [1.0, 1.85, 2.0, 0.925]),  # C3: only the correct side floored at 1
        ("none", [1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_clamp_modes_by_hand(clamp, expected_weights):
    out = egpo_advantages(REWARDS, ENTROPIES, 4, clamp=clamp, entropy_eps=0.0 + 1e-9)
    close(out.raw_weights, [0.4625, 1.85, 4.625, 0.925])
    close(out.weights, expected_weights)
    close(out.base_advantages, BASE)
    close(out.advantages, [w * a for w, a in zip(expected_weights, BASE)])
    assert out.group_type.tolist() == [GROUP_MIXED] * 4


def test_renorm_after_clamp_c5_by_hand():
    # asymmetric weights [1, 1, 2, 0.925], mean 1.23125
    out = egpo_advantages(REWARDS, ENTROPIES, 4, renorm="after_clamp", entropy_eps=1e-9)
    expected = [w / 1.23125 for w in [1.0, 1.0, 2.0, 0.925]]
    close(out.weights, expected)
    close(out.weights.mean(), 1.0)


def test_renorm_before_clamp_c6_by_hand():
    # raw mean = 7.8625 / 4 = 1.965625; w^/mean = [0.23529, 0.94118, 2.35294, 0.47059]
    # clip -> [0.8, 0.94118, 2.0, 0.8]; asymmetric -> [1, 0.94118, 2.0, 0.8]
    out = egpo_advantages(REWARDS, ENTROPIES, 4, renorm="before_clamp", entropy_eps=1e-9)
    close(out.raw_weights, [0.4625 / 1.965625, 1.85 / 1.965625, 4.625 / 1.965625, 0.925 / 1.965625])
    close(out.weights, [1.0, 1.85 / 1.965625, 2.0, 0.8])


# Entirely-incorrect group, entropies [0.1, 0.2, 0.3, 0.4]: mean 0.25, raw [2.5, 1.25, 0.8333, 0.625]
# clip -> [2.0, 1.25, 0.8333, 0.8]; incorrect side min(1, .) -> [1, 1, 0.8333, 0.8]
def test_all_incorrect_group_gets_nsr_minus_one_times_weight():
    out = egpo_advantages(t(-1, -1, -1, -1), t(0.1, 0.2, 0.3, 0.4), 4, entropy_eps=1e-9)
    close(out.base_advantages, [-1.0] * 4)
    close(out.weights, [1.0, 1.0, 0.25 / 0.3, 0.8])
    close(out.advantages, [-1.0, -1.0, -0.25 / 0.3, -0.8])
    assert out.group_type.tolist() == [GROUP_ALL_INCORRECT] * 4


def test_nsr_unit_weighting_c4_locks_incorrect_group_weights_to_one():
    out = egpo_advantages(t(-1, -1, -1, -1), t(0.1, 0.2, 0.3, 0.4), 4, nsr_weighting="unit")
    close(out.weights, [1.0] * 4)
    close(out.advantages, [-1.0] * 4)


def test_nsr_off_gives_zero_on_all_incorrect_groups():
    out = egpo_advantages(t(-1, -1, -1, -1), t(0.1, 0.2, 0.3, 0.4), 4, nsr=False)
    close(out.advantages, [0.0] * 4)


def test_all_correct_group_is_skipped_but_keeps_its_weights():
    out = egpo_advantages(t(1, 1, 1, 1), t(0.1, 0.2, 0.3, 0.4), 4, entropy_eps=1e-9)
    close(out.weights, [2.0, 1.25, 1.0, 1.0])
    close(out.advantages, [0.0] * 4)
    assert out.group_type.tolist() == [GROUP_ALL_CORRECT] * 4


def test_several_groups_are_independent():
    rewards = torch.cat([REWARDS, t(-1, -1, -1, -1), t(1, 1, 1, 1)])
    entropies = torch.cat([ENTROPIES, t(0.1, 0.2, 0.3, 0.4), t(0.1, 0.2, 0.3, 0.4)])
    out = egpo_advantages(rewards, entropies, 4, entropy_eps=1e-9)
    close(out.advantages[:4], [w * a for w, a in zip([1.0, 1.0, 2.0, 0.925], BASE)])
    close(out.advantages[4:8], [-1.0, -1.0, -0.25 / 0.3, -0.8])
    close(out.advantages[8:], [0.0] * 4)


def test_entropy_eps_enters_the_denominator():
    out = egpo_advantages(t(1, -1), t(1.0, 1.0), 2, entropy_eps=0.25, clamp="symmetric", lambda_min=0.1)
    close(out.raw_weights, [1.0 / 1.25, 1.0 / 1.25])


# ----------------------------------------------------------------------------- edge cases
def test_nan_entropy_entry_is_invalid_weight_one_and_left_out_of_mean_and_renorm():
    # valid entropies [1, 0.5, 2]: mean 3.5/3; raw [., 1.1667, 2.3333, 0.5833]
    out = egpo_advantages(REWARDS, t(NAN, 1.0, 0.5, 2.0), 4, entropy_eps=1e-9)
    mean = 3.5 / 3
    close(out.raw_weights, [1.0, mean / 1.0, mean / 0.5, mean / 2.0])
    close(out.weights, [1.0, 1.0, 2.0, 0.8])
    renormed = egpo_advantages(REWARDS, t(NAN, 1.0, 0.5, 2.0), 4, entropy_eps=1e-9, renorm="after_clamp")
    close(renormed.weights, [1.0, 1.0 / (3.8 / 3), 2.0 / (3.8 / 3), 0.8 / (3.8 / 3)])


def test_group_without_valid_entropy_or_with_zero_mean_has_unit_raw_weights():
    out = egpo_advantages(torch.cat([REWARDS, REWARDS]), t(NAN, NAN, NAN, NAN, 0, 0, 0, 0), 4, clamp="symmetric")
    close(out.raw_weights, [1.0] * 8)
    close(out.weights, [1.0] * 8)
    close(out.advantages, BASE + BASE)


def test_infinite_entropy_is_invalid():
    out = egpo_advantages(REWARDS, t(float("inf"), 1.0, 1.0, 1.0), 4, clamp="symmetric")
    close(out.weights, [1.0] * 4)


def test_two_generations():
    # mean H 1.0; raw [2.0, 0.6667]; asymmetric [2.0, 0.8]; std of [1, -1] = sqrt(2)
    out = egpo_advantages(t(1, -1), t(0.5, 1.5), 2, entropy_eps=1e-9)
    a = 1.0 / (math.sqrt(2.0) + 1e-4)
    close(out.weights, [2.0, 0.8])
    close(out.advantages, [2.0 * a, -0.8 * a])


def test_zero_one_rewards_count_positive_as_correct():
    out = egpo_advantages(t(1, 0, 1, 0), t(1, 1, 1, 1), 4)
    assert out.correct.tolist() == [True, False, True, False]
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-4)
    close(out.base_advantages, [a, -a, a, -a])


def test_all_zero_rewards_are_all_incorrect():
    out = egpo_advantages(t(0, 0, 0, 0), t(1, 1, 1, 1), 4)
    assert out.group_type.tolist() == [GROUP_ALL_INCORRECT] * 4
    close(out.advantages, [-1.0] * 4)


def test_scale_rewards_none_is_reward_minus_mean():
    out = egpo_advantages(t(1, 0, 0, 0), t(1, 1, 1, 1), 4, scale_rewards="none")
    close(out.base_advantages, [0.75, -0.25, -0.25, -0.25])


def test_scale_rewards_batch_uses_the_batch_std():
    rewards = t(1, -1, 1, 1, 1, -1, -1, -1)
    out = egpo_advantages(rewards, torch.ones(8), 4, scale_rewards="batch", clamp="none", nsr=False)
    std = rewards.std()  # unbiased, over the whole batch
    close(out.base_advantages[:4], (t(1, -1, 1, 1) - 0.5) / (std + 1e-4))
    # NSR is -1, as under "group", whatever the batch std: with no correct completion (std 0) and with one in 1024.
    close(egpo_advantages(t(-1, -1, -1, -1), torch.ones(4), 2, scale_rewards="batch").base_advantages, [-1.0] * 4)
    rewards = torch.full((1024,), -1.0)
    rewards[0] = 1.0
    out = egpo_advantages(rewards, torch.ones(1024), 4, scale_rewards="batch")
    close(out.base_advantages[4:], [-1.0] * 1020)


def test_correct_override_decides_group_type_not_reward_sign():
    # Rewards all > 0 (accuracy -1 + bonus 2, say) but only the first is correct: mixed, not all-correct.
    out = egpo_advantages(t(2, 1, 1, 1), t(1, 1, 1, 1), 4, correct=torch.tensor([True, False, False, False]))
    assert out.group_type.tolist() == [GROUP_MIXED] * 4
    assert out.correct.tolist() == [True, False, False, False]
    assert out.advantages[0] > 0 > out.advantages[1]


def test_unscored_rows_get_zero_advantage_and_do_not_decide_group_type():
    out = egpo_advantages(t(1, NAN, 1, 1, NAN, NAN, NAN, NAN), torch.ones(8), 4)
    assert out.group_type.tolist() == [GROUP_ALL_CORRECT] * 4 + [GROUP_UNSCORED] * 4
    close(out.advantages, [0.0] * 8)
    close(out.weights, [1.0] * 8)


def test_one_group_and_one_generation():
    out = egpo_advantages(t(1.0), t(0.3), 1)
    close(out.advantages, [0.0])
    out = egpo_advantages(t(-1.0), t(0.3), 1)
    close(out.advantages, [-1.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clamp": "both"}, "clamp"),
        ({"renorm": "always"}, "renorm"),
        ({"nsr_weighting": "uniform"}, "nsr_weighting"),
        ({"scale_rewards": "global"}, "scale_rewards"),
        ({"lambda_min": 0.0}, "lambda_min"),
        ({"lambda_min": 2.5, "lambda_max": 2.0}, "lambda_min"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        egpo_advantages(REWARDS, ENTROPIES, 4, **kwargs)


def test_batch_that_does_not_divide_into_groups_raises_with_the_fix():
    with pytest.raises(ValueError, match="groups of num_generations=3"):
        egpo_advantages(REWARDS, ENTROPIES, 3)
    with pytest.raises(ValueError, match="entropies must have the shape"):
        egpo_advantages(REWARDS, ENTROPIES[:3], 4)


def test_registry_lookup():
    assert get_advantage_estimator("egpo") is egpo_advantages
    assert get_advantage_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match="expected one of"):
        get_advantage_estimator("ppo")


# ----------------------------------------------------------------------------- invariants (hypothesis)
@st.composite
def batches(draw):
    n = draw(st.integers(min_value=2, max_value=16))
    g = draw(st.integers(min_value=1, max_value=6))
    rewards = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n * g, max_size=n * g))
    entropies = draw(
        st.lists(st.floats(min_value=1e-3, max_value=5.0, allow_nan=False), min_size=n * g, max_size=n * g)
    )
    return torch.tensor(rewards), torch.tensor(entropies), n


@settings(max_examples=200, deadline=None)
@given(batches())
def test_asymmetric_clamp_never_downweights_correct_nor_upweights_incorrect(batch):
    rewards, entropies, n = batch
    out = egpo_advantages(rewards, entropies, n)
    assert (out.weights[out.correct] >= 1.0).all()
    assert (out.weights[~out.correct] <= 1.0).all()
    assert (out.weights >= 0.8 - 1e-6).all() and (out.weights <= 2.0 + 1e-6).all()


@settings(max_examples=200, deadline=None)
@given(batches())
def test_renorm_after_clamp_keeps_group_mean_weight_one(batch):
    rewards, entropies, n = batch
    out = egpo_advantages(rewards, entropies, n, renorm="after_clamp")
    torch.testing.assert_close(out.weights.view(-1, n).mean(dim=1), torch.ones(rewards.numel() // n))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_advantage_signs_follow_group_type(batch):
    rewards, entropies, n = batch
    out = egpo_advantages(rewards, entropies, n)
    mixed = out.group_type == GROUP_MIXED
    assert (out.advantages[mixed & out.correct] > 0).all()
    assert (out.advantages[mixed & ~out.correct] < 0).all()
    assert (out.advantages[out.group_type == GROUP_ALL_CORRECT] == 0).all()
    assert (out.advantages[out.group_type == GROUP_ALL_INCORRECT] < 0).all()


@settings(max_examples=100, deadline=None)
@given(batches())
def test_egpo_switched_off_is_grpo(batch):
    rewards, entropies, n = batch
    egpo = egpo_advantages(rewards, entropies, n, clamp="none", nsr=False)
    grpo = grpo_advantages(rewards, entropies, n)
    torch.testing.assert_close(egpo.advantages, grpo.advantages, rtol=0, atol=0)


@settings(max_examples=100, deadline=None)
@given(batches(), st.floats(min_value=0.1, max_value=10.0))
def test_weights_depend_only_on_relative_entropy(batch, scale):
    rewards, entropies, n = batch
    a = egpo_advantages(rewards, entropies, n, entropy_eps=1e-12)
    b = egpo_advantages(rewards, entropies * scale, n, entropy_eps=1e-12)
    torch.testing.assert_close(a.weights, b.weights, rtol=1e-4, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_permuting_a_group_permutes_its_advantages(batch, rng):
    rewards, entropies, n = batch
    perm = torch.tensor(rng.sample(range(n), n))
    full = torch.cat([perm + k * n for k in range(rewards.numel() // n)])
    a = egpo_advantages(rewards, entropies, n)
    b = egpo_advantages(rewards[full], entropies[full], n)
    torch.testing.assert_close(a.advantages[full], b.advantages, rtol=1e-5, atol=1e-6)


def test_a_row_without_a_verdict_does_not_type_its_group_nor_get_a_clamped_weight():
    nan = float("nan")
    rewards = t(1.0, -1.0, 0.5, -1.0, -1.0, 0.5, -1.0, -1.0)
    correct = t(1.0, 0.0, nan, 0.0, 0.0, nan, 0.0, 0.0)
    entropies = t(0.2, 0.4, 3.0, 0.6, 0.2, 3.0, 0.4, 0.6)
    out = egpo_advantages(rewards, entropies, 4, correct=correct)
    # Group 1 is mixed (one correct, two incorrect verdicts); group 2 entirely incorrect by its verdicts.
    assert out.group_type.tolist() == [1] * 4 + [0] * 4
    assert out.correct.tolist() == [True, False, False, False, False, False, False, False]
    assert out.weights[2] == 1 and out.weights[5] == 1  # neither side of the clamp
    assert out.base_advantages[5] == 0  # no NSR advantage without a verdict
    close(out.base_advantages[[4, 6, 7]], [-1.0, -1.0, -1.0])
    # Its reward still enters the mixed group's GRPO advantage, as a row with a verdict would.
    r = rewards[:4]
    close(out.base_advantages[2], ((r[2] - r.mean()) / (r.std() + 1e-4)).item())
    # The same rows with a bool verdict (no row left without one) type the groups as before.
    judged = egpo_advantages(rewards, entropies, 4, correct=torch.nan_to_num(correct, nan=0.0) > 0)
    assert judged.group_type.tolist() == [1] * 4 + [0] * 4 and judged.base_advantages[5] == -1
