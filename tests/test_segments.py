"""The thinking / answer split on token positions (egpo_trl.segments), on real tokenizers built offline."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from egpo_trl.segments import scope_mask, segment_entropy, segment_masks, segment_spans, tag_spans

TINY_MODEL_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "egpo_trl", "assets", "tiny-math-qwen2")


def _train_bpe(add_think_tokens: bool):
    """A byte-level BPE (GPT-2/Qwen2 style pre-tokenization) trained on reasoning traces with tags."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = []
    for _ in range(3000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        before = rng.choice(["", ".", " ", "\n", "\n\n", ".\n"])
        after = rng.choice(["", " ", "\n", "\n\n"])
        corpus.append(f"<think>\nLet me add {a} and {b}: {a}+{b}={a + b}{before}</think>{after}So \\boxed{{{a + b}}}.")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    if add_think_tokens:  # as DeepSeek-R1-Distill: the tags are single added (non-special) tokens
        tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module")
def multi_token_tokenizer():
    return _train_bpe(add_think_tokens=False)


@pytest.fixture(scope="module")
def single_token_tokenizer():
    return _train_bpe(add_think_tokens=True)


@pytest.fixture(params=["multi_token_tokenizer", "single_token_tokenizer"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def _batch(tokenizer, texts):
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def _decode_masked(tokenizer, ids, mask):
    return tokenizer.decode([token for token, keep in zip(ids.tolist(), mask.tolist()) if keep])


def test_close_tag_spans_several_context_dependent_tokens(multi_token_tokenizer):
    tok = multi_token_tokenizer
    plain = tok("</think>", add_special_tokens=False)["input_ids"]
    after_period = tok(".</think>", add_special_tokens=False)["input_ids"]
    assert len(plain) > 1, "the tag must be spelled with several tokens for this test"
    assert after_period[0] not in plain, "a merged '.</' token: no fixed id sequence can find the tag"

    ids, mask = _batch(tok, ["x.</think>y", "x </think>y", "x</think>y"])
    found, start, end = tag_spans(ids, mask, tok, "</think>")
    assert found.all()
    for row in range(3):
        spelled = tok.decode(ids[row, start[row] : end[row] + 1].tolist())
        assert "</think>" in spelled
        # the span is minimal: dropping its first or last token loses the tag
        assert "</think>" not in tok.decode(ids[row, start[row] + 1 : end[row] + 1].tolist())
        assert "</think>" not in tok.decode(ids[row, start[row] : end[row]].tolist())


def test_split_of_a_real_completion(tokenizer):
    text = "<think>\nLet me add 12 and 30: 12+30=42.</think>\n\nSo \\boxed{42}."
    ids, mask = _batch(tokenizer, [text])
    thinking, answer = segment_masks(ids, mask, tokenizer)
    thinking_text = _decode_masked(tokenizer, ids[0], thinking[0])
    answer_text = _decode_masked(tokenizer, ids[0], answer[0])
    assert "12+30=42" in thinking_text and "think" not in thinking_text
    assert "\nLet me add 12 and 30: 12+30=42.".startswith(thinking_text)
    assert answer_text.endswith("So \\boxed{42}.") and "think" not in answer_text
    assert not (thinking.bool() & answer.bool()).any()
    assert thinking.dtype == mask.dtype


def test_completion_without_closing_tag_is_all_thinking(tokenizer):
    texts = ["<think>\nLet me add 1 and 2: 1+2=3 and then", "no tags at all, \\boxed{3}", "cut off in the tag </thi"]
    ids, mask = _batch(tokenizer, texts)
    thinking, answer = segment_masks(ids, mask, tokenizer)
    assert answer.sum() == 0
    assert "<think>" not in _decode_masked(tokenizer, ids[0], thinking[0])
    assert torch.equal(thinking[1], mask[1])  # no tags: the whole completion is thinking
    assert torch.equal(thinking[2], mask[2])
    spans = segment_spans(ids, mask, tokenizer)
    assert not spans.has_answer.any()

    logps = -torch.rand(ids.shape, dtype=torch.float64) * mask
    answer_entropy = segment_entropy(logps, answer)
    assert torch.isnan(answer_entropy).all()
    assert torch.allclose(segment_entropy(logps, thinking)[1], segment_entropy(logps, mask)[1])


def test_first_closing_tag_counts_and_padding_is_ignored(tokenizer):
    texts = ["a</think>b</think>c", "short</think>ok"]
    ids, mask = _batch(tokenizer, texts)
    thinking, answer = segment_masks(ids, mask, tokenizer)
    assert _decode_masked(tokenizer, ids[0], thinking[0]) == "a"
    assert _decode_masked(tokenizer, ids[0], answer[0]).endswith("c")
    assert "b" in _decode_masked(tokenizer, ids[0], answer[0])
    assert _decode_masked(tokenizer, ids[1], answer[1]) == "ok"
    assert (answer[1] <= mask[1]).all() and answer[1, mask[1] == 0].sum() == 0


def _reference_masks(tokenizer, row_ids):
    """Character-offset reference: decode each token, find the tags in the joined text, map back to tokens."""
    pieces = tokenizer.backend_tokenizer.decode_batch([[i] for i in row_ids], skip_special_tokens=False)
    starts, position = [], 0
    for piece in pieces:
        starts.append(position)
        position += len(piece)
    ends = starts[1:] + [position]
    text = "".join(pieces)
    close = text.find("</think>")
    n = len(row_ids)
    if close < 0:
        limit_char, answer = position, [0] * n
    else:
        first_tag_token = next(i for i in range(n) if ends[i] > close)
        limit_char = starts[first_tag_token]
        answer = [int(starts[i] >= close + len("</think>")) for i in range(n)]
    opening = text[:limit_char].find("<think>")
    begin = opening + len("<think>") if opening >= 0 else 0
    thinking = [int(starts[i] >= begin and ends[i] <= limit_char) for i in range(n)]
    return thinking, answer


FRAGMENTS = [
    "<think>",
    "</think>",
    "</",
    "think",
    ">",
    "<",
    "/",
    "th",
    "ink>",
    "\n\n",
    " ",
    ".",
    "So",
    "42",
    "é",
    "数",
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=14), min_size=1, max_size=4))
def test_matches_character_offset_reference(multi_token_tokenizer, single_token_tokenizer, rows):
    for tok in (multi_token_tokenizer, single_token_tokenizer):
        texts = ["".join(parts) for parts in rows]
        encoded = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
        width = max(1, max(len(row) for row in encoded))
        ids = torch.full((len(texts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, row in enumerate(encoded):
            if row:
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
        thinking, answer = segment_masks(ids, mask, tok)
        for i, row in enumerate(encoded):
            want_thinking, want_answer = _reference_masks(tok, row) if row else ([], [])
            assert thinking[i, : len(row)].tolist() == want_thinking, texts[i]
            assert answer[i, : len(row)].tolist() == want_answer, texts[i]
            assert thinking[i, len(row) :].sum() == 0 and answer[i, len(row) :].sum() == 0


def test_segment_entropy_hand_computed():
    logps = torch.tensor([[-1.0, -2.0, -3.0, -9.0], [-0.5, -0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    entropy = segment_entropy(logps, mask)
    assert entropy[0].item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3, padding ignored
    assert math.isnan(entropy[1].item())


def test_scope_mask_and_fallback(single_token_tokenizer):
    tok = single_token_tokenizer
    ids, mask = _batch(tok, ["<think>\nLet me add 1 and 2</think> So \\boxed{3}.", "no tags, \\boxed{3}"])
    thinking, answer = segment_masks(ids, mask, tok)
    whole, fallback = scope_mask(ids, mask, tok, "completion")
    assert whole is mask and fallback is None
    thinking_scope, fallback = scope_mask(ids, mask, tok, "thinking")
    assert torch.equal(thinking_scope, thinking) and not fallback.any()
    answer_scope, fallback = scope_mask(ids, mask, tok, "answer")
    assert torch.equal(answer_scope[0], answer[0])
    assert torch.equal(answer_scope[1], mask[1])  # empty answer segment: falls back to the whole completion
    assert fallback.tolist() == [False, True]
    with pytest.raises(ValueError, match="completion"):
        scope_mask(ids, mask, tok, "reasoning")


def test_char_level_tokenizer_with_special_tags(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask = _batch(tok, ["<think>1+2=3</think> \\boxed{3}<|im_end|>", "<think>1+2="])
    thinking, answer = segment_masks(ids, mask, tok)
    tokens = tok.convert_ids_to_tokens(ids[0].tolist())
    close = tokens.index("</think>")
    assert thinking[0].tolist() == [0] + [1] * (close - 1) + [0] * (len(tokens) - close)
    assert answer[0].tolist() == [0] * (close + 1) + [1] * (len(tokens) - close - 1)
    assert tokens[-1] == "<|im_end|>" and answer[0, -1] == 1  # the end-of-turn token belongs to the answer
    assert thinking[1].sum() == len("1+2=") and answer[1].sum() == 0


@pytest.mark.skipif(not os.path.isdir(TINY_MODEL_DIR), reason="the shipped tiny model is not built")
def test_shipped_tiny_model_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    text = "<think>23+8=31, 31-15=16</think> \\boxed{16}"
    ids, mask = _batch(tok, [text])
    thinking, answer = segment_masks(ids, mask, tok)
    assert _decode_masked(tok, ids[0], thinking[0]).strip() == "23+8=31, 31-15=16"
    assert _decode_masked(tok, ids[0], answer[0]).strip() == "\\boxed{16}"
