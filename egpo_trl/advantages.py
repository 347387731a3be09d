r"""Advantage estimators as pure tensor functions.

Everything a reader must check against the paper lives here, as functions that take and return
tensors, with no Python loop over groups or samples. Rows are laid out as TRL lays them out:
consecutive groups of ``num_generations`` completions of the same prompt.

Equation numbers refer to "Know What You Know: Metacognitive Entropy Calibration for Verifiable
RL Reasoning" (the EGPO paper):

* Eq. 5, :func:`sequence_entropy`: :math:`\tilde H_i = -\frac{1}{T_i}\sum_t \log\pi_{old}(y_t\mid x, y_{<t})`.
* Eq. 8-12, :func:`egpo_advantages`: group-relative inverse-entropy weights, the asymmetric clamp,
  optional renormalisation, the base advantage by group type (NSR on entirely-incorrect groups) and
  the calibrated advantage :math:`\tilde A_i = w_i A_i`.

The baselines the paper compares against live here too, under the same signature:

* :func:`grpo_advantages`: GRPO exactly as TRL computes it (DAPO uses it as well; DAPO's other parts are
  recipe settings and dynamic sampling in the trainer).
* :func:`nsr_advantages`: negative sample reinforcement alone (Zhu et al. 2025, "The Surprising
  Effectiveness of Negative Reinforcement in LLM Reasoning").
* :func:`edge_grpo_advantages`: EDGE-GRPO's entropy-driven advantage (Zhang et al. 2025, arXiv 2507.21848).

Estimators are registered by name in :data:`ADVANTAGE_ESTIMATORS` so that the trainer selects one
from its config; adding an estimator is one function and one registry line. An estimator states which
per-completion entropy it reads with :func:`entropy_input` (default ``"nll"``, the proxy of Eq. 5), so
that the trainer computes only what is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CLAMP_MODES",
    "ENTROPY_INPUTS",
    "ENTROPY_NORMALIZATIONS",
    "GROUP_ALL_CORRECT",
    "GROUP_ALL_INCORRECT",
    "GROUP_MIXED",
    "GROUP_UNSCORED",
    "NSR_WEIGHTINGS",
    "RENORM_MODES",
    "SCALE_REWARDS_MODES",
    "AdvantageOutput",
    "edge_grpo_advantages",
    "egpo_advantages",
    "entropy_input",
    "get_advantage_estimator",
    "get_entropy_input",
    "grpo_advantages",
    "normalize_then_sum_advantages",
    "normalize_then_sum_rewards",
    "nsr_advantages",
    "register_advantage_estimator",
    "sequence_entropy",
    "sequence_mean",
    "weighted_reward_sum",
]

ClampMode = Literal["asymmetric", "symmetric", "negative_only", "positive_only", "none"]
RenormMode = Literal["none", "after_clamp", "before_clamp"]
NSRWeighting = Literal["entropy", "unit"]
ScaleRewards = Literal["group", "batch", "none"]

CLAMP_MODES: tuple[str, ...] = ("asymmetric", "symmetric", "negative_only", "positive_only", "none")
RENORM_MODES: tuple[str, ...] = ("none", "after_clamp", "before_clamp")
NSR_WEIGHTINGS: tuple[str, ...] = ("entropy", "unit")
SCALE_REWARDS_MODES: tuple[str, ...] = ("group", "batch", "none")
#: Per-completion entropies an estimator may read: ``"nll"`` (Eq. 5, mean negative log-probability of the
#: sampled tokens), ``"shannon"`` (mean full-distribution Shannon entropy of the policy's next-token
#: distributions) or ``"none"``.
ENTROPY_INPUTS: tuple[str, ...] = ("nll", "shannon", "none")
ENTROPY_NORMALIZATIONS: tuple[str, ...] = ("group", "batch")

# Group types, one value per row (every row of a group carries its group's type).
GROUP_UNSCORED = -1  # no completion of the group was scored (every reward was None/NaN)
GROUP_ALL_INCORRECT = 0
GROUP_MIXED = 1
GROUP_ALL_CORRECT = 2

# The constant TRL adds to the group std (GRPOTrainer, scale_rewards="group"/"batch").
STD_EPS = 1e-4


class AdvantageOutput(NamedTuple):
    """Result of an advantage estimator. All fields are ``Tensor[B]`` on the rewards' device.

    Attributes:
        advantages: the advantages the clipped objective uses (EGPO: :math:`\\tilde A_i = w_i A_i`, Eq. 12).
        weights: the per-completion weights :math:`w_i` (1 where no weighting applies).
        base_advantages: the base advantages :math:`A_i` before weighting (Eq. 11).
        raw_weights: the unclamped group-relative weights :math:`\\hat w_i` (Eq. 8), after renorm when
            ``renorm="before_clamp"``.
        group_type: the row's group type, one of ``GROUP_ALL_INCORRECT``, ``GROUP_MIXED``,
            ``GROUP_ALL_CORRECT``, ``GROUP_UNSCORED``.
        correct: whether the completion counts as correct (bool).
    """

    advantages: torch.Tensor
    weights: torch.Tensor
    base_advantages: torch.Tensor
    raw_weights: torch.Tensor
    group_type: torch.Tensor
    correct: torch.Tensor


def sequence_entropy(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Per-completion entropy proxy, paper Eq. 5: mean negative log-probability of the scored tokens.

    :math:`H_i = -\sum_t \log p_{i,t}\, m_{i,t} / \sum_t m_{i,t}`.

    Args:
        per_token_logps: ``Tensor[B, T]`` log-probabilities of the sampled tokens under the old policy.
            Values at unscored positions (``mask == 0``) are ignored, even when NaN or ``-inf``.
        mask: ``Tensor[B, T]`` (bool, int or float) marking the scored tokens (TRL's completion mask
            times its tool mask).

    Returns:
        ``Tensor[B]`` in float32. A row with no scored token gives NaN.
    """
    if per_token_logps.shape != mask.shape:
        raise ValueError(
            f"per_token_logps {tuple(per_token_logps.shape)} and mask {tuple(mask.shape)} differ in shape."
        )
    scored = mask.bool()
    logps = torch.where(scored, per_token_logps.float(), torch.zeros((), device=per_token_logps.device))
    total = -logps.sum(dim=-1)
    count = scored.sum(dim=-1).to(total.dtype)
    return total / count  # 0 / 0 = NaN for rows without scored tokens


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Per-completion mean of per-token ``values`` over the scored tokens: :math:`\sum_t v_{i,t} m_{i,t} / \sum_t m_{i,t}`.

    With per-token Shannon entropies :math:`-\sum_v \pi(v \mid x, y_{<t}) \log \pi(v \mid x, y_{<t})` this is
    EDGE-GRPO's response entropy :math:`P_i`; with negated log-probabilities it is :func:`sequence_entropy`.

    Args:
        values: ``Tensor[B, T]``; values at unscored positions (``mask == 0``) are ignored, even when NaN.
        mask: ``Tensor[B, T]`` (bool, int or float) marking the scored tokens.

    Returns:
        ``Tensor[B]`` in float32. A row with no scored token gives NaN.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape.")
    scored = mask.bool()
    kept = torch.where(scored, values.float(), torch.zeros((), device=values.device))
    return kept.sum(dim=-1) / scored.sum(dim=-1).to(torch.float32)


