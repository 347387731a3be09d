"""What the names in a recipe point to: the model (``builtin:<name>``, a local folder or a Hub id) and the reward
functions (a registered name or an import path)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from egpo_trl.input_checks import resolve_model_name


def resolve_model_path(name_or_path: str) -> str:
    """The model's folder or Hub id, as ``EGPOTrainer`` resolves it; a model that cannot be loaded fails in one line."""
    try:
        return resolve_model_name(name_or_path)
    except ValueError as error:
        raise SystemExit(f"egpo-trl train: {error}") from None


def check_model_exists(
    name_or_path: str, revision: str | None = None, trust_remote_code: bool = False, prog: str = "egpo-trl train"
) -> str:
    """Fail in one line, before anything loads, when the model is neither a local folder nor on the Hub."""
    try:
        path = resolve_model_name(name_or_path)
    except ValueError as error:
        raise SystemExit(f"{prog}: {error}") from None
    if Path(path).expanduser().exists():
        return path
    from transformers import AutoConfig

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its retry warnings would bury the one line below
    try:
        AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        text = str(error)
        if "couldn't connect" in text or "offline" in text.lower() or "cached files" in text:
            reason = "no network (or HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
        elif "gated" in text.lower():
            reason = "it is a gated model: accept its licence on the Hub and log in with `hf auth login`"
        elif "not a valid model identifier" in text or "Repository Not Found" in text or "404" in text:
            reason = "no such model on the Hugging Face Hub"
        else:
            reason = " ".join(text.split())[:200]
        raise SystemExit(
            f"{prog}: cannot find the model {path}: it is not a local folder, and {reason}. To fix it, give a local "
            "model folder, a Hub id such as Qwen/Qwen2.5-Math-1.5B, or builtin:tiny-math-qwen2."
        ) from None
    finally:
        hub_logger.setLevel(level)
    return path


def _import(module_name: str):
    """Import ``module_name`` with the current folder first on ``sys.path`` (as ``python -m`` has it) during the
    import only, so that ``my_rewards:fn`` finds ./my_rewards.py."""
    sys.path.insert(0, here := os.getcwd())
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    finally:
        if here in sys.path:  # the imported module may have taken it off itself
            sys.path.remove(here)


def resolve_reward_funcs(names: Sequence[str]) -> list[Callable[..., list[float]]]:
    """Reward functions from names defined in :mod:`egpo_trl.rewards` or import paths ``pkg.module:func``."""
    from egpo_trl import rewards

    registry = {name: getattr(rewards, name) for name in ("boxed_accuracy_reward", "think_format_reward")}
    funcs = []
    for name in names:
        if name in registry:
            funcs.append(registry[name])
            continue
        module_name, sep, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(
                f"egpo-trl train: unknown reward function {name!r}; use one of {sorted(registry)} or an import path "
                "such as 'my_package.rewards:my_reward'."
            )
        try:
            func = getattr(_import(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise SystemExit(
                f"egpo-trl train: cannot import reward function {name!r}: {error} (modules are looked for in the "
                f"current folder, {os.getcwd()}, then on PYTHONPATH and in the installed packages)."
            ) from error
        if not callable(func):
            raise SystemExit(f"egpo-trl train: {name!r} is not callable.")
        funcs.append(func)
    if not funcs:
        raise SystemExit("egpo-trl train: reward_funcs is empty; give at least one (e.g. boxed_accuracy_reward).")
    return funcs
