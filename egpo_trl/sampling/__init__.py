"""The baselines' sampling features: DAPO's dynamic sampling and EDGE-GRPO's Guided Error Correction."""

from egpo_trl.sampling.dynamic import DynamicSamplingMixin
from egpo_trl.sampling.gec import GuidedErrorCorrectionMixin

__all__ = ["DynamicSamplingMixin", "GuidedErrorCorrectionMixin"]
