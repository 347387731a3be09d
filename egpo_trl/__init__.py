"""egpo_trl: Entropy-Guided Policy Optimization (EGPO) on top of Hugging Face TRL.

>>> from egpo_trl import EGPOConfig, EGPOTrainer
"""

__version__ = "0.1.0"

from egpo_trl.advantages import egpo_advantages, sequence_entropy
from egpo_trl.config import EGPOConfig
from egpo_trl.trainer import EGPOTrainer

__all__ = ["EGPOConfig", "EGPOTrainer", "__version__", "egpo_advantages", "sequence_entropy"]
