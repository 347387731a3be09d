"""Advantage estimators, registered by name: each takes ``(rewards[B], entropies[B] | None, num_generations, *,
correct=None, **options)``, rows in consecutive groups of ``num_generations``, and returns an :class:`AdvantageOutput`.
Equation numbers are the EGPO paper's."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from trl.trainer.utils import nanstd

CLAMP_MODES: tuple[str, ...] = ("asymmetric", "symmetric", "negative_only", "positive_only", "none")
RENORM_MODES: tuple[str, ...] = ("none", "after_clamp", "before_clamp")
NSR_WEIGHTINGS: tuple[str, ...] = ("entropy", "unit")
SCALE_REWARDS_MODES: tuple[str, ...] = ("group", "batch", "none")
ENTROPY_INPUTS: tuple[str, ...] = ("nll", "shannon", "none")
ENTROPY_NORMALIZATIONS: tuple[str, ...] = ("group", "batch")
_CHOICES = dict(
    clamp=CLAMP_MODES, renorm=RENORM_MODES, nsr_weighting=NSR_WEIGHTINGS, scale_rewards=SCALE_REWARDS_MODES
)
_CHOICES["entropy_normalization"] = ENTROPY_NORMALIZATIONS

# Group types, one per row: no verdict in the group, entirely incorrect, mixed, entirely correct.
GROUP_UNSCORED, GROUP_ALL_INCORRECT, GROUP_MIXED, GROUP_ALL_CORRECT = -1, 0, 1, 2
STD_EPS = 1e-4  # what TRL's GRPOTrainer adds to the std


class AdvantageOutput(NamedTuple):
    r"""``Tensor[B]`` each: ``advantages`` :math:`w_i A_i`, ``weights`` :math:`w_i`, ``base_advantages`` :math:`A_i`,
    ``raw_weights`` :math:`\hat w_i` (unclamped), ``group_type`` (``GROUP_*``) and ``correct`` (bool)."""

    advantages: torch.Tensor
    weights: torch.Tensor
    base_advantages: torch.Tensor
    raw_weights: torch.Tensor
    group_type: torch.Tensor
    correct: torch.Tensor


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]`` float32 mean over the tokens ``mask`` marks (others ignored, even NaN); NaN for a row without
    one."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape.")
    scored = mask.bool()
    return torch.where(scored, values.float(), 0.0).sum(dim=-1) / scored.sum(dim=-1).float()


def sequence_entropy(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Eq. 5, :math:`H_i = -\frac{1}{T_i}\sum_t \log\pi_{old}(y_t)` over the scored tokens: ``[B, T] -> [B]``."""
    return sequence_mean(-per_token_logps.float(), mask)


def _check(rewards: torch.Tensor, num_generations: int, choices: dict | None = None, **tensors) -> None:
    """Refuse a batch not in groups of ``num_generations``, a tensor shaped unlike ``rewards``, an unknown option."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got shape {tuple(rewards.shape)}.")
    if not isinstance(num_generations, int) or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not divide into groups of num_generations={num_generations}.")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != rewards.shape:
            raise ValueError(
                f"{name} must have the shape of rewards {tuple(rewards.shape)}, got {tuple(tensor.shape)}."
            )
    for name, value in (choices or {}).items():
        if value not in _CHOICES[name]:
            raise ValueError(f"Unknown {name} {value!r}; expected one of {_CHOICES[name]}.")


def _verdicts(r: torch.Tensor, correct: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[G, N]`` masks of the rows with a verdict and of the correct ones (``reward > 0`` unless ``correct`` says; NaN:
    no verdict), and the ``[G, 1]`` group type."""
    judged = ~torch.isnan(r)
    if correct is None:
        is_correct = r > 0
    else:
        correct = correct.view(r.shape)
        if correct.is_floating_point():
            judged = judged & ~torch.isnan(correct)
        is_correct = judged & (correct > 0)
    has_correct = is_correct.any(dim=1, keepdim=True)
    has_incorrect = (judged & ~is_correct).any(dim=1, keepdim=True)
    group_type = torch.full_like(has_correct, GROUP_UNSCORED, dtype=torch.long)
    group_type[has_incorrect] = GROUP_ALL_INCORRECT
    group_type[has_correct] = GROUP_ALL_CORRECT
    group_type[has_correct & has_incorrect] = GROUP_MIXED
    return judged, is_correct, group_type


