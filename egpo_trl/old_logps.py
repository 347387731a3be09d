"""The no-grad log-prob pass over a generation batch, sized for throughput.

EGPO's entropy proxy (and EDGE-GRPO's Shannon entropies) need the old policy's per-token log-probs of the completion
tokens. When TRL has not computed them, :meth:`~egpo_trl.EGPOTrainer._egpo_forward` runs one no-grad pass of the
policy. TRL's own helper (``GRPOTrainer._get_per_token_logps_and_entropies``) is built for the loss: it runs
``per_device_train_batch_size`` rows at a time (4 in the paper recipes), each padded to the whole batch's width.
Without gradients the same forward fits many more rows, and right padding (completions shorter than the longest
one) is work for nothing. This module plans the pass:

* rows are sorted by completion length, so that each micro-batch holds completions of similar length;
* each micro-batch holds as many rows as fit in a token budget (``egpo_entropy_tokens_per_batch``, counted on its
  own padded width), or a fixed number of rows (``egpo_entropy_batch_size``);
* each micro-batch is cut to its own longest completion: the columns after it are padding in every row, and
  positions after a token never change its log-prob in a causal model, so they are not computed. Prompts keep
  their left padding, so every token keeps the position TRL's pass gives it. (Rotary scalings whose frequencies
  follow the widest position of a forward, ``dynamic`` and ``longrope``, keep TRL's full width in every
  micro-batch: cut, a forward could stay below the length where the scaling starts while TRL's passes it.)
* when the model allows it (a Llama/Mistral/Qwen-family decoder with full causal attention in every layer, PyTorch's
  SDPA or eager attention) and the masks are plain padding (prompts padded on the left, completions on the right),
  each row is shifted left past its prompt padding and given its original positions as ``position_ids``. The
  micro-batch then needs no attention mask: SDPA runs its causal flash kernel instead of the slower
  memory-efficient kernel with an explicit mask, and each token sees the same tokens at the same positions as in
  TRL's pass. Anything else (other architectures or attention implementations, sliding windows, holes in a mask)
  takes the masked path. So do the ``dynamic`` and
  ``longrope`` rotary scalings (the padding after a shifted row carries positions beyond the masked layout's, and
  the dynamic update persists into later forwards), and PEFT prompt learning other than prefix tuning (prompt
  tuning, P-tuning: virtual tokens are prepended to every row and ``position_ids`` are dropped).

The log-probs themselves come from TRL's fused LM head (``add_fused_lm_head``, which ``GRPOTrainer`` installs on
the policy): the model's own forward with ``fused_lm_head=True`` runs the backbone and projects only the scored
(completion) positions through the output layer in tiles, accumulating in float32 without materialising the
``[batch, length, vocabulary]`` logits. It divides by the sampling temperature and applies the model's logit scale
and final soft-capping exactly as in TRL's pass, gathers the output layer under DeepSpeed ZeRO-3 and works through
PEFT wrappers, so the values are TRL's up to the floating-point effects of a different batch composition.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["can_realign", "completion_widths", "plan_micro_batches", "no_grad_completion_logps", "shifted_logps"]

#: Default token budget of one micro-batch of the no-grad pass (rows x padded width).
DEFAULT_TOKENS_PER_BATCH = 65536

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
    """Per row, the number of completion columns up to and including its last scored token (0 for a row with none).

    Columns after it carry no label in TRL's pass (their log-probs are 0 there too), so they can be cut.
    """
    columns = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
    return (columns * (completion_mask != 0)).amax(dim=1) if completion_mask.size(1) else completion_mask.sum(dim=1)


def plan_micro_batches(
    widths: torch.Tensor,
    prompt_width: int,
    tokens_per_batch: int | None = DEFAULT_TOKENS_PER_BATCH,
    batch_size: int | None = None,
    num_micro_batches: int | None = None,
) -> list[tuple[torch.Tensor, int]]:
    """Split rows into micro-batches of similar completion width.

    Args:
        widths: ``[B]`` completion widths (:func:`completion_widths`).
        prompt_width: columns of the (left-padded) prompts, counted in every row.
        tokens_per_batch: most ``rows * (prompt_width + width)`` tokens of one micro-batch (at least one row each).
        batch_size: when set, this many rows per micro-batch instead of a token budget.
        num_micro_batches: when set and larger than the plan, the largest micro-batches are split until the plan has
            exactly this many (processes whose forward passes communicate, as under ZeRO-3 or FSDP, must run the
            same number). Never more than ``B``.

    Returns:
        A list of ``(rows, width)``: a ``LongTensor`` of row indices (longest completions first) and the completion
        columns the micro-batch keeps (at least 1).
    """
    num_rows = widths.numel()
    if num_rows == 0:
        return []
    order = torch.sort(widths.cpu(), descending=True, stable=True).indices
    sorted_widths = widths.cpu()[order].tolist()
    groups: list[list[int]] = []
    start = 0
    while start < num_rows:
        width = max(int(sorted_widths[start]), 1)  # the first row of a group is its widest
        if batch_size is not None:
            count = batch_size
        else:
            count = max(1, int(tokens_per_batch) // (prompt_width + width))
        groups.append(order[start : start + count].tolist())
        start += count
    if num_micro_batches is not None:
        target = min(int(num_micro_batches), num_rows)
        while len(groups) < target:
            largest = max(range(len(groups)), key=lambda i: len(groups[i]))
            group = groups[largest]
            half = (len(group) + 1) // 2
            groups[largest : largest + 1] = [group[:half], group[half:]]
    return [
        (torch.tensor(group, dtype=torch.long), max(int(widths.cpu()[group].max()), 1))
        for group in groups
        if len(group) > 0
    ]


@torch.no_grad()
def no_grad_completion_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    compute_entropy: bool = False,
    tokens_per_batch: int | None = DEFAULT_TOKENS_PER_BATCH,
    batch_size: int | None = None,
    num_micro_batches: int | Callable[[int], int] | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    realign: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and, when asked, Shannon entropies) of the completion tokens under ``model``.

    ``model`` is a causal language model with TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``), possibly
    wrapped by PEFT. The attention mask is ``prompt_mask`` followed by ``completion_mask``, and the scored tokens are
    the completion tokens it keeps, as in ``GRPOTrainer._get_per_token_logps_and_entropies``.

    Args:
        num_micro_batches: a fixed number of micro-batches, or a function from this process's planned count to the
            count to run (e.g. the largest over processes); see :func:`plan_micro_batches`.
        autocast: a context manager factory the forward runs under (the accelerator's autocast).
        realign: shift rows past their prompt padding and run without an attention mask (see the module's notes);
            ``None`` (default) does so when :func:`can_realign` allows it, ``False`` always uses the masked path.

    Returns:
        ``(logps, entropies)``, each ``[B, C]`` float32 with ``C = completion_ids.size(1)``, 0 at the columns that are
        not scored (as TRL's); ``entropies`` is ``None`` unless ``compute_entropy``.
    """
    batch, num_columns = completion_ids.shape
    prompt_width = prompt_ids.size(1)
    device = completion_ids.device
    if num_columns == 0:
        # Nothing to score here, but the count is asked all the same: with several processes it gathers the other
        # processes' counts, and a process that skipped it (or the forwards it implies) would leave them waiting.
        target = _micro_batch_target(num_micro_batches, 0)
        if target > 0:
            _dummy_forwards(model, prompt_ids, prompt_mask, target, autocast)
        empty = completion_ids.new_zeros(batch, 0, dtype=torch.float32)
        return empty, (empty.clone() if compute_entropy else None)
    widths = completion_widths(completion_mask)
    # Rotary scalings that follow the longest position of a forward give TRL's values only at TRL's full width.
    plan_widths = torch.full_like(widths, num_columns) if _rope_follows_longest_position(model) else widths
    plan = plan_micro_batches(plan_widths, prompt_width, tokens_per_batch, batch_size)
    target = _micro_batch_target(num_micro_batches, len(plan))
    if target > len(plan):
        plan = plan_micro_batches(plan_widths, prompt_width, tokens_per_batch, batch_size, num_micro_batches=target)
    logps = torch.zeros(batch, num_columns, dtype=torch.float32, device=device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    if realign is None:
        realign = can_realign(model, prompt_mask, completion_mask)
    for rows, width in plan:
        rows = rows.to(device)
        if realign:
            row_logps, row_entropies = _realigned_forward(
                model,
                prompt_ids[rows],
                prompt_mask[rows],
                completion_ids[rows, :width],
                widths[rows].to(device),
                compute_entropy,
                autocast,
            )
            logps[rows, :width] = row_logps
            if compute_entropy:
                entropies[rows, :width] = row_entropies
            continue
        input_ids = torch.cat([prompt_ids[rows], completion_ids[rows, :width]], dim=1)
        attention_mask = torch.cat([prompt_mask[rows], completion_mask[rows, :width]], dim=1)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :prompt_width] = -100  # only the completion tokens are scored
        with autocast():
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        logps[rows, :width] = outputs.log_probs[:, -width:].float()
        if compute_entropy:
            entropies[rows, :width] = _fused_entropies(outputs)[:, -width:].float()
    return logps, entropies


