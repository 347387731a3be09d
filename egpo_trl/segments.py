"""Thinking / answer segments of a completion on token positions (paper Sec. 5.4): the first ``</think>`` (one token
or several) belongs to neither; thinking is what precedes it (after a leading ``<think>``), the answer what follows.
Without a closing tag the whole completion is thinking and the answer is empty."""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

import torch

DEFAULT_THINK_START = "<think>"
DEFAULT_THINK_END = "</think>"
ENTROPY_SCOPES = ("completion", "thinking", "answer")

_EXTRA_SPAN_TOKENS = 4  # zero-length tokens (decoding to "") allowed inside a tag

_cache_lock = threading.Lock()
_TABLES: weakref.WeakKeyDictionary[Any, dict[tuple[str, int, str], torch.Tensor]] = weakref.WeakKeyDictionary()


def _advance(tag: str, state: int, text: str) -> int:
    """State after reading ``text`` from ``state``: ``len(tag)`` on a match, else the longest tag prefix ending it."""
    window = tag[:state] + text
    if tag in window:
        return len(tag)
    for length in range(min(len(tag) - 1, len(window)), 0, -1):
        if window.endswith(tag[:length]):
            return length
    return 0


def _token_strings(tokenizer: Any) -> list[str]:
    """The text of every token id, decoded on its own (special tokens kept)."""
    ids = [[index] for index in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch"):  # fast tokenizers: decode in Rust
        return backend.decode_batch(ids, skip_special_tokens=False)
    return tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _build_table(strings: list[str], tag: str) -> torch.Tensor:
    """``table[s, v]``: the automaton state after token ``v`` read from state ``s``."""
    length = len(tag)
    rows = [[0] * len(strings) for _ in range(length + 1)]
    suffixes = tuple(tag[start:] for start in range(1, length))
    inner = set(tag[1:])
    for token_id, text in enumerate(strings):
        if not text:  # a token that decodes to nothing leaves the state as it is
            for state in range(length):
                rows[state][token_id] = state
            continue
        # Only a token that starts a match, lies inside the tag or completes one leads to a non-zero state.
        if tag[0] not in text and text not in tag and not (text[0] in inner and text.startswith(suffixes)):
            continue
        for state in range(length):
            rows[state][token_id] = _advance(tag, state, text)
    return torch.tensor(rows, dtype=torch.long)


def _transition_table(tokenizer: Any, tag: str, device: torch.device) -> torch.Tensor:
    """The tag's transition table for this tokenizer on ``device``, built once and cached per device."""
    if not tag:
        raise ValueError("The think tag must be a non-empty string such as '</think>'.")
    key = (tag, len(tokenizer), str(device))
    with _cache_lock:
        tables = _TABLES.setdefault(tokenizer, {})
        if key not in tables:
            cpu_key = (tag, len(tokenizer), "cpu")
            if cpu_key not in tables:
                tables[cpu_key] = _build_table(_token_strings(tokenizer), tag)
            tables[key] = tables[cpu_key].to(device)
        return tables[key]


def tag_spans(
    completion_ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any, tag: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token span of the first ``tag`` in each ``[B, T]`` row: ``(found, start, end)``."""
    if completion_ids.dim() != 2 or mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion_ids and mask must both be [B, T]; got {tuple(completion_ids.shape)} and {tuple(mask.shape)}."
        )
    batch, length = completion_ids.shape
    device = completion_ids.device
    if length == 0:
        nowhere = torch.zeros(batch, dtype=torch.long, device=device)
        return torch.zeros(batch, dtype=torch.bool, device=device), nowhere, nowhere
    table = _transition_table(tokenizer, tag, device)
    vocab = table.shape[1]
    match = len(tag)
    valid = (mask != 0) & (completion_ids >= 0) & (completion_ids < vocab)
    ids = torch.where(valid, completion_ids, torch.zeros_like(completion_ids)).long()
    zero = torch.zeros((), dtype=torch.long, device=device)

    # state_j[:, t]: the automaton run from state 0 over tokens t-j .. t. A match ends at t when some
    # state_j[:, t] reaches `match`; span_len[:, t] keeps the shortest such window (j + 1 tokens).
    state = torch.where(valid, table[0, ids], zero)
    span_len = torch.where(state == match, torch.ones_like(ids), torch.zeros_like(ids))
    for extra in range(1, match + _EXTRA_SPAN_TOKENS):
        previous = torch.nn.functional.pad(state[:, :-1], (1, 0))
        state = torch.where(valid, table[previous, ids], zero)
        span_len = torch.where((state == match) & (span_len == 0), torch.full_like(ids, extra + 1), span_len)

    hits = span_len > 0
    found = hits.any(dim=1)
    first_end = torch.where(found, hits.int().argmax(dim=1), torch.full((batch,), length, device=device))
    first_len = span_len.gather(1, first_end.clamp(max=length - 1).unsqueeze(1)).squeeze(1)
    first_start = torch.where(found, first_end - first_len + 1, first_end)
    return found, first_start, first_end


class SegmentSpans(NamedTuple):
    """Half-open token ranges ``[start, end)`` of the two segments of each row, all ``LongTensor[B]``."""

    thinking_start: torch.Tensor
    thinking_end: torch.Tensor
    answer_start: torch.Tensor
    answer_end: torch.Tensor
    has_answer: torch.Tensor  # BoolTensor[B]: the row has a closing tag


def segment_spans(
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    tokenizer: Any,
    think_start: str = DEFAULT_THINK_START,
    think_end: str = DEFAULT_THINK_END,
) -> SegmentSpans:
    """Token ranges ``[start, end)`` of the thinking and answer segments of each right-padded row."""
    valid = mask != 0
    batch, length = completion_ids.shape
    positions = torch.arange(length, device=completion_ids.device).expand(batch, length)
    # One past the last valid position (0 for an empty row).
    end_of_valid = positions.masked_fill(~valid, -1).amax(dim=1) + 1 if length else positions.new_zeros(batch)

    has_close, close_start, close_end = tag_spans(completion_ids, mask, tokenizer, think_end)
    before_close = valid & (positions < close_start.unsqueeze(1))
    has_open, _, open_end = tag_spans(completion_ids, before_close, tokenizer, think_start)

    thinking_start = torch.where(has_open, open_end + 1, torch.zeros_like(open_end))
    thinking_end = torch.where(has_close, close_start, end_of_valid)
    answer_start = torch.where(has_close, close_end + 1, end_of_valid)
    answer_end = end_of_valid
    thinking_end = torch.maximum(thinking_end, thinking_start)
    answer_start = torch.minimum(answer_start, answer_end)
    return SegmentSpans(thinking_start, thinking_end, answer_start, answer_end, has_close)


def segment_masks(
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    tokenizer: Any,
    think_start: str = DEFAULT_THINK_START,
    think_end: str = DEFAULT_THINK_END,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(thinking_mask, answer_mask)`` of a ``[B, T]`` batch of completions, disjoint and zero outside ``mask``."""
    spans = segment_spans(completion_ids, mask, tokenizer, think_start, think_end)
    batch, length = completion_ids.shape
    positions = torch.arange(length, device=completion_ids.device).expand(batch, length)
    valid = mask != 0
    thinking = valid & (positions >= spans.thinking_start.unsqueeze(1)) & (positions < spans.thinking_end.unsqueeze(1))
    answer = valid & (positions >= spans.answer_start.unsqueeze(1)) & (positions < spans.answer_end.unsqueeze(1))
    return thinking.to(mask.dtype), answer.to(mask.dtype)


def segment_entropy(per_token_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy proxy (paper Eq. 5) of each row over a segment mask: mean of ``-log p``, ``NaN`` for an empty mask."""
    from egpo_trl.advantages import sequence_entropy

    return sequence_entropy(per_token_logps, mask)


def scope_mask(
    completion_ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any, scope: str = "completion"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mask for an entropy ``scope``, and which rows fall back to their whole completion for an empty segment
    (``None`` for ``"completion"``)."""
    if scope not in ENTROPY_SCOPES:
        raise ValueError(f"Unknown entropy scope {scope!r}; choose one of {ENTROPY_SCOPES}.")
    if scope == "completion":
        return mask, None
    thinking, answer = segment_masks(completion_ids, mask, tokenizer)
    chosen = thinking if scope == "thinking" else answer
    fallback = ((chosen != 0).sum(dim=1) == 0) & ((mask != 0).sum(dim=1) > 0)
    return torch.where(fallback.unsqueeze(1), mask, chosen), fallback