def _nanstd(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs, operation for operation as TRL's ``nanstd``.

    Kept identical to TRL so that EGPO with every switch off reproduces GRPOTrainer's advantages
    bit for bit.
    """
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance = variance * correction
    std = torch.sqrt(variance)
    return std.squeeze() if dim is None else std.squeeze(dim)


def _check_layout(rewards: torch.Tensor, num_generations: int, **others: torch.Tensor | None) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got shape {tuple(rewards.shape)}.")
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive integer, got {num_generations!r}.")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not divide into groups of num_generations={num_generations}: rows must be "
            "consecutive groups of `num_generations` completions of one prompt."
        )
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != rewards.shape:
            raise ValueError(
                f"{name} must have the shape of rewards {tuple(rewards.shape)}, got {tuple(tensor.shape)}."
            )


def _scored_and_correct(r: torch.Tensor, correct: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, N]`` masks of the scored rows (reward not NaN) and of the correct ones, as 1.0 / 0.0 floats.

    Float masks keep the comparisons vectorised on CPU and let later steps select with exact arithmetic (products
    with 0.0 / 1.0, divisions by 0.0 that give NaN, ``nan_to_num``) instead of ``torch.where``.
    """
    scored = torch.eq(r, r, out=torch.empty_like(r))  # NaN != NaN
    if correct is None:
        is_correct = torch.gt(r, 0, out=torch.empty_like(r))  # NaN > 0 is False
    else:
        is_correct = correct.view(r.shape).gt(0).to(r.dtype).mul_(scored)  # NaN (no verdict) > 0 is False
    return scored, is_correct


def _judged(scored: torch.Tensor, correct: torch.Tensor | None) -> torch.Tensor:
    """``[G, N]`` 1.0 / 0.0 mask of the rows with a correctness verdict: scored, and (for a floating-point
    ``correct``) not NaN there. A row without a verdict is neither correct nor incorrect."""
    if correct is None or not correct.is_floating_point():
        return scored
    judged = correct.view(scored.shape)
    return torch.eq(judged, judged).to(scored.dtype).mul_(scored)


def _group_types(
    scored_count: torch.Tensor, correct_count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group types from the ``[G, 1]`` float counts of scored and of correct completions.

    Returns ``(group_type, mixed, all_incorrect)``: the ``[G, 1]`` int64 group type and two ``[G, 1]`` 1.0 / 0.0 masks.
    """
    has_correct = correct_count.sign()
    has_incorrect = (scored_count - correct_count).sign_()
    mixed = has_correct * has_incorrect
    # (has_correct, has_incorrect) = (a, b): (0, 0) unscored -1, (0, 1) all incorrect 0, (1, 1) mixed 1,
    # (1, 0) all correct 2; that is 3a + b - 2ab - 1.
    group_type = torch.add(has_incorrect, has_correct, alpha=3).sub_(mixed, alpha=2).sub_(1).long()
    return group_type, mixed, has_incorrect.sub_(mixed)


def _grpo_parts(
    r: torch.Tensor, scored_count: torch.Tensor, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GRPO's group-relative advantage (Eq. 2) as ``centered / denominator``, op for op as TRL's GRPOTrainer.

    Args:
        r: ``[G, N]`` rewards, NaN for unscored rows.
        scored_count: ``[G, 1]`` float count of the non-NaN rewards of each group.
        scale_rewards: ``"group"``: the denominator is std_group + 1e-4 with the unbiased std (``[G, 1]``);
            ``"batch"``: the std of the whole batch + 1e-4 (0-dim); ``"none"``: no denominator (``None``).

    Returns:
        ``centered = r - mean_group`` (``[G, N]``, a fresh tensor) and the denominator.
    """
    # torch.nanmean and TRL's nanstd divide the NaN-ignoring sum by the count of non-NaN entries: the same ops here,
    # with the mean and the count computed once.
    mean = r.nansum(dim=1, keepdim=True).div_(scored_count)
    centered = r - mean
    if scale_rewards == "none":
        return centered, None
    if scale_rewards == "batch":
        std = _nanstd(r.reshape(-1)) if r.numel() > 1 else r.new_zeros(())
        return centered, std + STD_EPS
    if r.size(1) == 1:
        return centered, torch.zeros_like(mean).add_(STD_EPS)
    variance = (centered**2).nansum(dim=1, keepdim=True).div_(scored_count)
    # Bessel's correction count / (count - 1). TRL writes NaN where count <= 1; so does this (0 * inf or 0 / 0).
    std = variance.mul_(scored_count / (scored_count - 1)).sqrt_()
    return centered, std.add_(STD_EPS)


def _masked_group_mean(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the valid entries of each row of ``[G, N]`` values, and the count of valid entries."""
    count = valid.sum(dim=1, keepdim=True)
    total = torch.where(valid, values, 0.0).sum(dim=1, keepdim=True)
    return total / count.clamp(min=1), count


def _clamp_weights(raw: torch.Tensor, correct: torch.Tensor, clamp: str, lo: float, hi: float) -> torch.Tensor:
    """Eq. 9 and the ablations C1-C3 applied to raw weights ``w^``; ``correct`` is a 1.0 / 0.0 float mask."""
    if clamp == "none":
        return torch.ones_like(raw)
    clipped = raw.clamp(min=lo, max=hi)
    if clamp == "symmetric":  # C1: clip only
        return clipped
    if clamp not in ("asymmetric", "negative_only", "positive_only"):
        raise ValueError(f"Unknown clamp {clamp!r}; expected one of {CLAMP_MODES}.")
    # The correct side is floored at 1 (never down-weighted), the incorrect side capped at 1 (never up-weighted):
    # one clamp with per-row bounds. Floor: 1 if correct else 0 (a no-op, as w >= lo > 0); cap: 1 if incorrect else
    # hi + 1 (a no-op, as w <= max(hi, 1)).
    floor = correct if clamp in ("asymmetric", "positive_only") else None  # Eq. 9 / C3
    cap = correct.mul(hi).add_(1.0) if clamp in ("asymmetric", "negative_only") else None  # Eq. 9 / C2
    return clipped.clamp_(min=floor, max=cap)


AdvantageEstimator = Callable[..., AdvantageOutput]


def entropy_input(kind: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that declares which per-completion entropy an estimator reads as its ``entropies`` argument.

    ``"nll"`` (the default for an undecorated estimator): the proxy of Eq. 5 from :func:`sequence_entropy`;
    ``"shannon"``: the mean full-distribution Shannon entropy from :func:`sequence_mean` over per-token
    entropies; ``"none"``: the estimator ignores ``entropies`` (the trainer may pass ``None``).
    """
    if kind not in ENTROPY_INPUTS:
        raise ValueError(f"Unknown entropy input {kind!r}; expected one of {ENTROPY_INPUTS}.")

    def decorator(func: AdvantageEstimator) -> AdvantageEstimator:
        func.entropy_input = kind
        return func

    return decorator


def get_entropy_input(estimator: AdvantageEstimator) -> str:
    """The entropy ``estimator`` reads (see :func:`entropy_input`); ``"nll"`` when it does not say."""
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
    clamp: ClampMode = "asymmetric",
    renorm: RenormMode = "none",
    nsr: bool = True,
    nsr_weighting: NSRWeighting = "entropy",
    scale_rewards: ScaleRewards = "group",
    correct: torch.Tensor | None = None,
    nsr_scale: float = 1.0,
    group_advantages: torch.Tensor | None = None,
) -> AdvantageOutput:
    r"""EGPO's calibrated advantages (paper Eq. 8-12, Algorithm 1), vectorised over all groups.

    Steps, per group of ``num_generations`` consecutive rows:

    1. Correctness: a completion is correct when its reward is ``> 0`` (the paper's +1/-1; 0/1 rewards
       work too), unless ``correct`` is given. A row whose reward is NaN (every reward function
       returned None) is *unscored*: it gets advantage 0 and weight 1 and does not count towards
       the group type. The group is entirely-correct, entirely-incorrect or mixed.
    2. Raw weight (Eq. 8): :math:`\hat w_i = \bar H / (H_i + \varepsilon_H)`, with :math:`\bar H` the
       mean over the group's *valid* entries. An entry with a non-finite entropy (no scored token,
       e.g. a truncated completion under ``mask_truncated_completions``) or an unscored reward is
       invalid: its weight is 1 and it is left out of the mean and of renorm. A group with no valid
       entry, or with mean entropy 0, has :math:`\hat w = 1` throughout.
    3. ``renorm="before_clamp"`` (ablation C6): :math:`\hat w_i \leftarrow \hat w_i / \mathrm{mean}(\hat w)`.
    4. ``clamp`` (Eq. 9): ``"asymmetric"`` correct: :math:`\max(1, \mathrm{clip}(\hat w, \lambda_{min},
       \lambda_{max}))`, incorrect: :math:`\min(1, \mathrm{clip}(\cdot))`; ``"symmetric"`` (C1) clip only;
       ``"negative_only"`` (C2) only the incorrect side capped at 1, the correct side clipped;
       ``"positive_only"`` (C3) the mirror; ``"none"``: :math:`w = 1`.
    5. ``renorm="after_clamp"`` (C5, Eq. 10): :math:`w_i \leftarrow w_i / \mathrm{mean}(w)`.
    6. ``nsr_weighting="unit"`` (C4): :math:`w = 1` on entirely-incorrect groups.
    7. Base advantage (Eq. 11): entirely-correct 0; mixed: GRPO's (r - mean) / (std + 1e-4) with the
       unbiased std, exactly as TRL's GRPOTrainer computes it for ``scale_rewards`` ("group", or
       "batch" for the batch std, or "none" for r - mean), or ``group_advantages`` when given;
       entirely-incorrect: the NSR advantage when ``nsr`` (Sec. 3.2) else 0. The NSR advantage is scaled the way
       mixed groups are: -1 with ``scale_rewards="group"`` (the paper: one group std, as a uniform group has
       none of its own), ``-nsr_scale / (std_batch + 1e-4)`` with ``"batch"`` and ``-nsr_scale`` with ``"none"``,
       where ``nsr_scale`` is half the reward gap between a correct and an incorrect completion (1 for the
       paper's +1/-1 reward, 0.5 for a 1/0 reward). So the NSR-to-mixed balance does not change with the scaling:
       an incorrect completion of an evenly split group gets about -1 under each. A batch with no correct
       completion has no such gap for its std to measure: under ``"batch"`` its NSR advantage is -1, as under
       ``"group"``.
    8. :math:`\tilde A_i = w_i A_i` (Eq. 12).

    With ``clamp="none"`` and ``nsr=False`` the advantages are GRPO's (bit for bit for binary rewards,
    where a uniform group's GRPO advantage is exactly 0).

    The outputs are constants of the objective, as in the paper: no gradient flows back into ``rewards`` or
    ``entropies``.

    Args:
        rewards: ``Tensor[B]`` rewards (the weighted sum of the reward functions, as GRPO uses).
        entropies: ``Tensor[B]`` entropy proxies from :func:`sequence_entropy` (NaN allowed).
        num_generations: the group size N; ``B`` must be a multiple of it.
        lambda_min, lambda_max: clip bounds (paper: 0.8 and 2.0).
        entropy_eps: :math:`\varepsilon_H` in Eq. 8.
        clamp, renorm, nsr, nsr_weighting: the paper's switches and ablations C1-C6.
        scale_rewards: how mixed-group advantages are scaled, as TRL's ``scale_rewards``.
        correct: optional ``Tensor[B]`` overriding ``rewards > 0`` as the correctness signal: bool, or float
            (> 0 correct, else incorrect) with NaN for a row the verifier gave no verdict on. Such a row is neither
            correct nor incorrect: it does not count towards the group type, gets no NSR advantage and weight 1
            (its reward still enters a mixed group's GRPO advantage).
        nsr_scale: half the reward gap between a correct and an incorrect completion, in reward units (see
            step 7); used with ``scale_rewards`` "batch" and "none".
        group_advantages: optional ``Tensor[B]`` of GRPO advantages computed elsewhere (TRL's
            ``multi_objective_aggregation="normalize_then_sum"``, :func:`normalize_then_sum_advantages`), used on
            mixed groups instead of the ones computed from ``rewards``.

    Returns:
        :class:`AdvantageOutput` with ``advantages`` and ``weights`` first (``Tensor[B]``, float32).
    """
    _check_layout(rewards, num_generations, entropies=entropies, correct=correct, group_advantages=group_advantages)
    if clamp not in CLAMP_MODES:
        raise ValueError(f"Unknown clamp {clamp!r}; expected one of {CLAMP_MODES}.")
    if renorm not in RENORM_MODES:
        raise ValueError(f"Unknown renorm {renorm!r}; expected one of {RENORM_MODES}.")
    if nsr_weighting not in NSR_WEIGHTINGS:
        raise ValueError(f"Unknown nsr_weighting {nsr_weighting!r}; expected one of {NSR_WEIGHTINGS}.")
    if scale_rewards not in SCALE_REWARDS_MODES:
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS_MODES}.")
    if not 0 < lambda_min <= lambda_max:
        raise ValueError(f"Need 0 < lambda_min <= lambda_max, got lambda_min={lambda_min}, lambda_max={lambda_max}.")

    rewards = rewards.detach().float()
    n = num_generations
    r = rewards.view(-1, n)
    scored, is_correct = _scored_and_correct(r, correct)  # [G, N], 1.0 / 0.0
    scored_count = scored.sum(dim=1, keepdim=True)
    judged = _judged(scored, correct)  # rows with a correctness verdict: they alone type the group
    group_type, mixed, all_incorrect = _group_types(
        judged.sum(dim=1, keepdim=True), is_correct.sum(dim=1, keepdim=True)
    )

    # Base advantage, Eq. 11: GRPO's on mixed groups, -1 (NSR) on the scored rows of entirely-incorrect groups,
    # 0 elsewhere. Dividing by NaN outside mixed groups (mixed / mixed is 0 / 0 there) and nan_to_num select
    # the mixed rows; nan_to_num also zeroes unscored rows (NaN reward) and caps infinities, as GRPO's does.
    centered, denominator = _grpo_parts(r, scored_count, scale_rewards)
    mixed_only = mixed / mixed  # 1.0 on mixed groups, NaN elsewhere
    if group_advantages is not None:
        base = (group_advantages.detach().float().view(-1, n) * mixed_only).nan_to_num_(nan=0.0)
    else:
        base = centered.div_(mixed_only if denominator is None else denominator * mixed_only).nan_to_num_(nan=0.0)
    if nsr:
        if scale_rewards == "group":
            nsr_value = -1.0
        elif scale_rewards == "batch":
            # 0-dim tensor: the batch std + 1e-4. A batch without a correct completion has no correct-incorrect
            # spread for that std to measure (it is 0, or the shaping rewards' alone): the group convention, -1.
            nsr_value = torch.where(is_correct.any(), -nsr_scale / denominator, -1.0)
        else:
            nsr_value = -float(nsr_scale)
        base = base + all_incorrect * judged * nsr_value

    # Raw weights, Eq. 8, with NaN marking the invalid entries until the end: h - h is NaN for a NaN or infinite
    # entropy, and dividing by the scored mask (0 / 0) marks unscored rows.
    h = entropies.detach().float().view(-1, n)
    valid = (h - h).div_(scored).add_(1.0)  # 1.0 where valid, NaN elsewhere
    h_valid = h * valid
    # nansum adds exactly what sum adds over the entries with NaN replaced by 0, in the same order. A group without a
    # valid entry gets 0 / 0 = NaN, one with mean entropy 0 gets 0 / 0 on the next line (|sign| is 1 for any nonzero
    # mean, 0 for 0): raw weights 1 throughout.
    mean_h = h_valid.nansum(dim=1, keepdim=True).div_(valid.nansum(dim=1, keepdim=True))
    mean_h = mean_h / mean_h.abs().sign()
    denominator_h = h_valid.add_(entropy_eps)
    raw = mean_h / denominator_h  # NaN where invalid
    valid_mask = None
    if renorm != "none" or not lambda_min <= 1.0 <= lambda_max:
        valid_mask = ~torch.isnan(raw)
    raw = raw.nan_to_num_(nan=1.0, posinf=math.inf, neginf=-math.inf)

    if renorm == "before_clamp":  # C6
        mean_raw, _ = _masked_group_mean(raw, valid_mask)
        raw = torch.where(valid_mask, raw / mean_raw, raw)

    weights = _clamp_weights(raw, is_correct, clamp, lambda_min, lambda_max)
    if valid_mask is not None and not lambda_min <= 1.0 <= lambda_max:
        weights = torch.where(valid_mask, weights, 1.0)  # the clip moved the weight 1 of invalid entries

    if renorm == "after_clamp":  # C5, Eq. 10
        mean_w, _ = _masked_group_mean(weights, valid_mask)
        weights = torch.where(valid_mask, weights / mean_w, weights)

    if nsr_weighting == "unit":  # C4
        weights = torch.where(all_incorrect.bool(), 1.0, weights)
    if judged is not scored:  # a row without a verdict is neither side of the clamp: weight 1
        weights = torch.where(judged.bool(), weights, 1.0)

    return AdvantageOutput(
        advantages=(weights * base).view(-1),
        weights=weights.view(-1),
        base_advantages=base.view(-1),
        raw_weights=raw.view(-1),
        group_type=group_type.expand(-1, n).reshape(-1),
        correct=is_correct.bool().view(-1),
    )


@entropy_input("none")
def grpo_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor | None,
    num_generations: int,
    *,
    scale_rewards: ScaleRewards = "group",
    correct: torch.Tensor | None = None,
    group_advantages: torch.Tensor | None = None,
    **_: object,
) -> AdvantageOutput:
    """GRPO's advantages (paper Eq. 2) exactly as TRL's GRPOTrainer computes them; weights are 1.

    Uniform-reward groups get 0 (advantage collapse); unscored rows (NaN reward) get 0. ``entropies``
    is accepted for a uniform estimator signature and unused. The advantages carry no gradient.
    ``group_advantages``, when given (TRL's ``normalize_then_sum`` aggregation, from
    :func:`normalize_then_sum_advantages`), are returned as the advantages; ``rewards`` then only set the
    group types.
    """
    _check_layout(rewards, num_generations, correct=correct, group_advantages=group_advantages)
    if scale_rewards not in SCALE_REWARDS_MODES:
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS_MODES}.")
    rewards = rewards.detach().float()
    n = num_generations
    r = rewards.view(-1, n)
    scored, is_correct = _scored_and_correct(r, correct)
    scored_count = scored.sum(dim=1, keepdim=True)
    if group_advantages is not None:
        advantages = group_advantages.detach().float().clone().nan_to_num_(nan=0.0).view(-1)
    else:
        advantages, denominator = _grpo_parts(r, scored_count, scale_rewards)
        if denominator is not None:
            advantages.div_(denominator)
        advantages = advantages.nan_to_num_(nan=0.0).view(-1)
    judged_count = _judged(scored, correct).sum(dim=1, keepdim=True)
    group_type, _, _ = _group_types(judged_count, is_correct.sum(dim=1, keepdim=True))
    ones = torch.ones_like(rewards)
    return AdvantageOutput(
        advantages=advantages,
        weights=ones,
        base_advantages=advantages,
        raw_weights=ones,
        group_type=group_type.expand(-1, n).reshape(-1),
        correct=is_correct.bool().view(-1),
    )


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
    r"""Negative sample reinforcement (NSR, Zhu et al. 2025): only incorrect completions carry a learning signal.

    The NSR objective minimises the likelihood of incorrect samples under a binary verifier; as a
    per-completion advantage in the clipped objective:

    .. math:: A_i = \begin{cases} -1 & \text{incorrect} \\ \lambda_{+} & \text{correct} \end{cases}

    with :math:`\lambda_{+} = 0` for NSR. No group baseline and no std scaling: every incorrect completion gets
    -1 whatever the rest of its group did, so NSR also learns from entirely-incorrect groups (the case EGPO
    handles with its NSR branch, Eq. 11) and ignores entirely-correct ones. ``positive_weight`` > 0 gives the same
    paper's Weighted-REINFORCE (it recommends :math:`\lambda_{+} = 0.1`). The paper averages the loss over all
    tokens of the batch, which is TRL's ``loss_type="dapo"`` (its default).

    Correctness is ``rewards > 0`` unless ``correct`` is given (the trainer passes the correctness reward
    function's decision, so shaping rewards do not change NSR's advantages). Unscored rows (NaN reward) get 0.
    ``entropies`` is accepted for a uniform estimator signature and unused.

    Returns:
        :class:`AdvantageOutput`; ``weights`` and ``raw_weights`` are 1, ``base_advantages`` equal ``advantages``.
    """
    _check_layout(rewards, num_generations, correct=correct)
    if not isinstance(positive_weight, (int, float)) or isinstance(positive_weight, bool) or positive_weight < 0:
        raise ValueError(
            f"positive_weight must be a number >= 0 (0 is NSR, 0.1 Weighted-REINFORCE), got {positive_weight!r}."
        )
    rewards = rewards.float()
    n = num_generations
    r = rewards.view(-1, n)
    scored, is_correct = _scored_and_correct(r, correct)
    scored = _judged(scored, correct)  # NSR learns from the verifier's verdicts only
    group_type, _, _ = _group_types(scored.sum(dim=1, keepdim=True), is_correct.sum(dim=1, keepdim=True))
    scored, is_correct = scored.bool(), is_correct.bool()
    advantages = torch.where(is_correct, torch.full_like(r, float(positive_weight)), torch.full_like(r, -1.0))
    advantages = torch.where(scored, advantages, torch.zeros_like(r)).view(-1)
    ones = torch.ones_like(rewards)
    return AdvantageOutput(
        advantages=advantages,
        weights=ones,
        base_advantages=advantages,
        raw_weights=ones,
        group_type=group_type.expand(-1, n).reshape(-1),
        correct=is_correct.view(-1),
    )


