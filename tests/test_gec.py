"""EDGE-GRPO's Guided Error Correction (``egpo_trl.sampling.gec``): the cut before an open box, and real runs on
TRL's machinery and a tiny Qwen2 in which incorrect completions are continued, given the answer or replaced by the
reference solution.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config
from recording import Recording, answers_of, rows, texts

from egpo_trl import EGPOTrainer
from egpo_trl.rewards import boxed_accuracy_reward, completion_text


# ----------------------------------------------------------------------------- cuts
def test_a_shortened_completion_is_never_cut_inside_its_own_boxed_answer():
    from transformers import AutoTokenizer

    from egpo_trl.sampling.gec import boxed_safe_prefix
    from egpo_trl.tiny_model import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    text = "<think>23+8=31, 31-15=16</think> \\boxed{16}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    open_at = text.index("\\boxed{")
    for n in range(len(ids) + 1):
        kept = boxed_safe_prefix(ids[:n], tokenizer.decode)
        decoded = tokenizer.decode(kept)
        if n == len(ids):
            assert kept == ids  # a closed box stays whole
        elif len(tokenizer.decode(ids[:n])) > open_at:
            # The cut fell inside "\boxed{16}": back to before the command, never an open box or a bare "\box".
            assert "\\" not in decoded and text.startswith(decoded) and len(decoded) <= open_at, decoded
        else:
            assert kept == ids[:n]  # a cut before the box is left alone


def _linear_safe_prefix(ids, decode):  # the definition, one token at a time
    from egpo_trl.sampling.gec import _open_boxed_start

    n = len(ids)
    while n > 0 and _open_boxed_start(decode(ids[:n])) is not None:
        n -= 1
    return ids[:n]


def test_the_safe_prefix_jumps_over_an_open_box_with_a_few_decodes():
    """The same prefix as cutting one token at a time, for every cut of texts with several boxes, nested braces and
    multi-byte characters; and a long completion with an early open box costs a few dozen decodes, not one per
    token."""
    from transformers import AutoTokenizer

    from egpo_trl.sampling.gec import boxed_safe_prefix, shortened
    from egpo_trl.tiny_model import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    texts = [
        "a \\boxed{1} b \\boxed{\\frac{1}{2}} c \\boxed{x} d",
        "so \\boxed{x = \\boxed{3} + 1} and } {",  # a closed box inside an open one: the cut goes before the outer
        "\\boxed{\\boxed{3}} then \\boxed{{4}} é→ \\boxed{ü}",
        "no box at all, 31-15=16",
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for n in range(len(ids) + 1):
            assert boxed_safe_prefix(ids[:n], tokenizer.decode) == _linear_safe_prefix(ids[:n], tokenizer.decode), (
                text,
                n,
            )
            assert shortened(ids, n, tokenizer.decode) == (
                ids if n >= len(ids) else _linear_safe_prefix(ids[:n], tokenizer.decode)
            )
    ids = tokenizer("Let x = 1. \\boxed{" + "x + 1 = 2, " * 400, add_special_tokens=False)["input_ids"]
    calls = []

    def decode(part):
        calls.append(len(part))
        return tokenizer.decode(part)

    kept = boxed_safe_prefix(ids, decode)
    assert kept == _linear_safe_prefix(ids, tokenizer.decode) and len(ids) > 3000
    nested = tokenizer("so \\boxed{x = \\boxed{3} + 1", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(boxed_safe_prefix(nested, tokenizer.decode)).rstrip() == "so"
    assert tokenizer.decode(kept).rstrip() == "Let x = 1."
    assert len(calls) < 40, len(calls)


def test_the_safe_prefix_matches_the_definition_with_a_byte_fallback_vocabulary():
    """Llama-style vocabularies spell an unknown character in byte tokens and decode a split one to replacement
    characters, so decoded lengths run ahead of the text until its last byte: the cut stays the one-token-at-a-time
    one (here a closed box holding an emoji of four byte tokens, then an open box)."""
    import random

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from egpo_trl.sampling.gec import boxed_safe_prefix

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["\\boxed{", "\\", "{", "}", "5", "x", "▁", "▁the", "\\frac"]:
        vocab.setdefault(piece, len(vocab))
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    decode = tokenizer.decode
    emoji = [vocab[f"<0x{b:02X}>"] for b in "😀".encode()]
    ids = [vocab["\\boxed{"], *emoji, vocab["}"], vocab["\\boxed{"], vocab["5"]]
    lengths = [len(decode(ids[:m])) for m in range(len(ids) + 1)]
    assert lengths != sorted(lengths)  # the lengths dip where the emoji completes
    assert decode(boxed_safe_prefix(ids, decode)) == "\\boxed{😀}" == decode(_linear_safe_prefix(ids, decode))
    # A run of byte tokens that ends mid-character decodes to a replacement character per byte: nine CJK characters
    # in a row make the decoded lengths run far ahead.
    ids = tokenizer("x " + "中" * 9 + "\\boxed{5", add_special_tokens=False)["input_ids"]
    assert decode(boxed_safe_prefix(ids, decode)) == "x " + "中" * 9 == decode(_linear_safe_prefix(ids, decode))
    rng = random.Random(0)
    pieces = ["\\boxed{", "\\", "{", "}", "5", "x", " the", "é", "中", "😀", "\\frac"]
    for _ in range(2000):
        ids = tokenizer("".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))), add_special_tokens=False)
        ids = ids["input_ids"]
        assert boxed_safe_prefix(ids, decode) == _linear_safe_prefix(ids, decode), decode(ids)


# ----------------------------------------------------------------------------- continuations across processes
def _engine(prompt: list[int]) -> list[int]:
    """A deterministic stand-in for the sampler's continuation of one prompt: it names the prompt it came from."""
    return [sum(prompt) % 101, len(prompt), prompt[-1]]


