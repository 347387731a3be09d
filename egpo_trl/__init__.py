"""egpo_trl: Entropy-Guided Policy Optimization (EGPO) on top of Hugging Face TRL."""

__version__ = "0.1.0"
