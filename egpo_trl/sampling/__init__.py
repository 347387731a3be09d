"""Sampling features of the baselines, each in its own module, composed by :class:`~egpo_trl.trainer.EGPOTrainer`.

* :mod:`egpo_trl.sampling.dynamic`: DAPO's dynamic sampling (``dynamic_sampling``),
  :class:`~egpo_trl.sampling.dynamic.DynamicSamplingMixin`.
* :mod:`egpo_trl.sampling.gec`: EDGE-GRPO's Guided Error Correction (``edge_gec``),
  :class:`~egpo_trl.sampling.gec.GuidedErrorCorrectionMixin`.
* :mod:`egpo_trl.sampling.common`: the generation paths neither supports.

Each feature is a mixin of methods that overrides nothing of ``GRPOTrainer``: its init check
(``_check_<feature>``) and its work, called by the trainer's overrides of TRL's methods when the feature is on.
"""

from egpo_trl.sampling.dynamic import DynamicSamplingMixin
from egpo_trl.sampling.gec import GuidedErrorCorrectionMixin

__all__ = ["DynamicSamplingMixin", "GuidedErrorCorrectionMixin"]
