r"""Advantage estimators: one vectorised function per method, registered by name.

Rows are laid out as TRL lays them out: consecutive groups of ``num_generations`` completions of one prompt.
Every estimator takes ``(rewards[B], entropies[B] | None, num_generations, *, correct=None, **options)`` and returns
an :class:`AdvantageOutput`. Equations refer to the EGPO paper ("Know What You Know: Metacognitive Entropy
Calibration for Verifiable RL Reasoning"): Eq. 5 :func:`sequence_entropy`, Eq. 8-12 :func:`egpo_advantages`.
Baselines: :func:`grpo_advantages` (TRL's GRPO, also DAPO's), :func:`nsr_advantages` (Zhu et al. 2025) and
:func:`edge_grpo_advantages` (Zhang et al. 2025, arXiv 2507.21848).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

CLAMP_MODES: tuple[str, ...] = ("asymmetric", "symmetric", "negative_only", "positive_only", "none")
RENORM_MODES: tuple[str, ...] = ("none", "after_clamp", "before_clamp")
NSR_WEIGHTINGS: tuple[str, ...] = ("entropy", "unit")
SCALE_REWARDS_MODES: tuple[str, ...] = ("group", "batch", "none")
ENTROPY_INPUTS: tuple[str, ...] = ("nll", "shannon", "none")
ENTROPY_NORMALIZATIONS: tuple[str, ...] = ("group", "batch")

# Group types, one per row (every row of a group carries its group's type).
GROUP_UNSCORED = -1  # no completion of the group has a verdict
GROUP_ALL_INCORRECT = 0
GROUP_MIXED = 1
GROUP_ALL_CORRECT = 2

STD_EPS = 1e-4  # what TRL's GRPOTrainer adds to the std


class AdvantageOutput(NamedTuple):
    """``Tensor[B]`` each: ``advantages`` (:math:`w_i A_i`), ``weights`` :math:`w_i`, ``base_advantages`` :math:`A_i`,
    ``raw_weights`` :math:`\\hat w_i` (unclamped), ``group_type`` (``GROUP_*``) and ``correct`` (bool)."""

    advantages: torch.Tensor
    weights: torch.Tensor
    base_advantages: torch.Tensor
    raw_weights: torch.Tensor
    group_type: torch.Tensor
    correct: torch.Tensor


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values[B, T]`` over the tokens ``mask[B, T]`` marks (others ignored, even NaN): ``Tensor[B]`` float32,
    NaN for a row without a marked token. Over per-token Shannon entropies this is EDGE-GRPO's :math:`P_i`."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape.")
    scored = mask.bool()
    return torch.where(scored, values.float(), 0.0).sum(dim=-1) / scored.sum(dim=-1).float()


def sequence_entropy(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Eq. 5, :math:`H_i = -\frac{1}{T_i}\sum_t \log\pi_{old}(y_t)` over the scored tokens: ``[B, T] -> [B]``."""
    return sequence_mean(-per_token_logps.float(), mask)


def _check_layout(rewards: torch.Tensor, num_generations: int, **others: torch.Tensor | None) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got shape {tuple(rewards.shape)}.")
    if not isinstance(num_generations, int) or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards do not divide into groups of num_generations={num_generations}: rows must be "
            "consecutive groups of `num_generations` completions of one prompt."
        )
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != rewards.shape:
            raise ValueError(
                f"{name} must have the shape of rewards {tuple(rewards.shape)}, got {tuple(tensor.shape)}."
            )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; expected one of {choices}.")


