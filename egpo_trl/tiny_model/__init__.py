"""The tiny math reasoning model shipped in ``egpo_trl/assets/tiny-math-qwen2``, and its build script (``build.py``)."""

from pathlib import Path

TINY_MODEL_NAME = "tiny-math-qwen2"


def tiny_model_path() -> str:
    """Path of the shipped tiny model inside the installed package."""
    return str(Path(__file__).resolve().parent.parent / "assets" / TINY_MODEL_NAME)
