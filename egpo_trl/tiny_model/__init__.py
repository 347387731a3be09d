"""The tiny math reasoning model shipped with egpo_trl, and the script that builds it.

``python -m egpo_trl.tiny_model.build --output DIR`` trains a tokenizer, builds a small Qwen2 causal
LM with untied embeddings and fine-tunes it on worked solutions of the synthetic arithmetic task.
The built model ships in ``egpo_trl/assets/tiny-math-qwen2`` and loads with
``AutoModelForCausalLM.from_pretrained(tiny_model_path())``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_MODEL_NAME", "tiny_model_path"]

TINY_MODEL_NAME = "tiny-math-qwen2"


def tiny_model_path() -> str:
    """Path of the shipped tiny model inside the installed package."""
    return str(Path(__file__).resolve().parent.parent / "assets" / TINY_MODEL_NAME)