def _verdicts(r: torch.Tensor, correct: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, N]`` bool masks: rows with a verdict, and the correct ones. Without ``correct`` the verdict is
    ``reward > 0`` on scored (non-NaN) rows; a float ``correct`` gives none where it is NaN."""
    judged = ~torch.isnan(r)
    if correct is None:
        return judged, r > 0
    correct = correct.view(r.shape)
    if correct.is_floating_point():
        judged = judged & ~torch.isnan(correct)
    return judged, judged & (correct > 0)


def _group_type(judged: torch.Tensor, is_correct: torch.Tensor) -> torch.Tensor:
    """``[G, 1]`` int64 group type from the ``[G, N]`` masks of :func:`_verdicts`."""
    has_correct = is_correct.any(dim=1, keepdim=True)
    has_incorrect = (judged & ~is_correct).any(dim=1, keepdim=True)
    group_type = torch.full_like(has_correct, GROUP_UNSCORED, dtype=torch.long)
    group_type[has_incorrect] = GROUP_ALL_INCORRECT
    group_type[has_correct] = GROUP_ALL_CORRECT
    group_type[has_correct & has_incorrect] = GROUP_MIXED
    return group_type


def _grpo(r: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """GRPO's advantages (Eq. 2) of ``r[G, N]`` op for op as TRL's GRPOTrainer (NaN left in)."""
    from trl.trainer.utils import nanstd

    centered = r - torch.nanmean(r, dim=1, keepdim=True)
    if scale_rewards == "none":
        return centered
    if scale_rewards == "batch":
        std = nanstd(r.reshape(-1)) if r.numel() > 1 else r.new_zeros(())
    else:
        std = nanstd(r, dim=1, keepdim=True) if r.size(1) > 1 else r.new_zeros(r.size(0), 1)
    return centered / (std + STD_EPS)


def _masked_group_mean(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the valid entries of each row of ``[G, N]`` values, and the count of valid entries."""
    count = valid.sum(dim=1, keepdim=True)
    return torch.where(valid, values, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1), count


def _output(advantages, weights, base, raw, group_type, is_correct, n) -> AdvantageOutput:
    return AdvantageOutput(
        advantages.reshape(-1),
        weights.reshape(-1),
        base.reshape(-1),
        raw.reshape(-1),
        group_type.expand(-1, n).reshape(-1),
        is_correct.reshape(-1),
    )


AdvantageEstimator = Callable[..., AdvantageOutput]