def _server_mode(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """What each process gets back from TRL 1.16's vLLM server mode: the main process generates for the gathered
    prompts (``gather_object``), broadcasts the results and process ``p`` keeps ``[p * n, (p + 1) * n)``, ``n`` being
    its own number of prompts. Colocate mode with tensor parallelism slices the same way within its group."""
    gathered = [prompt for prompts in per_rank for prompt in prompts]
    results = [_engine(prompt) for prompt in gathered]
    return [results[rank * len(prompts) : (rank + 1) * len(prompts)] for rank, prompts in enumerate(per_rank)]


@pytest.mark.parametrize("counts", [(3, 1), (0, 2), (2, 2), (1, 0, 4)])
def test_every_process_gets_its_own_continuations_when_their_counts_differ(counts):
    from egpo_trl.sampling.gec import pad_continuation_batch

    # Each process's prompts (its rows with the cue appended): distinct token lists.
    per_rank = [[[rank + 1, row + 10, 7 * rank + row] for row in range(n)] for rank, n in enumerate(counts)]
    fillers = [[0, rank] for rank in range(len(counts))]
    padded = [pad_continuation_batch(prompts, list(counts), filler) for prompts, filler in zip(per_rank, fillers)]
    assert len({len(batch) for batch in padded}) == 1 and len(padded[0]) == max(max(counts), 1)
    returned = _server_mode(padded)
    for prompts, results in zip(per_rank, returned):
        assert len(results) == len(padded[0])
        assert results[: len(prompts)] == [_engine(prompt) for prompt in prompts]
    # Unpadded, the slices of the processes after the first fall on other processes' rows (or past the end).
    if len(set(counts)) > 1:
        unpadded = _server_mode([prompts or [fillers[0]] for prompts in per_rank])
        assert any(
            results[: len(prompts)] != [_engine(prompt) for prompt in prompts]
            for prompts, results in zip(per_rank, unpadded)
        )


# ----------------------------------------------------------------------------- real runs
def solution_dataset():
    dataset = make_prompt_dataset()
    return dataset.map(lambda row: {"solution": f"S\\boxed{{{row['answer']}}}"})


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["answer", "solution", "reflect"])
def test_guided_error_correction_rewrites_incorrect_completions(tmp_path, tiny_model_dir, strategy):
    probs = {"answer": (0.0, 1.0, 0.0), "solution": (0.0, 0.0, 1.0), "reflect": (1.0, 0.0, 0.0)}[strategy]
    args = config(
        tmp_path,
        max_steps=1,
        max_completion_length=24,
        advantage_estimator="edge_grpo",
        edge_gec=True,
        edge_gec_reflect_prob=probs[0],
        edge_gec_answer_prob=probs[1],
        edge_gec_solution_prob=probs[2],
        edge_gec_answer_template=" \\boxed{{answer}}",
        edge_gec_reflection_cue=" Wait.",
        edge_gec_max_new_tokens=6,
    )
    trainer = Recording(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=solution_dataset())
    trainer.train()
    generated = trainer.generated[0]
    prompts, completions = texts(trainer, generated)
    answers = answers_of(trainer, prompts)
    metrics = trainer.state.log_history[0]
    # The random tiny model never answers correctly: every completion is eligible and rewritten.
    assert metrics["gec/frac_eligible"] == 1.0 and metrics[f"gec/frac_{strategy}"] == 1.0
    # Its time is logged apart from the sampling's, and both within the round's.
    assert 0 < metrics["timing/gec_s"] < metrics["timing/generate_and_score_s"]
    assert metrics["timing/generation_s"] + metrics["timing/gec_s"] <= metrics["timing/generate_and_score_s"]
    # The continuations' own time is part of GEC's; there are none without the reflect strategy.
    if strategy == "reflect":
        assert 0 < metrics["timing/gec_continuation_s"] < metrics["timing/gec_s"]
    else:
        assert metrics["timing/gec_continuation_s"] == 0.0
    # num_tokens counts the tokens trained on: the prompts and the rewritten completions.
    trained_tokens = generated["prompt_mask"].sum() + generated["completion_mask"].sum()
    assert metrics["num_tokens"] == trained_tokens.item()
    assert generated["completion_mask"].sum(dim=1).max() <= 24
    if strategy == "answer":
        assert all(c.endswith(f"\\boxed{{{a}}}") for c, a in zip(completions, answers)), completions
    elif strategy == "solution":
        assert completions == [f"S\\boxed{{{a}}}" for a in answers]
    else:
        assert all("Wait." in c for c in completions), completions
    # TRL scored the rewritten completions (the reference answer makes them correct) and the loss trains on them.
    correct = [1.0 if strategy != "reflect" else r for r in boxed_accuracy_reward(completions, answers)]
    torch.testing.assert_close(generated["batch"]["rewards_per_func"][:, 0], torch.tensor(correct))
    assert set(rows(trainer.consumed[0]["completion_ids"], trainer.consumed[0]["completion_mask"])) == set(
        rows(generated["completion_ids"], generated["completion_mask"])
    )
    assert completion_text(completions[0])