def _grpo(r: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """Eq. 2, GRPO's advantages of ``r[G, N]`` op for op as TRL's GRPOTrainer (NaN left in)."""
    centered = r - torch.nanmean(r, dim=1, keepdim=True)
    if scale_rewards == "none":
        return centered
    if scale_rewards == "batch":
        std = nanstd(r.reshape(-1)) if r.numel() > 1 else r.new_zeros(())
    else:
        std = nanstd(r, dim=1, keepdim=True) if r.size(1) > 1 else r.new_zeros(r.size(0), 1)
    return centered / (std + STD_EPS)


def _group_mean(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the valid entries of each row of ``values[G, N]``, and their count."""
    count = valid.sum(dim=1, keepdim=True)
    return torch.where(valid, values, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1), count


def _output(advantages, weights, base, raw, group_type, is_correct) -> AdvantageOutput:
    n = is_correct.size(1)
    flat = (t.reshape(-1) for t in (advantages, weights, base, raw, group_type.expand(-1, n), is_correct))
    return AdvantageOutput(*flat)


AdvantageEstimator = Callable[..., AdvantageOutput]


def entropy_input(kind: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Declare the entropy an estimator reads: ``"nll"`` (Eq. 5, the default), ``"shannon"`` or ``"none"``."""
    if kind not in ENTROPY_INPUTS:
        raise ValueError(f"Unknown entropy input {kind!r}; expected one of {ENTROPY_INPUTS}.")

    def decorator(func: AdvantageEstimator) -> AdvantageEstimator:
        func.entropy_input = kind
        return func

    return decorator


def get_entropy_input(estimator: AdvantageEstimator) -> str:
    """The entropy ``estimator`` reads (see :func:`entropy_input`)."""
    return getattr(estimator, "entropy_input", "nll")


@entropy_input("nll")
def egpo_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor,
    num_generations: int,
    *,
    lambda_min: float = 0.8,
    lambda_max: float = 2.0,
    entropy_eps: float = 1e-6,
    clamp: str = "asymmetric",
    renorm: str = "none",
    nsr: bool = True,
    nsr_weighting: str = "entropy",
    scale_rewards: str = "group",
    correct: torch.Tensor | None = None,
    nsr_scale: float = 1.0,
    group_advantages: torch.Tensor | None = None,
) -> AdvantageOutput:
    r"""EGPO's calibrated advantages :math:`\tilde A_i = w_i A_i` (Eq. 8-12): weights :math:`\bar H / (H_i +
    \varepsilon)` over a group's valid entries, clamped by ``clamp`` (Eq. 9; C1-C3) and renormalised by ``renorm``
    (C5, C6); base advantages 0 on entirely-correct groups, GRPO's on mixed ones, -1 (NSR) on entirely-incorrect ones.
    Rows without a verdict get no NSR and weight 1."""
    options = {"clamp": clamp, "renorm": renorm, "nsr_weighting": nsr_weighting, "scale_rewards": scale_rewards}
    _check(rewards, num_generations, options, entropies=entropies, correct=correct, group_advantages=group_advantages)
    if not 0 < lambda_min <= lambda_max:
        raise ValueError(f"Need 0 < lambda_min <= lambda_max, got lambda_min={lambda_min}, lambda_max={lambda_max}.")
    n = num_generations
    r = rewards.detach().float().view(-1, n)
    judged, is_correct, group_type = _verdicts(r, correct)
    mixed, all_incorrect = group_type == GROUP_MIXED, group_type == GROUP_ALL_INCORRECT

    # Eq. 11: the base advantage.
    grpo = _grpo(r, scale_rewards) if group_advantages is None else group_advantages.detach().float().view(-1, n)
    base = torch.where(mixed, grpo.nan_to_num(nan=0.0), 0.0)
    if nsr:
        base = torch.where(all_incorrect & judged, -float(nsr_scale) if scale_rewards == "none" else -1.0, base)

    # Eq. 8: raw weights over the valid entries.
    h = entropies.detach().float().view(-1, n)
    valid = torch.isfinite(h) & ~torch.isnan(r)
    mean_h, count = _group_mean(h, valid)
    valid = valid & (count > 0) & (mean_h != 0)
    raw = torch.where(valid, mean_h / (h + entropy_eps), 1.0)
    if renorm == "before_clamp":  # C6
        raw = torch.where(valid, raw / _group_mean(raw, valid)[0], raw)

    # Eq. 9 and C1-C3: the correct side floored at 1, the incorrect side capped at 1.
    clipped = raw.clamp(min=lambda_min, max=lambda_max)
    floored = clipped.clamp(min=1.0) if clamp in ("asymmetric", "positive_only") else clipped
    capped = clipped.clamp(max=1.0) if clamp in ("asymmetric", "negative_only") else clipped
    weights = torch.where(is_correct, floored, capped) if clamp != "none" else torch.ones_like(raw)
    weights = torch.where(valid, weights, 1.0)
    if renorm == "after_clamp":  # C5, Eq. 10
        weights = torch.where(valid, weights / _group_mean(weights, valid)[0], weights)
    if nsr_weighting == "unit":  # C4
        weights = torch.where(all_incorrect, 1.0, weights)
    weights = torch.where(judged, weights, 1.0)
    return _output(weights * base, weights, base, raw, group_type, is_correct)


@entropy_input("none")
def grpo_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor | None,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    correct: torch.Tensor | None = None,
    group_advantages: torch.Tensor | None = None,
    **_: object,
) -> AdvantageOutput:
    """Eq. 2, GRPO's advantages exactly as TRL's GRPOTrainer computes them (or ``group_advantages``, TRL's
    ``normalize_then_sum``), weights 1; unscored rows get 0."""
    options = {"scale_rewards": scale_rewards}
    _check(rewards, num_generations, options, correct=correct, group_advantages=group_advantages)
    r = rewards.detach().float().view(-1, num_generations)
    advantages = _grpo(r, scale_rewards) if group_advantages is None else group_advantages.detach().float()
    advantages = advantages.nan_to_num(nan=0.0)
    _, is_correct, group_type = _verdicts(r, correct)
    ones = torch.ones_like(r)
    return _output(advantages, ones, advantages, ones, group_type, is_correct)