def entropy_input(kind: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Declare which per-completion entropy an estimator reads as ``entropies``: ``"nll"`` (Eq. 5, the default),
    ``"shannon"`` (:func:`sequence_mean` of per-token Shannon entropies) or ``"none"`` (may be ``None``)."""
    _check_choice("entropy input", kind, ENTROPY_INPUTS)

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
    r"""EGPO's calibrated advantages :math:`\tilde A_i = w_i A_i` (Eq. 8-12), per group of ``num_generations`` rows.

    Weights (Eq. 8-10): :math:`\hat w_i = \bar H / (H_i + \varepsilon)` over the group's valid entries (finite
    entropy, scored reward; others and groups with :math:`\bar H` 0 keep weight 1); ``renorm="before_clamp"`` (C6)
    divides by their mean; ``clamp`` "asymmetric" (Eq. 9) gives correct :math:`\max(1, \mathrm{clip}(\hat w,
    \lambda_{min}, \lambda_{max}))`, incorrect :math:`\min(1, \mathrm{clip})`, "symmetric" (C1) the clip alone,
    "negative_only" (C2) / "positive_only" (C3) one side, "none" 1; ``renorm="after_clamp"`` (C5, Eq. 10) divides
    by the group mean; ``nsr_weighting="unit"`` (C4) sets 1 on entirely-incorrect groups.
    Base (Eq. 11): entirely-correct 0; mixed GRPO's (r - mean) / (std + 1e-4) as TRL computes it under
    ``scale_rewards`` (or ``group_advantages``); entirely-incorrect -1 (NSR, off with ``nsr=False``) under "group"
    and "batch", ``-nsr_scale`` under "none". Correct is ``reward > 0`` unless ``correct`` (bool, or float with NaN
    for no verdict) says; an unscored (NaN) reward gets 0, a row without a verdict no NSR and weight 1.
    With ``clamp="none"`` and ``nsr=False`` this is GRPO.
    """
    _check_layout(rewards, num_generations, entropies=entropies, correct=correct, group_advantages=group_advantages)
    _check_choice("clamp", clamp, CLAMP_MODES)
    _check_choice("renorm", renorm, RENORM_MODES)
    _check_choice("nsr_weighting", nsr_weighting, NSR_WEIGHTINGS)
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS_MODES)
    if not 0 < lambda_min <= lambda_max:
        raise ValueError(f"Need 0 < lambda_min <= lambda_max, got lambda_min={lambda_min}, lambda_max={lambda_max}.")
    n = num_generations
    r = rewards.detach().float().view(-1, n)
    judged, is_correct = _verdicts(r, correct)
    group_type = _group_type(judged, is_correct)
    mixed, all_incorrect = group_type == GROUP_MIXED, group_type == GROUP_ALL_INCORRECT

    # Base advantage, Eq. 11.
    grpo = _grpo(r, scale_rewards)
    if group_advantages is not None:
        grpo = group_advantages.detach().float().view(-1, n)
    base = torch.where(mixed, grpo.nan_to_num(nan=0.0), 0.0)
    if nsr:
        nsr_value = -float(nsr_scale) if scale_rewards == "none" else -1.0
        base = torch.where(all_incorrect & judged, nsr_value, base)

    # Raw weights, Eq. 8.
    h = entropies.detach().float().view(-1, n)
    valid = torch.isfinite(h) & ~torch.isnan(r)
    mean_h, count = _masked_group_mean(h, valid)
    valid = valid & (count > 0) & (mean_h != 0)
    raw = torch.where(valid, mean_h / (h + entropy_eps), 1.0)
    if renorm == "before_clamp":  # C6
        raw = torch.where(valid, raw / _masked_group_mean(raw, valid)[0], raw)

    # Eq. 9 and C1-C3: the correct side floored at 1, the incorrect side capped at 1.
    clipped = raw.clamp(min=lambda_min, max=lambda_max)
    floored = clipped.clamp(min=1.0) if clamp in ("asymmetric", "positive_only") else clipped
    capped = clipped.clamp(max=1.0) if clamp in ("asymmetric", "negative_only") else clipped
    weights = torch.where(valid & (clamp != "none"), torch.where(is_correct, floored, capped), 1.0)
    if renorm == "after_clamp":  # C5, Eq. 10
        weights = torch.where(valid, weights / _masked_group_mean(weights, valid)[0], weights)
    if nsr_weighting == "unit":  # C4
        weights = torch.where(all_incorrect, 1.0, weights)
    weights = torch.where(judged, weights, 1.0)
    return _output(weights * base, weights, base, raw, group_type, is_correct, n)


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
    """GRPO's advantages (Eq. 2) exactly as TRL's GRPOTrainer computes them, weights 1; unscored rows get 0.
    ``group_advantages`` (TRL's ``normalize_then_sum``) replace the ones computed from ``rewards``."""
    _check_layout(rewards, num_generations, correct=correct, group_advantages=group_advantages)
    _check_choice("scale_rewards", scale_rewards, SCALE_REWARDS_MODES)
    n = num_generations
    r = rewards.detach().float().view(-1, n)
    advantages = _grpo(r, scale_rewards) if group_advantages is None else group_advantages.detach().float()
    advantages = advantages.nan_to_num(nan=0.0)
    judged, is_correct = _verdicts(r, correct)
    ones = torch.ones_like(r)
    return _output(advantages, ones, advantages, ones, _group_type(judged, is_correct), is_correct, n)


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
    r"""Negative sample reinforcement (Zhu et al. 2025): :math:`A_i = -1` on incorrect completions, ``positive_weight``
    (:math:`\lambda_+`, 0 for NSR, 0.1 for their Weighted-REINFORCE) on correct ones, 0 without a verdict; no group
    baseline, so entirely-incorrect groups learn too. Use with ``loss_type="dapo"``, the paper's token average."""
    _check_layout(rewards, num_generations, correct=correct)
    if not isinstance(positive_weight, (int, float)) or isinstance(positive_weight, bool) or positive_weight < 0:
        raise ValueError(
            f"positive_weight must be a number >= 0 (0 is NSR, 0.1 Weighted-REINFORCE), got {positive_weight!r}."
        )
    n = num_generations
    r = rewards.detach().float().view(-1, n)
    judged, is_correct = _verdicts(r, correct)
    advantages = torch.where(is_correct, float(positive_weight), -1.0)
    advantages = torch.where(judged, advantages, 0.0)
    ones = torch.ones_like(r)
    return _output(advantages, ones, advantages, ones, _group_type(judged, is_correct), is_correct, n)


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
    r"""EDGE-GRPO's entropy-driven advantage :math:`\hat A_i = A_i \bar P / (P_i + \varepsilon)` (no clamp, both
    sides): :math:`A_i` is :func:`grpo_advantages`, :math:`P_i` the mean Shannon token entropy and :math:`\bar P`
    its mean over the group (``entropy_normalization="group"``, the paper's) or the batch (``"batch"``). Entries
    with a non-finite entropy or unscored reward, and groups with :math:`\bar P = 0`, keep weight 1."""
    _check_layout(rewards, num_generations, entropies=entropies, correct=correct)
    _check_choice("entropy_normalization", entropy_normalization, ENTROPY_NORMALIZATIONS)
    base = grpo_advantages(
        rewards, None, num_generations, scale_rewards=scale_rewards, correct=correct, group_advantages=group_advantages
    )
    n = num_generations
    p = entropies.float().view(-1, n)
    valid = torch.isfinite(p) & ~torch.isnan(rewards.float().view(-1, n))
    if entropy_normalization == "group":
        mean_p, count = _masked_group_mean(p, valid)
    else:
        mean_p, count = _masked_group_mean(p.reshape(1, -1), valid.reshape(1, -1))
    valid = valid & (count > 0) & (mean_p != 0)
    weights = torch.where(valid, mean_p / (p.nan_to_num(nan=0.0) + entropy_eps), 1.0).view(-1)
    return base._replace(advantages=weights * base.advantages, weights=weights, raw_weights=weights)


def weighted_reward_sum(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """``[B, K] -> [B]``: the ``reward_weights``-weighted sum as GRPOTrainer forms it (NaN counts 0; NaN where no
    function scored the completion)."""
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def normalize_then_sum_rewards(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """``[B, K] -> [B]``: each function's rewards normalised in the group ((r - mean) / (std + 1e-4)), then summed
    with ``reward_weights``, as GRPOTrainer under ``multi_objective_aggregation="normalize_then_sum"``."""
    from trl.trainer.utils import nanstd

    num_funcs = rewards_per_func.size(1)
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + STD_EPS)).view(-1, num_funcs)
    rewards = (reward_k * reward_weights.to(reward_k.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """``[B, K] -> [B]``: GRPO's advantages under ``normalize_then_sum``, op for op as GRPOTrainer: the
    :func:`normalize_then_sum_rewards` normalised over the batch; 0 for rows no function scored."""
    from trl.trainer.utils import nanstd

    rewards_per_func = rewards_per_func.detach().float()
    if rewards_per_func.dim() != 2 or rewards_per_func.size(1) != reward_weights.numel():
        raise ValueError(
            f"rewards_per_func must be [B, {reward_weights.numel()}] (one column per reward function), got "
            f"{tuple(rewards_per_func.shape)}."
        )
    _check_layout(rewards_per_func[:, 0], num_generations)
    rewards = normalize_then_sum_rewards(rewards_per_func, reward_weights, num_generations)
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return ((rewards - torch.nanmean(rewards)) / (std + STD_EPS)).nan_to_num(nan=0.0)


# Estimators whose group types need a binary correctness verdict (read by egpo_trl.correctness).
egpo_advantages.binary_correctness = True
nsr_advantages.binary_correctness = True

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "egpo": egpo_advantages,
    "grpo": grpo_advantages,
    "nsr": nsr_advantages,
    "edge_grpo": edge_grpo_advantages,
}


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