@pytest.mark.slow
def test_guided_error_correction_refuses_reward_functions_it_cannot_rescore_by_row(tmp_path, tiny_model_dir):
    async def async_reward(completions, **kwargs):
        return [0.0] * len(completions)

    args = gec_config(tmp_path, egpo_correctness_reward="boxed_accuracy_reward")
    with pytest.raises(ValueError, match="not reward models or async functions"):
        EGPOTrainer(tiny_model_dir, [boxed_accuracy_reward, async_reward], args, train_dataset=make_prompt_dataset())


@pytest.mark.slow
def test_guided_error_correction_needs_the_answer_column(tmp_path, tiny_model_dir):
    dataset = make_prompt_dataset().remove_columns("answer")
    with pytest.raises(ValueError, match="no 'answer' column, which edge_gec=True"):
        EGPOTrainer(tiny_model_dir, parity_reward, config(tmp_path, edge_gec=True), train_dataset=dataset)


@pytest.mark.slow
def test_an_answer_template_the_boxed_reward_cannot_read_is_refused(tmp_path, tiny_model_dir):
    template = " The answer is {answer}."  # no box: boxed_accuracy_reward would score every injected answer -1
    # (long enough completions for the texts: the tiny model's vocabulary has one token per character)
    args = config(tmp_path, edge_gec=True, edge_gec_answer_template=template, max_completion_length=80)
    with pytest.raises(ValueError, match="boxed_accuracy_reward .the correctness reward. cannot read"):
        EGPOTrainer(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=make_prompt_dataset())
    # Another correctness reward may read it; with no answer injected at all the template is never used.
    EGPOTrainer(tiny_model_dir, parity_reward, args, train_dataset=make_prompt_dataset())
    no_injection = config(
        tmp_path,
        edge_gec=True,
        edge_gec_answer_template=template,
        edge_gec_answer_prob=0.0,
        edge_gec_solution_prob=0.0,
        max_completion_length=80,
    )
    EGPOTrainer(tiny_model_dir, boxed_accuracy_reward, no_injection, train_dataset=make_prompt_dataset())


