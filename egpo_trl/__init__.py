"""egpo_trl: Entropy-Guided Policy Optimization (EGPO) on top of Hugging Face TRL.

>>> from egpo_trl import EGPOConfig, EGPOTrainer
"""

import importlib

__version__ = "0.1.0"

# Imported on first use, so that `egpo-trl --help` and the data and evaluation commands do not load TRL.
_EXPORTS = {
    "EGPOConfig": "egpo_trl.config",
    "EGPOTrainer": "egpo_trl.trainer",
    "egpo_advantages": "egpo_trl.advantages",
    "sequence_entropy": "egpo_trl.advantages",
}

__all__ = ["EGPOConfig", "EGPOTrainer", "__version__", "egpo_advantages", "sequence_entropy"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'egpo_trl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return sorted(__all__)
