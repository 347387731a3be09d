"""The shipped tiny math model: plain transformers loading, prompt format, tokenizer, and a reproducible build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from egpo_trl.data.synthetic import DEFAULT_INSTRUCTION, make_arithmetic_dataset
from egpo_trl.rewards import boxed_accuracy_reward, think_format_reward
from egpo_trl.tiny_model import tiny_model_path
from egpo_trl.tiny_model.build import BUILD_INFO_FILE, CHAT_TEMPLATE
from egpo_trl.tiny_model.build import main as build_main

MODEL_DIR = Path(tiny_model_path())


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_ships_a_small_qwen2_with_untied_embeddings(model):
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    num_parameters = sum(p.numel() for p in model.parameters())
    assert 500_000 < num_parameters < 5_000_000
    assert model.dtype == torch.float32
    size_mb = sum(f.stat().st_size for f in MODEL_DIR.iterdir()) / 2**20
    assert size_mb < 8, f"the shipped model takes {size_mb:.1f} MB"
    assert (MODEL_DIR / "model.safetensors").is_file()


def test_chat_template_renders_the_prompt_format(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 2 + 3."}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompute 2 + 3.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = make_arithmetic_dataset("test", 1, seed=0)[0]["prompt"]
    rendered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith(f"{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_special_tokens_and_round_trip(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    solution = "<think>23+8=31, 31-15=16</think> \\boxed{16}"
    ids = tokenizer(solution, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == solution
    # <think> markers are ordinary tokens: they survive the decoding TRL uses.
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == solution
    assert tokenizer.tokenize("2026") == ["2", "0", "2", "6"]  # digits are single tokens


def test_greedy_answers_are_in_the_paper_format_and_mostly_right(model, tokenizer):
    problems = make_arithmetic_dataset("test", 8, levels=(1, 2), seed=0)
    inputs = tokenizer.apply_chat_template(
        list(problems["prompt"]), add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is as fast, and immune to other jobs on the cores
    try:
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    assert think_format_reward(completions) == [1.0] * len(texts), texts
    assert boxed_accuracy_reward(completions, problems["answer"]).count(1.0) >= 6, texts


def test_model_card_reports_the_build_record():
    info = json.loads((MODEL_DIR / BUILD_INFO_FILE).read_text())
    card = (MODEL_DIR / "README.md").read_text()
    sampled = info["evaluation"][f"temperature_{info['config']['eval_temperature']:g}"]["accuracy"]
    assert f"**{sampled:.1%}**" in card
    assert "make tiny-model" in card
    assert 0.2 <= sampled <= 0.6, "the shipped model should start in the 20-60% range"


TINY_BUILD = [
    "--hidden-size",
    "16",
    "--intermediate-size",
    "32",
    "--num-hidden-layers",
    "1",
    "--num-attention-heads",
    "2",
    "--num-key-value-heads",
    "1",
    "--sft-steps",
    "3",
    "--batch-size",
    "8",
    "--warmup-steps",
    "1",
    "--eval-problems",
    "5",
    "--eval-samples",
    "1",
    "--max-new-tokens",
    "8",
    "--tokenizer-corpus-size",
    "200",
]


@pytest.mark.slow
def test_build_is_deterministic_and_loads_with_plain_transformers(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert build_main(["--output", str(first), *TINY_BUILD]) == 0
    assert build_main(["--output", str(second), *TINY_BUILD]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(first)
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert model.config.tie_word_embeddings is False and model.config.hidden_size == 16
    assert tokenizer.chat_template == CHAT_TEMPLATE
    card = (first / "README.md").read_text()
    assert card.startswith("---") and "\n# first\n" in card  # a variant is named after its folder
    assert "`python -m egpo_trl.tiny_model.build --output first --hidden-size 16" in card  # and says how it was made
    # A rebuild replaces an earlier build in place.
    assert build_main(["--output", str(first), *TINY_BUILD, "--seed", "1"]) == 0
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()


def test_shipped_model_card_is_what_the_build_writes(tmp_path):
    from egpo_trl.tiny_model.build import BuildConfig, _write_model_card

    info = json.loads((MODEL_DIR / BUILD_INFO_FILE).read_text())
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    _write_model_card(tmp_path, BuildConfig(**info["config"]), info, tokenizer, name=MODEL_DIR.name)
    assert (tmp_path / "README.md").read_text() == (MODEL_DIR / "README.md").read_text()


def test_build_refuses_a_gpu_it_does_not_have(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit, match="--device cpu"):
        build_main(["--output", str(tmp_path / "model"), *TINY_BUILD, "--device", "cuda"])


def test_build_refuses_a_folder_that_is_not_an_earlier_build(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="--overwrite"):
        build_main(["--output", str(tmp_path), *TINY_BUILD])
    assert (tmp_path / "notes.txt").read_text() == "mine"
