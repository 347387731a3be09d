"""The baselines' sampling features, mixins of :class:`~egpo_trl.trainer.EGPOTrainer`: DAPO's dynamic sampling
(:mod:`~egpo_trl.sampling.dynamic`) and EDGE-GRPO's Guided Error Correction (:mod:`~egpo_trl.sampling.gec`)."""

from egpo_trl.sampling.dynamic import DynamicSamplingMixin
from egpo_trl.sampling.gec import GuidedErrorCorrectionMixin

__all__ = ["DynamicSamplingMixin", "GuidedErrorCorrectionMixin"]