@pytest.mark.slow
def test_texts_that_cannot_fit_the_completion_length_are_refused(tmp_path, tiny_model_dir):
    """Cut to fit, the cue would leave no room to continue, and the template would lose the answer while
    gec/frac_answer counted it as given: refused at construction, naming the fix."""

    def build(**overrides):
        args = config(tmp_path, edge_gec=True, max_completion_length=24, **overrides)
        return EGPOTrainer(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=make_prompt_dataset())

    from transformers import AutoTokenizer

    from egpo_trl.config import EGPOConfig

    cue = EGPOConfig.__dataclass_fields__["edge_gec_reflection_cue"].default
    needed = len(AutoTokenizer.from_pretrained(tiny_model_dir)(cue, add_special_tokens=False)["input_ids"]) + 2
    with pytest.raises(
        ValueError, match=r"max_completion_length=24 is too short .* edge_gec_reflection_cue \("
    ) as error:
        build()  # the default cue: 69 characters
    assert f"Raise max_completion_length to at least {needed}," in str(error.value)
    with pytest.raises(ValueError, match=r"too short for Guided Error Correction: edge_gec_answer_template"):
        build(edge_gec_reflection_cue=" Wait.")  # the default template: 97 characters
    build(edge_gec_reflection_cue=" Wait.", edge_gec_answer_template=" \\boxed{{answer}}")  # both fit


@pytest.mark.slow
def test_an_answer_that_cannot_fit_leaves_the_row_as_sampled(tmp_path, tiny_model_dir, caplog):
    """A reference answer too long for the room left: the incorrect completion stays as sampled (scored and trained
    as such), counted in gec/frac_answer_too_long and said once, rather than trained on a text cut before its box."""
    dataset = make_prompt_dataset().map(lambda row: {"answer": "1234567890123"})  # " \boxed{...}": 21 tokens
    args = config(
        tmp_path,
        max_steps=1,
        max_completion_length=16,
        advantage_estimator="edge_grpo",
        edge_gec=True,
        edge_gec_reflect_prob=0.0,
        edge_gec_answer_prob=1.0,
        edge_gec_solution_prob=0.0,
        edge_gec_answer_template=" \\boxed{{answer}}",
    )
    with caplog.at_level("WARNING", logger="egpo_trl.sampling.gec"):
        trainer = Recording(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=dataset)
        trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["gec/frac_eligible"] == 1.0 and metrics["gec/frac_answer"] == 0.0
    assert metrics["gec/frac_answer_too_long"] == 1.0
    assert "left 8 incorrect completion(s) as sampled" in caplog.text and "max_completion_length=16" in caplog.text
    _, completions = texts(trainer, trainer.generated[0])
    assert not any("boxed" in c for c in completions), completions
    assert trainer.egpo_last_batch["rewards_per_func"].eq(-1.0).all()

    # The same for a reference solution without the answer's box, whose boxing suffix cannot fit.
    args.edge_gec_answer_prob, args.edge_gec_solution_prob = 0.0, 1.0
    trainer = Recording(
        tiny_model_dir, boxed_accuracy_reward, args, train_dataset=dataset.add_column("solution", ["S"] * 8)
    )
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["gec/frac_solution"] == 0.0 and metrics["gec/frac_answer_too_long"] == 1.0
    assert trainer.egpo_last_batch["rewards_per_func"].eq(-1.0).all()


