"""What dynamic sampling and Guided Error Correction share: TRL 1.16 lets them regroup or rewrite a round's
completions for single-turn text generation only."""

from __future__ import annotations

from typing import Any


def refuse_unsupported_generation(trainer: Any, feature: str) -> None:
    """Raise, naming ``feature``, when ``trainer`` generates with a vision-language model, tools, a ``rollout_func``
    or an ``environment_factory``."""
    unsupported = {
        "vision-language models": bool(getattr(trainer, "_is_vlm", False)),
        "tools": bool(trainer.tools),
        "rollout_func": trainer.rollout_func is not None,
        "environment_factory": trainer.environment_factories is not None,
    }
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"{feature} does not support {name}; turn one of them off.")
