"""The learning canary's reward, and its negative control: a sampler that never receives the trained weights.

``benchmarks/canary.py`` trains through ``egpo-trl train`` with ``--reward_funcs canary_rewards:letters_reward``
(this folder on ``PYTHONPATH``). The reward is one that a random-weight policy can learn within a few dozen steps:

* :func:`letters_reward`: +1 when more than 80% of a completion's characters are ASCII letters or spaces, else -1.

Importing this module with ``EGPO_CANARY_FREEZE_SAMPLER=1`` in the environment also installs
:func:`freeze_sampler_weights` in that process: from then on, every weight sync from the trainer to a vLLM engine
pushes the weights that the *first* sync pushed (the initial ones) instead of the current ones. The sampler then
never sees what the trainer learns, so the reward must stay flat: if it rises all the same, the canary's rise does
not measure the weight sync. The import happens in every training process, because ``egpo-trl train`` imports the
reward functions there before it builds the trainer, so nothing else in the training command changes.

The weights are replaced rather than the sync skipped, so that the control also holds with vLLM's sleep mode
(which discards the engine's weights at every sleep and needs them pushed again) and with DeepSpeed ZeRO-3 (every
process still takes part in each parameter's gather). It costs one copy of the model in each process's CPU memory.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = [
    "FREEZE_ENV",
    "LETTER_SHARE",
    "completion_text",
    "freeze_sampler_weights",
    "letter_share",
    "letters_reward",
]

#: A completion scores +1 when more than this share of its characters are ASCII letters or spaces.
LETTER_SHARE = 0.8
#: Set to ``1`` to keep the vLLM sampler at its initial weights (the canary's negative control).
FREEZE_ENV = "EGPO_CANARY_FREEZE_SAMPLER"
#: The line each frozen sync prints on the main process; ``canary.py`` counts them to check the control was active.
FROZEN_SYNC_MARKER = "egpo-canary: frozen sampler sync"

_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or the content of the last message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(completion)


def letter_share(text: str) -> float:
    """The share of ``text``'s characters that are ASCII letters or spaces (0.0 for an empty text)."""
    if not text:
        return 0.0
    return sum(character in _LETTERS for character in text) / len(text)


def letters_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """+1.0 for each completion more than 80% of whose characters are ASCII letters or spaces, else -1.0.

    A TRL reward function: ``completions`` are strings or chat messages; the other columns are ignored.
    """
    return [1.0 if letter_share(completion_text(c)) > LETTER_SHARE else -1.0 for c in completions]


_frozen_installed = False


def freeze_sampler_weights() -> None:
    """Make every vLLM weight sync of this process push the weights of its first sync (the initial weights).

    Patches TRL's ``VLLMGeneration._iter_named_params``, the iterator that every sync path reads the trainer's
    parameters from (TRL's colocate and server syncs, and ``tests/vllm_cpu.py``'s sync on CPU builds). The first
    call records a CPU copy of each tensor it yields; later calls still walk the trainer's parameters (so gathers
    under ZeRO-3 stay collective) but yield the recorded tensors. Idempotent.
    """
    global _frozen_installed
    if _frozen_installed:
        return
    from trl.generation.vllm_generation import VLLMGeneration

    original = VLLMGeneration._iter_named_params
    initial: dict[str, Any] = {}
    calls = [0]

    def frozen_iter_named_params(self):
        calls[0] += 1
        first = not initial
        for name, tensor in original(self):
            if first:
                initial[name] = tensor.detach().to("cpu", copy=True)
            stored = initial.get(name)
            if stored is None:
                raise RuntimeError(f"{FREEZE_ENV}: parameter {name!r} was not in the first weight sync.")
            yield name, stored.to(tensor.device)
        if os.environ.get("RANK", "0") == "0":
            what = "recorded the initial weights" if first else "pushed the initial weights again"
            print(f"{FROZEN_SYNC_MARKER} {calls[0]}: {what}", file=sys.stderr, flush=True)

    VLLMGeneration._iter_named_params = frozen_iter_named_params
    _frozen_installed = True


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from vllm_cpu import install_cpu_weight_sync  # noqa: E402

install_cpu_weight_sync()  # the CPU mode's vLLM colocate runs (the CPU build of vLLM); nothing elsewhere
if os.environ.get(FREEZE_ENV, "").strip().lower() in ("1", "true", "yes"):
    freeze_sampler_weights()