@entropy_input("shannon")
def edge_grpo_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor,
    num_generations: int,
    *,
    entropy_normalization: str = "group",
    entropy_eps: float = 1e-6,
    scale_rewards: ScaleRewards = "group",
    correct: torch.Tensor | None = None,
    group_advantages: torch.Tensor | None = None,
    **_: object,
) -> AdvantageOutput:
    r"""EDGE-GRPO's entropy-driven advantage (EDA; Zhang et al. 2025, arXiv 2507.21848), vectorised over groups.

    .. math:: \hat A_i = A_i \, \frac{\bar P}{P_i + \varepsilon}, \qquad \bar P = \mathrm{mean}_j P_j

    :math:`A_i` is GRPO's group-relative advantage (exactly :func:`grpo_advantages`, so uniform-reward groups stay
    at 0) and :math:`P_i` the completion's mean full-distribution Shannon token entropy under the policy
    (``entropies``, from :func:`sequence_mean`). Confident completions get larger updates, uncertain ones smaller,
    on both the correct and the incorrect side: unlike EGPO there is no clamp and no asymmetry.

    Choices the paper leaves open, as implemented here:

    * :math:`\bar P` is the mean over the completion's group (``entropy_normalization="group"``, the paper's
      :math:`\frac{1}{G}\sum_j`) or over the whole batch (``"batch"``, what the public code's micro-batch mean
      amounts to when a micro-batch holds several groups).
    * Entries with a non-finite entropy (no scored token) or an unscored reward are left out of :math:`\bar P` and
      keep weight 1, as in :func:`egpo_advantages`; so does every entry of a group with :math:`\bar P = 0`.
    * :math:`\varepsilon` (``entropy_eps``) only guards a zero entropy; the paper has none.
    * :math:`P_i` is a constant of the objective here (the trainer computes it without gradient, under the
      policy that sampled the batch); see the trainer's documentation.

    Returns:
        :class:`AdvantageOutput` with ``weights`` = ``raw_weights`` = :math:`\bar P / (P_i + \varepsilon)` and
        ``base_advantages`` = :math:`A_i`.
    """
    _check_layout(rewards, num_generations, entropies=entropies, correct=correct)
    if entropy_normalization not in ENTROPY_NORMALIZATIONS:
        raise ValueError(
            f"Unknown entropy_normalization {entropy_normalization!r}; expected one of {ENTROPY_NORMALIZATIONS}."
        )
    base = grpo_advantages(
        rewards, None, num_generations, scale_rewards=scale_rewards, correct=correct, group_advantages=group_advantages
    )
    n = num_generations
    scored = ~torch.isnan(rewards.float().view(-1, n))
    p = entropies.float().view(-1, n)
    valid = torch.isfinite(p) & scored
    if entropy_normalization == "group":
        mean_p, count = _masked_group_mean(p, valid)
    else:
        flat_mean, flat_count = _masked_group_mean(p.reshape(1, -1), valid.reshape(1, -1))
        mean_p, count = flat_mean.expand(p.size(0), 1), flat_count.expand(p.size(0), 1)
    valid = valid & (count > 0) & (mean_p != 0)
    weights = torch.where(valid, mean_p / (torch.nan_to_num(p, nan=0.0) + entropy_eps), torch.ones_like(p)).view(-1)
    return AdvantageOutput(
        advantages=weights * base.advantages,
        weights=weights,
        base_advantages=base.advantages,
        raw_weights=weights,
        group_type=base.group_type,
        correct=base.correct,
    )