#: Model types whose decoder takes its positions from ``position_ids`` alone (rotary embeddings) and whose attention
#: is causal self-attention over the sequence: shifting a row and passing its original positions changes nothing.
REALIGN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _unwrapped_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_types(config) -> set[str]:
    """The rotary-embedding types a config names (``rope_parameters``, per layer type or not, and ``rope_scaling``)."""
    kinds = set()
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        entries = [value for value in params.values() if isinstance(value, dict)] or [params]
        for entry in entries:
            kind = entry.get("rope_type", entry.get("type"))
            if kind is not None:
                kinds.add(str(kind))
    return kinds


def _rope_follows_longest_position(model: torch.nn.Module) -> bool:
    """Whether the model's rotary embedding picks its frequencies from the largest position of each forward
    (``dynamic`` and ``longrope`` scaling): its values then depend on how wide the forward is."""
    config = _unwrapped_config(model)
    return config is not None and any("dynamic" in kind or kind == "longrope" for kind in _rope_types(config))


def _prepends_virtual_tokens(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model whose active adapter prepends virtual tokens to the input embeddings (prompt
    tuning, P-tuning and the like), which drops ``position_ids``. Prefix tuning only adds cached keys and values."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is None or not getattr(peft_config, "is_prompt_learning", False):
        return False
    peft_type = getattr(peft_config, "peft_type", None)
    return str(getattr(peft_type, "value", peft_type)) != "PREFIX_TUNING"


def can_realign(model: torch.nn.Module, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> bool:
    """Whether the pass may shift rows past their prompt padding and run without an attention mask.

    True for a decoder of :data:`REALIGN_MODEL_TYPES` with full causal attention in every layer under PyTorch's SDPA
    or eager attention (never FlashAttention, which reads packed sequences from ``position_ids``), when every prompt
    mask is zeros then ones and every completion mask ones then zeros, and every row with a scored token has a
    prompt token before it. Never for rotary scalings whose frequencies follow the largest position of a forward
    (``dynamic``, ``longrope``), nor under a PEFT prompt-learning adapter that prepends virtual tokens to the input
    (prompt tuning, P-tuning; prefix tuning keeps the layout and is allowed).
    """
    config = _unwrapped_config(model)
    if config is None or getattr(config, "model_type", None) not in REALIGN_MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if _rope_follows_longest_position(model):
        return False  # frequencies that follow the largest position_ids of the forward
    if _prepends_virtual_tokens(model):
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


def _fused_entropies(outputs) -> torch.Tensor:
    """The per-token entropies of a fused-LM-head forward."""
    if outputs.entropy is None:  # pragma: no cover - GRPOTrainer asks its fused head for entropies
        raise RuntimeError("The model's fused LM head does not compute entropies; is the TRL version 1.16.0?")
    return outputs.entropy


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
    """One micro-batch with every row shifted left past its prompt padding: ``[rows, width]`` log-probs (and
    entropies) of the completion tokens, 0 after each row's ``widths``. The forward is cut to its longest row, or
    with ``full_width`` keeps TRL's width (prompt plus completion columns).

    In TRL's layout a row's real tokens are contiguous, from column ``pad`` (its prompt padding) to the end of its
    completion, and column ``c`` has position ``c``. Here row ``i`` starts at column 0 with ``position_ids`` ``pad_i,
    pad_i + 1, ...``: the same tokens at the same positions, with only right padding, which a causal model never
    attends to from an earlier token. So no attention mask is passed.
    """
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
        entropies = _fused_entropies(outputs).gather(1, index).float().masked_fill(~keep, 0.0)
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
    """TRL's ``_get_per_token_logps_and_entropies`` for a text-only batch, with every row shifted past its prompt
    padding (see :func:`can_realign`, which the caller checks): ``batch_size`` rows per forward (all by default), the
    last ``logits_to_keep`` columns scored, each forward cut to its longest row, or with ``full_width`` kept at the
    batch's width, so that passes over the same rows in other groupings run the backbone at the same shapes. Works
    with and without gradients.

    Returns ``(logps, entropies)``, each ``[B, logits_to_keep]``, 0 where the completion mask is 0 after a row's last
    scored token (TRL's fused head gives 0 there too); ``entropies`` is ``None`` unless ``compute_entropy``.
    """
    prompt_ids, completion_ids = input_ids[:, :-logits_to_keep], input_ids[:, -logits_to_keep:]
    prompt_mask, completion_mask = attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
    widths = completion_widths(completion_mask)
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        logps, entropies = _realigned_forward(
            model,
            prompt_ids[rows],
            prompt_mask[rows],
            completion_ids[rows],
            widths[rows],
            compute_entropy,
            autocast,
            full_width=full_width,
        )
        all_logps.append(logps)
        all_entropies.append(entropies)
    return torch.cat(all_logps, dim=0), (torch.cat(all_entropies, dim=0) if compute_entropy else None)


def _micro_batch_target(num_micro_batches: int | Callable[[int], int] | None, planned: int) -> int:
    """How many forwards to run when this process planned ``planned`` (see :func:`no_grad_completion_logps`)."""
    if num_micro_batches is None:
        return planned
    return num_micro_batches(planned) if callable(num_micro_batches) else num_micro_batches


def _dummy_forwards(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    count: int,
    autocast: Callable[[], AbstractContextManager],
) -> None:
    """``count`` forwards of one short row whose results are discarded: the share of a process with nothing to
    score in forwards that gather sharded parameters from every process (ZeRO-3, FSDP)."""
    if prompt_ids.numel() > 0:
        input_ids, attention_mask = prompt_ids[:1], torch.ones_like(prompt_mask[:1])
    else:
        input_ids = torch.zeros(1, 1, dtype=torch.long, device=prompt_ids.device)
        attention_mask = torch.ones_like(input_ids)
    for _ in range(count):
        with autocast():
            model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, fused_lm_head=True)