def gec_config(tmp_path, **overrides):
    settings = dict(
        max_steps=1,
        max_completion_length=40,
        edge_gec=True,
        edge_gec_reflect_prob=0.0,
        edge_gec_answer_prob=0.0,
        edge_gec_solution_prob=1.0,
        edge_gec_answer_template=" \\boxed{{answer}}",
    )
    return config(tmp_path, **{**settings, **overrides})


@pytest.mark.slow
def test_guided_error_correction_without_solutions_says_it_injects_the_answer(tmp_path, tiny_model_dir, caplog):
    from egpo_trl.rewards import boxed_accuracy_reward

    with caplog.at_level("WARNING", logger="egpo_trl.sampling.gec"):
        trainer = EGPOTrainer(
            tiny_model_dir, boxed_accuracy_reward, gec_config(tmp_path), train_dataset=make_prompt_dataset()
        )
    assert "no `solution` column" in caplog.text and "edge_gec_solution_prob=0" in caplog.text
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["gec/frac_solution_as_answer"] == 1.0 and metrics["gec/frac_solution"] == 0.0
    assert trainer.egpo_last_batch["rewards_per_func"].eq(1.0).all()


@pytest.mark.slow
def test_an_injected_answer_is_the_text_the_reward_compares_against(tmp_path, tiny_model_dir):
    """A list of reference answers: the reward compares against the first, so the first is injected (not the
    list's Python spelling), and the corrected completions score +1."""
    dataset = make_prompt_dataset().map(lambda row: {"answer": [f"x={row['answer']}", row["answer"]]})
    args = gec_config(tmp_path, edge_gec_answer_prob=1.0, edge_gec_solution_prob=0.0)
    trainer = Recording(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=dataset)
    trainer.train()
    assert trainer.state.log_history[0]["gec/frac_answer"] == 1.0
    prompts, completions = texts(trainer, trainer.generated[0])
    answers = answers_of(trainer, prompts)
    assert all(c.endswith(f"\\boxed{{x={a}}}") for c, a in zip(completions, answers)), completions
    assert trainer.egpo_last_batch["rewards_per_func"].eq(1.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("solution", ["S", "S \\boxed{0}", "S" * 60])
def test_replaced_solution_ends_with_the_reference_answer(tmp_path, tiny_model_dir, solution):
    from egpo_trl.rewards import boxed_accuracy_reward

    dataset = make_prompt_dataset().map(lambda row: {"solution": solution})
    trainer = EGPOTrainer(tiny_model_dir, boxed_accuracy_reward, gec_config(tmp_path), train_dataset=dataset)
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["gec/frac_solution"] == 1.0 and metrics["gec/frac_solution_boxed"] == 1.0
    # Every replaced completion is the reference solution with the answer's box: scored correct.
    assert trainer.egpo_last_batch["rewards_per_func"].eq(1.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("correctness_first", [True, False])
def test_each_reward_function_scores_each_completion_once(tmp_path, tiny_model_dir, correctness_first):
    from collections import Counter

    seen = []

    def length_reward(completions, log_extra=None, log_metric=None, **kwargs):
        texts_ = [completion_text(c) for c in completions]
        seen.extend(texts_)
        log_extra("length", [len(text) for text in texts_])
        log_metric("length_rows", float(len(texts_)))
        return [1.0] * len(texts_)  # "correct" throughout: a GEC that read this column would rewrite nothing

    args = gec_config(
        tmp_path,
        max_completion_length=24,
        edge_gec_answer_prob=0.5,
        edge_gec_solution_prob=0.0,
        egpo_correctness_reward="boxed_accuracy_reward",
    )
    rewards = [boxed_accuracy_reward, length_reward] if correctness_first else [length_reward, boxed_accuracy_reward]
    trainer = Recording(tiny_model_dir, rewards, args, train_dataset=make_prompt_dataset())
    index = 0 if correctness_first else 1
    assert trainer._egpo_correctness_index == index
    trainer.train()
    metrics = trainer.state.log_history[0]
    batch_size = args.per_device_train_batch_size
    changed = round(metrics["gec/frac_answer"] * batch_size)
    assert 0 < changed < batch_size  # some rows rewritten, some kept: both paths are exercised
    _, final = texts(trainer, trainer.generated[0])
    # Every sampled completion once, then the rewritten ones once: the kept ones are not scored again.
    assert len(seen) == batch_size + changed
    assert not Counter(final) - Counter(seen)
    # The completions table holds one value per row, aligned with its completion; the metric is logged once.
    table = list(trainer._logs["completion"])
    assert len(table) == batch_size and len(trainer._logs["extra"]["length"]) == batch_size
    assert list(trainer._logs["extra"]["length"]) == [len(completion_text(c)) for c in table]
    assert [completion_text(c) for c in table] == final
    assert metrics["length_rows"] == float(batch_size)
    # The kept rows' rewards are those of the first call, the rewritten rows' those of the second.
    torch.testing.assert_close(
        trainer.generated[0]["batch"]["rewards_per_func"][:, index],
        torch.tensor(boxed_accuracy_reward(final, answers_of(trainer, texts(trainer, trainer.generated[0])[0]))),
    )


class SamplerLogpsRecording(Recording):
    """Returns sampling log-probs from the transformers generation, as vLLM does (every token -0.5)."""

    def _generate_single_turn(self, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        return completion_ids, logprobs if logprobs is not None else [[-0.5] * len(ids) for ids in completion_ids]


@pytest.mark.slow
def test_sampler_entropies_fall_back_to_the_policy_pass_for_rewritten_completions(tmp_path, tiny_model_dir, caplog):
    args = gec_config(
        tmp_path,
        max_completion_length=24,
        edge_gec_answer_prob=1.0,
        edge_gec_solution_prob=0.0,
        egpo_entropy_logps="sampler",
    )
    trainer = SamplerLogpsRecording(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=make_prompt_dataset())
    with caplog.at_level("WARNING", logger="egpo_trl.trainer"):
        trainer.train()
    generated = trainer.generated[0]
    assert trainer.state.log_history[0]["gec/frac_answer"] == 1.0
    assert torch.isnan(generated["sampling_per_token_logps"][generated["completion_mask"].bool()]).any()
    batch = generated["batch"]
    assert batch["entropy_source"] == "forward"
    assert torch.isfinite(batch["entropies"]).all() and not torch.isclose(batch["entropies"], torch.tensor(0.5)).all()
    assert torch.isfinite(batch["result"].raw_weights).all()
    assert "tokens without a sampling log-prob" in caplog.text


@pytest.mark.slow
def test_length_metrics_describe_the_rewritten_completions(tmp_path, tiny_model_dir):
    args = gec_config(tmp_path, max_completion_length=64, edge_gec_answer_prob=1.0, edge_gec_solution_prob=0.0)
    args.edge_gec_answer_template = " The answer is \\boxed{{answer}}, as the reference says."
    trainer = Recording(tiny_model_dir, boxed_accuracy_reward, args, train_dataset=make_prompt_dataset())
    trainer.train()
    log = trainer.state.log_history[0]
    generated = trainer.generated[0]
    assert log["gec/frac_answer"] == 1.0
    lengths = generated["completion_mask"].sum(dim=1).float()
    assert log["completions/mean_length"] == pytest.approx(lengths.mean().item(), abs=1e-6)
    assert log["completions/min_length"] == lengths.min().item()
    # Every rewritten completion ends with EOS: none is truncated.
    assert log["completions/clipped_ratio"] == 0.0
    assert log["completions/mean_terminated_length"] == pytest.approx(lengths.mean().item(), abs=1e-6)