def weighted_reward_sum(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward, the ``reward_weights``-weighted sum over reward functions, as GRPOTrainer forms it:
    NaN (a function that did not score the completion) counts as 0, and rows no function scored are NaN.

    Args:
        rewards_per_func: ``Tensor[B, K]``, NaN where a function did not score a completion.
        reward_weights: ``Tensor[K]``.

    Returns:
        ``Tensor[B]``.
    """
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(unscorable, float("nan"))


def normalize_then_sum_rewards(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """The rewards GRPOTrainer normalises under ``multi_objective_aggregation="normalize_then_sum"``: each reward
    function's rewards normalised within the group ((r - mean) / (std + 1e-4), unbiased std), then summed with
    ``reward_weights``. ``Tensor[B, K]`` -> ``Tensor[B]``; ``B`` a multiple of
    ``num_generations``."""
    num_funcs = rewards_per_func.size(1)
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = _nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + STD_EPS)).view(-1, num_funcs)
    rewards = (reward_k * reward_weights.to(reward_k.device).unsqueeze(0)).nansum(dim=1)
    # NaN where no function scored the completion (a function's normalised reward can be NaN where it did score it:
    # a group it scored once has no std).
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """GRPO advantages under TRL's ``multi_objective_aggregation="normalize_then_sum"``, op for op as GRPOTrainer.

    Each reward function's rewards are normalised within the group ((r - mean) / (std + 1e-4), unbiased std), the
    normalised rewards are summed with ``reward_weights``, and the sums are normalised over the whole batch (mean
    and std of the batch; ``scale_rewards`` plays no part, as in TRL). Rows every reward function left unscored
    (NaN) get 0.

    Args:
        rewards_per_func: ``Tensor[B, K]``, NaN where a function did not score a completion.
        reward_weights: ``Tensor[K]``.
        num_generations: the group size; ``B`` must be a multiple of it.

    Returns:
        ``Tensor[B]``, the advantages (no gradient).
    """
    rewards_per_func = rewards_per_func.detach().float()
    if rewards_per_func.dim() != 2 or rewards_per_func.size(1) != reward_weights.numel():
        raise ValueError(
            f"rewards_per_func must be [B, {reward_weights.numel()}] (one column per reward function), got "
            f"{tuple(rewards_per_func.shape)}."
        )
    _check_layout(rewards_per_func[:, 0], num_generations)
    rewards = normalize_then_sum_rewards(rewards_per_func, reward_weights, num_generations)
    std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


# Estimators whose group types need a binary correctness signal (the paper's +1/-1 or 1/0 verifier): see the trainer.
egpo_advantages.binary_correctness = True
nsr_advantages.binary_correctness = True

#: Estimators by name. Each takes ``(rewards, entropies, num_generations, *, correct=None, **options)`` and returns an
#: :class:`AdvantageOutput`; the trainer passes the options its config names that the estimator's signature accepts.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "egpo": egpo_advantages,
    "grpo": grpo_advantages,
    "nsr": nsr_advantages,
    "edge_grpo": edge_grpo_advantages,
}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that registers an estimator under ``name`` (refuses to replace an existing one)."""

    def decorator(func: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not func:
            raise ValueError(f"An advantage estimator named {name!r} is already registered.")
        ADVANTAGE_ESTIMATORS[name] = func
        return func

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``, or a ValueError listing the known names."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)}."
        ) from None
