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
    "nsr_advantages",
    "register_advantage_estimator",
    "sequence_entropy",
    "sequence_mean",
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


def _group_types(correct: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``Tensor[G]`` of group types from ``[G, N]`` correctness and scored masks."""
    n_scored = scored.sum(dim=1)
    n_correct = (correct & scored).sum(dim=1)
    group_type = torch.full_like(n_scored, GROUP_MIXED)
    group_type = torch.where(n_correct == n_scored, GROUP_ALL_CORRECT, group_type)
    group_type = torch.where(n_correct == 0, GROUP_ALL_INCORRECT, group_type)
    group_type = torch.where(n_scored == 0, GROUP_UNSCORED, group_type)
    return group_type


def _grpo_base(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """GRPO's group-relative advantage (Eq. 2) exactly as TRL's GRPOTrainer computes it, ``Tensor[B]``.

    ``scale_rewards="group"``: (r - mean_group) / (std_group + 1e-4) with the unbiased std;
    ``"batch"``: the std of the whole batch instead; ``"none"``: r - mean_group.
    """
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean
    if scale_rewards == "group":
        if num_generations > 1:
            std = _nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    elif scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + STD_EPS)
    return advantages


def _masked_group_mean(values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the valid entries of each row of ``[G, N]`` values, and the count of valid entries."""
    count = valid.sum(dim=1, keepdim=True)
    total = torch.where(valid, values, 0.0).sum(dim=1, keepdim=True)
    return total / count.clamp(min=1), count


def _clamp_weights(raw: torch.Tensor, correct: torch.Tensor, clamp: str, lo: float, hi: float) -> torch.Tensor:
    """Eq. 9 and the ablations C1-C3 applied to raw weights ``w^``."""
    if clamp == "none":
        return torch.ones_like(raw)
    clipped = raw.clamp(min=lo, max=hi)
    if clamp == "symmetric":  # C1: clip only
        return clipped
    at_least_one = clipped.clamp(min=1.0)  # correct side: never down-weighted
    at_most_one = clipped.clamp(max=1.0)  # incorrect side: never up-weighted
    if clamp == "asymmetric":  # Eq. 9
        return torch.where(correct, at_least_one, at_most_one)
    if clamp == "negative_only":  # C2: only the incorrect side is capped at 1
        return torch.where(correct, clipped, at_most_one)
    if clamp == "positive_only":  # C3: only the correct side is floored at 1
        return torch.where(correct, at_least_one, clipped)
    raise ValueError(f"Unknown clamp {clamp!r}; expected one of {CLAMP_MODES}.")


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
       "batch" for the batch std, or "none" for r - mean); entirely-incorrect: -1 when ``nsr``
       (Sec. 3.2, NSR) else 0.
    8. :math:`\tilde A_i = w_i A_i` (Eq. 12).

    With ``clamp="none"`` and ``nsr=False`` the advantages are GRPO's (bit for bit for binary rewards,
    where a uniform group's GRPO advantage is exactly 0).

    Args:
        rewards: ``Tensor[B]`` rewards (the weighted sum of the reward functions, as GRPO uses).
        entropies: ``Tensor[B]`` entropy proxies from :func:`sequence_entropy` (NaN allowed).
        num_generations: the group size N; ``B`` must be a multiple of it.
        lambda_min, lambda_max: clip bounds (paper: 0.8 and 2.0).
        entropy_eps: :math:`\varepsilon_H` in Eq. 8.
        clamp, renorm, nsr, nsr_weighting: the paper's switches and ablations C1-C6.
        scale_rewards: how mixed-group advantages are scaled, as TRL's ``scale_rewards``.
        correct: optional ``bool Tensor[B]`` overriding ``rewards > 0`` as the correctness signal.

    Returns:
        :class:`AdvantageOutput` with ``advantages`` and ``weights`` first (``Tensor[B]``, float32).
    """
    _check_layout(rewards, num_generations, entropies=entropies, correct=correct)
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

    rewards = rewards.float()
    n = num_generations
    r = rewards.view(-1, n)
    scored = ~torch.isnan(r)
    is_correct = (r > 0) if correct is None else correct.view(-1, n).bool()
    is_correct = is_correct & scored

    group_type = _group_types(is_correct, scored)  # [G]
    group_type_rows = group_type.repeat_interleave(n)

    # Base advantage, Eq. 11.
    mixed_adv = _grpo_base(rewards, n, scale_rewards)
    base = torch.where(group_type_rows == GROUP_MIXED, mixed_adv, 0.0)
    base = torch.where(group_type_rows == GROUP_ALL_INCORRECT, -1.0 if nsr else 0.0, base)
    base = torch.nan_to_num(torch.where(scored.view(-1), base, 0.0), nan=0.0)

    # Raw weights, Eq. 8.
    h = entropies.float().view(-1, n)
    valid = torch.isfinite(h) & scored
    mean_h, count = _masked_group_mean(h, valid)
    usable = (count > 0) & (mean_h != 0)
    valid = valid & usable
    raw = torch.where(valid, mean_h / (torch.nan_to_num(h, nan=0.0) + entropy_eps), 1.0)

    if renorm == "before_clamp":  # C6
        mean_raw, _ = _masked_group_mean(raw, valid)
        raw = torch.where(valid, raw / mean_raw, raw)

    weights = torch.where(valid, _clamp_weights(raw, is_correct, clamp, lambda_min, lambda_max), 1.0)

    if renorm == "after_clamp":  # C5, Eq. 10
        mean_w, _ = _masked_group_mean(weights, valid)
        weights = torch.where(valid, weights / mean_w, weights)

    if nsr_weighting == "unit":  # C4
        weights = torch.where((group_type == GROUP_ALL_INCORRECT).unsqueeze(1), 1.0, weights)

    weights = weights.view(-1)
    return AdvantageOutput(
        advantages=weights * base,
        weights=weights,
        base_advantages=base,
        raw_weights=raw.view(-1),
        group_type=group_type_rows,
        correct=is_correct.view(-1),
    )


@entropy_input("none")
def grpo_advantages(
    rewards: torch.Tensor,
    entropies: torch.Tensor | None,
    num_generations: int,
    *,
    scale_rewards: ScaleRewards = "group",
    correct: torch.Tensor | None = None,
    **_: object,
) -> AdvantageOutput:
    """GRPO's advantages (paper Eq. 2) exactly as TRL's GRPOTrainer computes them; weights are 1.

    Uniform-reward groups get 0 (advantage collapse); unscored rows (NaN reward) get 0. ``entropies``
    is accepted for a uniform estimator signature and unused.
    """
    _check_layout(rewards, num_generations, correct=correct)
    if scale_rewards not in SCALE_REWARDS_MODES:
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS_MODES}.")
    rewards = rewards.float()
    n = num_generations
    r = rewards.view(-1, n)
    scored = ~torch.isnan(r)
    is_correct = ((r > 0) if correct is None else correct.view(-1, n).bool()) & scored
    advantages = torch.nan_to_num(_grpo_base(rewards, n, scale_rewards), nan=0.0)
    ones = torch.ones_like(rewards)
    return AdvantageOutput(
        advantages=advantages,
        weights=ones,
        base_advantages=advantages,
        raw_weights=ones,
        group_type=_group_types(is_correct, scored).repeat_interleave(n),
        correct=is_correct.view(-1),
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
    scored = ~torch.isnan(r)
    is_correct = ((r > 0) if correct is None else correct.view(-1, n).bool()) & scored
    advantages = torch.where(is_correct, torch.full_like(r, float(positive_weight)), torch.full_like(r, -1.0))
    advantages = torch.where(scored, advantages, torch.zeros_like(r)).view(-1)
    ones = torch.ones_like(rewards)
    return AdvantageOutput(
        advantages=advantages,
        weights=ones,
        base_advantages=advantages,
        raw_weights=ones,
        group_type=_group_types(is_correct, scored).repeat_interleave(n),
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
    base = grpo_advantages(rewards, None, num_generations, scale_rewards=scale_rewards, correct=correct)
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
