"""Per-token log-probs of the completion tokens with every row shifted left past its prompt padding
(``egpo_shift_prompt_padding``): each row keeps its ``position_ids`` and has only right padding, so the forward needs
no attention mask."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

#: Keyword arguments of GRPOTrainer's log-prob helper that a batch may carry (multimodal inputs).
FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def completion_widths(completion_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the number of completion columns up to and including its last scored token (0 for none)."""
    columns = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
    return (columns * (completion_mask != 0)).amax(dim=1) if completion_mask.size(1) else completion_mask.sum(dim=1)


#: Decoders with rotary positions from ``position_ids`` alone and causal self-attention: a shifted row is unchanged.
REALIGN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def can_realign(model: torch.nn.Module, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> bool:
    """Whether the pass may shift rows: a :data:`REALIGN_MODEL_TYPES` decoder with full causal SDPA or eager attention,
    no position-dependent rotary scaling or virtual-token adapter, on left-padded prompts and right-padded completions."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config is None or getattr(config, "model_type", None) not in REALIGN_MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    rope_types = set()  # rope_parameters (per layer type or not) and rope_scaling
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict):
            for entry in [value for value in params.values() if isinstance(value, dict)] or [params]:
                rope_types.add(str(entry.get("rope_type", entry.get("type"))))
    if any("dynamic" in kind or kind == "longrope" for kind in rope_types):
        return False  # frequencies that follow the largest position_ids of the forward
    peft_config = getattr(model, "active_peft_config", None)  # prompt tuning drops position_ids; prefix tuning not
    if getattr(peft_config, "is_prompt_learning", False):
        peft_type = getattr(peft_config, "peft_type", None)
        if str(getattr(peft_type, "value", peft_type)) != "PREFIX_TUNING":
            return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(kind != "full_attention" for kind in layer_types):
            return False
    elif getattr(config, "use_sliding_window", False) or (
        getattr(config, "model_type", None) == "mistral" and getattr(config, "sliding_window", None) is not None
    ):
        return False
    if prompt_mask.numel() and bool((prompt_mask[:, 1:] < prompt_mask[:, :-1]).any()):
        return False  # a prompt mask with a hole or right padding
    if completion_mask.numel() and bool((completion_mask[:, 1:] > completion_mask[:, :-1]).any()):
        return False  # a completion mask with a hole (a masked span followed by scored tokens)
    scored = completion_mask.sum(dim=1) > 0
    if prompt_mask.size(1) == 0:
        return not bool(scored.any())
    return not bool((scored & (prompt_mask.sum(dim=1) == 0)).any())


def _realigned_forward(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    widths: torch.Tensor,
    compute_entropy: bool,
    autocast: Callable[[], AbstractContextManager],
    full_width: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One micro-batch shifted past its prompt padding: ``[rows, width]`` log-probs (and entropies) of the completion
    tokens, 0 after each row's ``widths``; cut to the longest row unless ``full_width``."""
    prompt_width = prompt_ids.size(1)
    width = completion_ids.size(1)
    device = prompt_ids.device
    prompt_lengths = prompt_mask.sum(dim=1)
    pads = prompt_width - prompt_lengths
    full = torch.cat([prompt_ids, completion_ids], dim=1)
    length = max(full.size(1) if full_width else int((prompt_lengths + widths).max()), 2)
    columns = torch.arange(length, device=device)
    source = columns[None, :] + pads[:, None]  # the column of TRL's layout each shifted column holds
    input_ids = full.gather(1, source.clamp(max=full.size(1) - 1))
    completion_column = source - prompt_width
    scored = (completion_column >= 0) & (completion_column < widths[:, None])
    labels = input_ids.masked_fill(~scored, -100)
    with autocast():
        outputs = model(input_ids=input_ids, position_ids=source, labels=labels, fused_lm_head=True)
    # log_probs[:, j] scores the token at shifted column j + 1; completion token k sits at column prompt_length + k.
    index = (prompt_lengths - 1).clamp(min=0)[:, None] + torch.arange(width, device=device)[None, :]
    index = index.clamp(max=outputs.log_probs.size(1) - 1)
    keep = torch.arange(width, device=device)[None, :] < widths[:, None]
    logps = outputs.log_probs.gather(1, index).float().masked_fill(~keep, 0.0)
    entropies = None
    if compute_entropy:
        entropies = outputs.entropy.gather(1, index).float().masked_fill(~keep, 0.0)
    return logps, entropies


def shifted_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    full_width: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's ``_get_per_token_logps_and_entropies`` for a text-only batch on rows shifted past their prompt padding
    (see :func:`can_realign`); returns ``(logps, entropies)`` of shape ``[B, logits_to_keep]``."""
    prompt_ids, completion_ids = input_ids[:, :-logits_to_keep], input_ids[:, -logits_to_keep:]
    prompt_mask, completion_mask = attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
    widths = completion_widths(completion_mask)
    batch_size = batch_size or input_ids.size(0)
    tensors = (prompt_ids, prompt_mask, completion_ids, widths)
    parts = [
        _realigned_forward(
            model, *(t[start : start + batch_size] for t in tensors), compute_entropy, autocast, full_width
        )
        for start in range(0, input_ids.size(0), batch_size)
    ]
    entropies = torch.cat([part[1] for part in parts], dim=0) if compute_entropy else None
    return torch.cat([part[0] for part in parts], dim=0), entropies