@entropy_input("none")
def nsr_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor | None,
    num_generations: int,
    *,
    positive_weight: float = 0.0,
    correct: torch.Tensor | None = None,
    **_: object,
) -> AdvantageOutput:
    """Negative sample reinforcement (Zhu et al. 2025): -1 on incorrect completions, ``positive_weight`` on correct ones
    (0: NSR, 0.1: Weighted-REINFORCE), 0 without a verdict."""
    _check(rewards, num_generations, correct=correct)
    if not isinstance(positive_weight, (int, float)) or isinstance(positive_weight, bool) or positive_weight < 0:
        raise ValueError(
            f"positive_weight must be a number >= 0 (0 is NSR, 0.1 Weighted-REINFORCE), got {positive_weight!r}."
        )
    r = rewards.detach().float().view(-1, num_generations)
    judged, is_correct, group_type = _verdicts(r, correct)
    advantages = torch.where(judged, torch.where(is_correct, float(positive_weight), -1.0), 0.0)
    ones = torch.ones_like(r)
    return _output(advantages, ones, advantages, ones, group_type, is_correct)


@entropy_input("shannon")
def edge_grpo_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor,
    num_generations: int,
    *,
    entropy_normalization: str = "group",
    entropy_eps: float = 1e-6,
    scale_rewards: str = "group",
    correct: torch.Tensor | None = None,
    group_advantages: torch.Tensor | None = None,
    **_: object,
) -> AdvantageOutput:
    r"""EDGE-GRPO's advantage :math:`A_i \bar P / (P_i + \varepsilon)`: GRPO's :math:`A_i`, :math:`P_i` the mean Shannon
    token entropy, :math:`\bar P` its mean over the group or the batch (``entropy_normalization``)."""
    options = {"entropy_normalization": entropy_normalization}
    _check(rewards, num_generations, options, entropies=entropies, correct=correct)
    base = grpo_advantages(
        rewards, None, num_generations, scale_rewards=scale_rewards, correct=correct, group_advantages=group_advantages
    )
    n = num_generations
    p = entropies.float().view(-1, n)
    valid = torch.isfinite(p) & ~torch.isnan(rewards.float().view(-1, n))
    if entropy_normalization == "group":
        mean_p, count = _group_mean(p, valid)
    else:
        mean_p, count = _group_mean(p.reshape(1, -1), valid.reshape(1, -1))
    valid = valid & (count > 0) & (mean_p != 0)
    weights = torch.where(valid, mean_p / (p.nan_to_num(nan=0.0) + entropy_eps), 1.0).view(-1)
    return base._replace(advantages=weights * base.advantages, weights=weights, raw_weights=weights)


def weighted_reward_sum(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """``[B, K] -> [B]``: the weighted sum as GRPOTrainer forms it (NaN where no function scored the completion)."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def normalize_then_sum_rewards(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """``[B, K] -> [B]``: each function's rewards normalised in the group, then summed with ``reward_weights``, as
    GRPOTrainer under ``multi_objective_aggregation="normalize_then_sum"``."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + STD_EPS)).view(rewards_per_func.shape)
    rewards = (reward_k * reward_weights.to(reward_k.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """``[B, K] -> [B]``: GRPO's advantages under ``normalize_then_sum`` op for op as GRPOTrainer (0: unscored)."""
    rewards_per_func = rewards_per_func.detach().float()
    if rewards_per_func.dim() != 2 or rewards_per_func.size(1) != reward_weights.numel():
        raise ValueError(
            f"rewards_per_func must be [B, {reward_weights.numel()}], got {tuple(rewards_per_func.shape)}."
        )
    rewards = normalize_then_sum_rewards(rewards_per_func, reward_weights, num_generations)
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return ((rewards - torch.nanmean(rewards)) / (std + STD_EPS)).nan_to_num(nan=0.0)


# Estimators whose group types need a binary correctness verdict (read by egpo_trl.correctness).
egpo_advantages.binary_correctness = True
nsr_advantages.binary_correctness = True

ADVANTAGE_ESTIMATORS = dict(
    egpo=egpo_advantages, grpo=grpo_advantages, nsr=nsr_advantages, edge_grpo=edge_grpo_advantages
)


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that registers an estimator under ``name`` (refuses to replace another one)."""

    def decorator(func: AdvantageEstimator) -> AdvantageEstimator:
        if ADVANTAGE_ESTIMATORS.get(name, func) is not func:
            raise ValueError(f"An advantage estimator named {name!r} is already registered.")
        ADVANTAGE_ESTIMATORS[name] = func
        return func

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator {name!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)}.")
    return ADVANTAGE_ESTIMATORS[name]
