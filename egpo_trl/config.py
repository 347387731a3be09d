"""Configuration of :class:`~egpo_trl.EGPOTrainer`: TRL's ``GRPOConfig`` plus the ``egpo_*`` fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from egpo_trl.advantages import ADVANTAGE_ESTIMATORS, CLAMP_MODES, NSR_WEIGHTINGS, RENORM_MODES

ENTROPY_SCOPES: tuple[str, ...] = ("completion", "thinking", "answer")


@dataclass
class EGPOConfig(GRPOConfig):
    r"""
    Configuration class for [`EGPOTrainer`].

    Every field of TRL's [`~trl.GRPOConfig`] works unchanged; the fields below add Entropy-Guided Policy
    Optimization. As with TRL, field names are the YAML keys of a recipe and the command-line flags.

    Parameters:
        > Parameters that select the advantage estimator

        advantage_estimator (`str`, *optional*, defaults to `"egpo"`):
            Name of the advantage estimator in `egpo_trl.advantages.ADVANTAGE_ESTIMATORS`. `"egpo"` is the paper's
            method; `"grpo"` is TRL's GRPO.

        > Parameters of EGPO (paper Sec. 3)

        egpo_lambda_min (`float`, *optional*, defaults to `0.8`):
            Lower clip bound \\(\\lambda_{\\min}\\) of the entropy weight (Eq. 9).
        egpo_lambda_max (`float`, *optional*, defaults to `2.0`):
            Upper clip bound \\(\\lambda_{\\max}\\) of the entropy weight (Eq. 9).
        egpo_entropy_eps (`float`, *optional*, defaults to `1e-6`):
            \\(\\varepsilon_H\\) in the raw weight \\(\\hat w_i = \\bar H / (H_i + \\varepsilon_H)\\) (Eq. 8).
        egpo_clamp (`str`, *optional*, defaults to `"asymmetric"`):
            How raw weights are bounded: `"asymmetric"` (paper, Eq. 9), `"symmetric"` (ablation C1),
            `"negative_only"` (C2), `"positive_only"` (C3) or `"none"` (all weights 1).
        egpo_renorm (`str`, *optional*, defaults to `"none"`):
            Within-group renormalisation of the weights: `"none"` (paper default), `"after_clamp"` (C5, Eq. 10) or
            `"before_clamp"` (C6).
        egpo_nsr (`bool`, *optional*, defaults to `True`):
            Negative sample reinforcement: entirely-incorrect groups get base advantage -1 (Sec. 3.2) instead of 0.
        egpo_nsr_weighting (`str`, *optional*, defaults to `"entropy"`):
            Weights on entirely-incorrect groups: `"entropy"` (paper) or `"unit"` (ablation C4, \\(w \\equiv 1\\)).
        egpo_correctness_reward (`str` or `None`, *optional*, defaults to `None`):
            Name of the reward function whose value decides correct (> 0) versus incorrect. `None` uses the first
            reward function. Mixed-group advantages still use the weighted sum of all rewards, as GRPO does.
        egpo_entropy_scope (`str`, *optional*, defaults to `"completion"`):
            Tokens the entropy proxy averages over: the whole `"completion"` (paper Eq. 5), the `"thinking"` segment
            inside `<think>...</think>`, or the `"answer"` segment after `</think>` (the paper's RQ4 suggestion).
    """

    advantage_estimator: str = field(
        default="egpo",
        metadata={
            "help": "Advantage estimator, by name: 'egpo' (the paper's method) or 'grpo' (TRL's GRPO); more are "
            "registered in egpo_trl.advantages.ADVANTAGE_ESTIMATORS."
        },
    )
    egpo_lambda_min: float = field(
        default=0.8,
        metadata={"help": "Lower clip bound lambda_min of the EGPO entropy weight (paper Eq. 9). Must be > 0."},
    )
    egpo_lambda_max: float = field(
        default=2.0,
        metadata={
            "help": "Upper clip bound lambda_max of the EGPO entropy weight (paper Eq. 9). Must be >= lambda_min."
        },
    )
    egpo_entropy_eps: float = field(
        default=1e-6,
        metadata={"help": "epsilon_H in the raw weight mean(H) / (H_i + epsilon_H) (paper Eq. 8). Must be > 0."},
    )
    egpo_clamp: str = field(
        default="asymmetric",
        metadata={
            "help": "How raw EGPO weights are bounded: 'asymmetric' (paper Eq. 9: correct >= 1, incorrect <= 1), "
            "'symmetric' (ablation C1: clip only), 'negative_only' (C2), 'positive_only' (C3) or 'none' (w = 1).",
            "choices": list(CLAMP_MODES),
        },
    )
    egpo_renorm: str = field(
        default="none",
        metadata={
            "help": "Within-group renormalisation of the weights to mean 1: 'none' (paper default), 'after_clamp' "
            "(ablation C5) or 'before_clamp' (C6).",
            "choices": list(RENORM_MODES),
        },
    )
    egpo_nsr: bool = field(
        default=True,
        metadata={
            "help": "Negative sample reinforcement: entirely-incorrect groups get base advantage -1 (paper Sec. 3.2) "
            "instead of 0."
        },
    )
    egpo_nsr_weighting: str = field(
        default="entropy",
        metadata={
            "help": "Weights on entirely-incorrect groups: 'entropy' (paper) or 'unit' (ablation C4: w = 1).",
            "choices": list(NSR_WEIGHTINGS),
        },
    )
    egpo_correctness_reward: str | None = field(
        default=None,
        metadata={
            "help": "Name of the reward function that decides correct (reward > 0) vs incorrect; by default the first "
            "reward function. A shaping bonus (format, length) then never makes a wrong answer count as correct."
        },
    )
    egpo_entropy_scope: str = field(
        default="completion",
        metadata={
            "help": "Tokens the entropy proxy averages over: 'completion' (paper Eq. 5), 'thinking' (inside "
            "<think>...</think>) or 'answer' (after </think>).",
            "choices": list(ENTROPY_SCOPES),
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_egpo()

    def _validate_egpo(self) -> None:
        def choose(name: str, value: str, choices: tuple[str, ...] | list[str]) -> None:
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not supported; set it to one of: {', '.join(choices)}.")

        choose("advantage_estimator", self.advantage_estimator, sorted(ADVANTAGE_ESTIMATORS))
        choose("egpo_clamp", self.egpo_clamp, CLAMP_MODES)
        choose("egpo_renorm", self.egpo_renorm, RENORM_MODES)
        choose("egpo_nsr_weighting", self.egpo_nsr_weighting, NSR_WEIGHTINGS)
        choose("egpo_entropy_scope", self.egpo_entropy_scope, ENTROPY_SCOPES)
        for name in ("egpo_lambda_min", "egpo_lambda_max", "egpo_entropy_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.egpo_lambda_min <= 0:
            raise ValueError(
                f"egpo_lambda_min must be > 0 (the paper uses 0.8), got {self.egpo_lambda_min}: a zero or negative "
                "bound would zero or flip the sign of advantages."
            )
        if self.egpo_lambda_min > self.egpo_lambda_max:
            raise ValueError(
                f"egpo_lambda_min ({self.egpo_lambda_min}) is larger than egpo_lambda_max ({self.egpo_lambda_max}); "
                "set egpo_lambda_min <= egpo_lambda_max (the paper uses 0.8 and 2.0)."
            )
        if self.egpo_clamp == "asymmetric" and not self.egpo_lambda_min <= 1.0 <= self.egpo_lambda_max:
            raise ValueError(
                f"With egpo_clamp='asymmetric' the bounds must bracket 1 (lambda_min <= 1 <= lambda_max), got "
                f"[{self.egpo_lambda_min}, {self.egpo_lambda_max}]; otherwise one side of the clamp is a constant."
            )
        if self.egpo_entropy_eps <= 0:
            raise ValueError(f"egpo_entropy_eps must be > 0 (default 1e-6), got {self.egpo_entropy_eps}.")
        if self.advantage_estimator == "egpo" and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "advantage_estimator='egpo' needs multi_objective_aggregation='sum_then_normalize' (EGPO's mixed-group "
                "advantage is GRPO's over the weighted reward sum); set it, or use advantage_estimator='grpo'."
            )
