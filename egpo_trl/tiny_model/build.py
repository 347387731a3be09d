"""Build the tiny math reasoning model (``python -m egpo_trl.tiny_model.build --output DIR``): a byte-level BPE
tokenizer and a small ``Qwen2ForCausalLM`` fine-tuned on the synthetic task, evaluated, with a model card."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from egpo_trl.data.synthetic import (
    LEVELS,
    QUESTION_TEMPLATES,
    SPLITS,
    format_prompt,
    make_arithmetic_dataset,
    sample_problem,
    split_of,
)
from egpo_trl.tiny_model import TINY_MODEL_NAME

# ChatML, as used by Qwen2 chat models. The generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILD_INFO_FILE = "build_info.json"


@dataclass
class BuildConfig:
    """Every knob of the build. The defaults make the shipped model."""

    seed: int = 0
    num_threads: int = 2
    device: str = "cpu"
    levels: str = "1,2,3,4,5"
    slip_prob: float = 0.2
    vocab_size: int = 320
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    sft_steps: int = 1500
    batch_size: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    eval_problems: int = 500
    eval_samples: int = 4
    eval_temperature: float = 1.0
    max_new_tokens: int = 96
    tokenizer_corpus_size: int = 5000

    @property
    def level_list(self) -> list[int]:
        return [int(level) for level in self.levels.split(",")]


def _sample_train_example(level: int, rng: random.Random, slip_prob: float) -> tuple[list[dict[str, str]], str]:
    """One (prompt messages, worked solution with slips) of ``level`` from the ``train`` split."""
    while True:
        problem = sample_problem(level, rng)
        if split_of(problem) == "train":
            question = rng.choice(QUESTION_TEMPLATES).format(expr=problem.expression)
            return format_prompt(question), problem.solution(rng, slip_prob)


def build_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on ``corpus``, as a fast tokenizer with the ChatML template (pad id 0, EOS ``<|im_end|>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ("<think>", "</think>")])
    options = {"eos_token": special[2], "pad_token": special[0], "additional_special_tokens": [special[1]]}
    options |= {"padding_side": "left", "model_max_length": 256, "clean_up_tokenization_spaces": False}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **options)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(tokenizer: Any, config: BuildConfig) -> torch.nn.Module:
    """A freshly initialised ``Qwen2ForCausalLM`` sized by ``config``, untied embeddings, vocabulary of ``tokenizer``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    sizes = "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads max_position_embeddings"
    options = {name: getattr(config, name) for name in sizes.split()} | {"tie_word_embeddings": False}
    options |= {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    options |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "use_cache": True}
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), **options))
    sampling = {"do_sample": True, "temperature": config.eval_temperature, "top_p": 1.0, "top_k": 0}
    ids = {"eos_token_id": [tokenizer.eos_token_id], "pad_token_id": tokenizer.pad_token_id}
    model.generation_config = GenerationConfig(**sampling, max_new_tokens=config.max_new_tokens, **ids)
    return model


def supervised_finetune(model: torch.nn.Module, tokenizer: Any, config: BuildConfig, log_every: int = 100) -> list:
    """Fine-tune on a stream of worked solutions (completion tokens only), AdamW with warm-up and cosine decay; returns the log."""
    levels, rng = config.level_list, random.Random(f"sft/{config.seed}")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay, betas=(0.9, 0.98)
    )

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.sft_steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    device = next(model.parameters()).device
    model.train()
    history, running, start = [], 0.0, time.time()
    for step in range(config.sft_steps):
        level = rng.choice(levels)  # one level per batch: similar lengths, little padding
        inputs, labels = [], []
        for _ in range(config.batch_size):
            prompt, solution = _sample_train_example(level, rng, config.slip_prob)
            prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
            completion_ids = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            inputs.append(torch.tensor(list(prompt_ids) + completion_ids))
            labels.append(torch.tensor([-100] * len(prompt_ids) + completion_ids))
        batch = {
            "input_ids": pad_sequence(inputs, batch_first=True, padding_value=tokenizer.pad_token_id),
            "labels": pad_sequence(labels, batch_first=True, padding_value=-100),
            "attention_mask": pad_sequence([torch.ones_like(ids) for ids in inputs], batch_first=True),
        }
        loss = model(**{key: value.to(device) for key, value in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == config.sft_steps:
            elapsed, loss = time.time() - start, running / ((step % log_every) + 1)
            lr = scheduler.get_last_lr()[0]
            history.append({"step": step + 1, "loss": loss, "lr": lr, "time_s": round(elapsed, 1)})
            print(f"  sft step {step + 1}/{config.sft_steps}  loss {loss:.4f}  ({elapsed:.0f}s)", flush=True)
            running = 0.0
    model.eval()
    return history


def evaluate(model: torch.nn.Module, tokenizer: Any, config: BuildConfig) -> dict[str, Any]:
    """Accuracy on the ``test`` split, sampled at ``eval_temperature`` and greedy, overall and per level."""
    from egpo_trl.heldout import heldout_accuracy

    test = make_arithmetic_dataset("test", config.eval_problems, levels=config.levels, seed=config.seed)
    results, options = {}, {"max_new_tokens": config.max_new_tokens, "batch_size": 200, "seed": config.seed}
    sampled = f"temperature_{config.eval_temperature:g}"
    for name, temperature, samples in ((sampled, config.eval_temperature, config.eval_samples), ("greedy", 0.0, 1)):
        result = heldout_accuracy(model, tokenizer, test, num_samples=samples, temperature=temperature, **options)
        results[name] = result.to_dict()
    prompt = tokenizer.apply_chat_template(test[0]["prompt"], add_generation_prompt=True, tokenize=False)
    results["example_completion"] = {"prompt": prompt, "completion": result.completions[0]}
    return results


MODEL_CARD = """---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- egpo
- grpo
- reasoning
- tiny
---

# {name}

A {num_params_m:.2f}M-parameter Qwen2 causal language model that solves chains of additions and
subtractions, reasoning inside `<think>...</think>` and answering in `\\boxed{{}}`. {purpose}

It is **imperfect on purpose**. It was fine-tuned on worked solutions from a sloppy teacher that
slips on {slip_percent:.0f}% of the steps (a result off by 1, 2 or 10), so it knows the procedure (greedy
decoding is right {greedy[accuracy]:.0%} of the time) but, sampled at temperature {eval_temperature:g}, it repeats the
teacher's slips and is right only {sampled[accuracy]:.0%} of the time, less on longer chains. Sampled groups
therefore hold correct and incorrect answers in useful proportions, and a slip is exactly the kind
of mistake that outcome-reward RL can remove: the reward says which completions went wrong, and the
policy learns to stop slipping.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from egpo_trl.tiny_model import tiny_model_path

model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
messages = [{{"role": "user", "content": "Compute 23 + 8 - 15. Think step by step inside <think></think>, then put the final answer in \\\\boxed{{}}."}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
output = model.generate(**inputs, max_new_tokens=96, do_sample=True, temperature=1.0)
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
# <think>23+8=31, 31-15=16</think> \\boxed{{16}}
```

## Prompt format

ChatML (as Qwen2 chat models); the user turn is the question followed by the instruction, and the
generation prompt opens the assistant turn:

```
{example[prompt]}```

A sampled completion (temperature {eval_temperature:g}): `{example[completion]}`

## How it was made

{command}
(seed {seed}), on {machine}. The build took {build_minutes:.1f} minutes{load_note}.

- **Tokenizer**: byte-level BPE trained with the `tokenizers` library on {tokenizer_corpus_size} rendered
  training conversations, {vocab} tokens. Digits are always single tokens. Special tokens:
  `<|endoftext|>` (padding), `<|im_start|>`, `<|im_end|>` (EOS). `<think>` and `</think>` are
  ordinary added tokens (they survive `skip_special_tokens=True`).
- **Architecture**: `Qwen2ForCausalLM`, hidden size {hidden_size}, {num_hidden_layers} layers,
  {num_attention_heads} attention heads ({num_key_value_heads} key/value heads), MLP size {intermediate_size},
  `tie_word_embeddings=False`, float32, {num_parameters:,} parameters.
- **Data**: the synthetic arithmetic task of `egpo_trl.data.synthetic`, levels {levels} (level *n*
  chains *n* operations on numbers from 0 to 30). Only the `train` split is used; a problem's split
  is fixed by a hash of the problem, so the `test` split below is unseen.
- **Supervised fine-tuning**: {sft_steps} steps of {batch_size} freshly sampled worked solutions
  (`<think>a+b=c, c-d=e</think> \\boxed{{e}}`), each step's result slipped with probability {slip_prob:g};
  one level per batch; loss on the assistant tokens only; AdamW (lr {learning_rate:g}, {warmup_steps} warm-up
  steps, cosine decay, weight decay {weight_decay:g}). Final training loss {final_loss:.4f}.

## What it scores

{eval_problems} problems of the `test` split ({per_level} per level), {eval_samples} samples each at
temperature {eval_temperature:g} (top-p 1, no top-k: the sampling `egpo-trl train` uses by default), and
greedy decoding. A completion is correct when its last `\\boxed{{}}` matches the answer
(`egpo_trl.rewards.boxed_accuracy_reward`).

| level | {level_header} | all |
| --- | {level_rule} | --- |
| sampled, T={eval_temperature:g} | {sampled_row} | **{sampled[accuracy]:.1%}** |
| greedy | {greedy_row} | {greedy[accuracy]:.1%} |

{trained_by}

{reproducibility}

## Limitations

A toy: it knows nothing but this task and this prompt format. It exists to exercise RL training
code end to end, not to be evaluated on real benchmarks.
"""


def _write_model_card(output: Path, config: BuildConfig, info: dict[str, Any], tokenizer: Any, name: str) -> None:
    levels = config.level_list
    sampled = info["evaluation"][f"temperature_{config.eval_temperature:g}"]
    greedy, example = info["evaluation"]["greedy"], info["evaluation"]["example_completion"]
    shipped = name == TINY_MODEL_NAME and config == BuildConfig(num_threads=config.num_threads)
    changed = " ".join(
        f"--{key.replace('_', '-')} {value}"
        for key, value in asdict(config).items()
        if value != getattr(BuildConfig(), key) and key != "num_threads"
    )
    if shipped:
        purpose = (
            "It ships with\negpo_trl so that `make demo` can train a real policy with EGPO on a laptop CPU, offline."
        )
        command = (
            f"`make tiny-model`, i.e. `python -m egpo_trl.tiny_model.build --output egpo_trl/assets/{TINY_MODEL_NAME}`"
        )
        trained_by = (
            "`make demo` trains this model with EGPO on the same task and reports the held-out accuracy before\n"
            "and after (see the project README for measured numbers)."
        )
    else:
        purpose = f"It is built by\nthe recipe of `{TINY_MODEL_NAME}`, the tiny model shipped with egpo_trl, with other settings."
        command = f"`python -m egpo_trl.tiny_model.build --output {name} {changed}`"
        trained_by = (
            "Train it with EGPO like the shipped model: `egpo-trl train --config recipes/demo_tiny_cpu.yaml\n"
            f"--model_name_or_path {name}` (add `--use_cpu false` on a GPU)."
        )
    if config.device == "cpu":
        reproducibility = (
            f"Reproducibility: the build is seeded and runs on {config.num_threads} thread(s) (`--num-threads`), so "
            "the same\narguments and torch version on the same kind of CPU give the same weights. Another CPU kind "
            "or torch\nversion can change the last bits of floating-point sums: a rebuild there gives a model of the "
            "same\narchitecture, tokenizer and recipe whose weights and scores may differ slightly."
        )
    else:
        reproducibility = (
            "Reproducibility: the build is seeded, but GPU kernels do not promise bit-identical sums from run "
            "to run:\na rebuild gives a model of the same architecture, tokenizer and recipe whose weights and "
            "scores may\ndiffer slightly."
        )
    load = info.get("load_average") or 0
    shared = f" on a machine shared with other jobs (15-minute load average {load:.1f} at the end)"
    card = MODEL_CARD.format(
        name=name,
        purpose=purpose,
        command=command,
        trained_by=trained_by,
        reproducibility=reproducibility,
        num_params_m=info["num_parameters"] / 1e6,
        sampled=sampled,
        greedy=greedy,
        example=example,
        build_minutes=info["build_seconds"] / 60,
        load_note=shared if load > 1.5 else "",
        slip_percent=100 * config.slip_prob,
        vocab=len(tokenizer),
        final_loss=info["sft_history"][-1]["loss"],
        per_level=config.eval_problems // len(levels),
        level_header=" | ".join(str(level) for level in levels),
        level_rule=" | ".join("---" for _ in levels),
        sampled_row=" | ".join(f"{sampled['by_level'][str(level)]:.1%}" for level in levels),
        greedy_row=" | ".join(f"{greedy['by_level'][str(level)]:.1%}" for level in levels),
        **asdict(config),
        **info,
    )
    (output / "README.md").write_text(card)


def build(config: BuildConfig, output: Path) -> dict[str, Any]:
    """Run the whole build and save the model, tokenizer, build record and model card in ``output``."""
    from transformers import set_seed

    start, cpu_start = time.time(), time.process_time()
    if config.num_threads > 0:  # a fixed thread count fixes the order of floating-point sums
        torch.set_num_threads(config.num_threads)
    if config.device != "cpu" and not (config.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit(f"--device {config.device}: no such CUDA GPU is visible; build on the CPU with --device cpu.")
    device = torch.device(config.device)
    levels = config.level_list
    if any(level not in LEVELS for level in levels):
        raise SystemExit(f"--levels {config.levels}: choose among {list(LEVELS)}.")
    set_seed(config.seed)

    print(f"[1/4] training the tokenizer on {config.tokenizer_corpus_size} conversations", flush=True)
    rng, corpus = random.Random(f"tokenizer/{config.seed}"), []
    for _ in range(config.tokenizer_corpus_size):
        prompt, solution = _sample_train_example(rng.choice(levels), rng, config.slip_prob)
        rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in prompt)
        corpus.append(f"{rendered}<|im_start|>assistant\n{solution}<|im_end|>\n")
    tokenizer = build_tokenizer(corpus, config.vocab_size)

    print("[2/4] building the model", flush=True)
    set_seed(config.seed)
    model = build_model(tokenizer, config).to(device)
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"  Qwen2ForCausalLM with {num_parameters:,} parameters, vocabulary {len(tokenizer)}", flush=True)

    print(f"[3/4] supervised fine-tuning for {config.sft_steps} steps of {config.batch_size}", flush=True)
    history = supervised_finetune(model, tokenizer, config)

    print(f"[4/4] evaluating on {config.eval_problems} held-out problems", flush=True)
    evaluation = evaluate(model, tokenizer, config)
    machine = f"{platform.machine()} CPU ({os.cpu_count()} cores), {torch.get_num_threads()} torch thread(s)"
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else machine
    info = {
        "config": asdict(config),
        "num_parameters": num_parameters,
        "sft_history": history,
        "evaluation": evaluation,
        "build_seconds": round(time.time() - start, 1),
        "build_cpu_seconds": round(time.process_time() - cpu_start, 1),
        "load_average": os.getloadavg()[2] if hasattr(os, "getloadavg") else None,
        "machine": f"{machine}, torch {torch.__version__}",
        "splits": {name: [bucket.start, bucket.stop] for name, bucket in SPLITS.items()},
    }
    with tempfile.TemporaryDirectory(dir=output.parent) as staging:
        model.to("cpu").save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (Path(staging) / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        _write_model_card(Path(staging), config, info, tokenizer, name=output.name)
        shutil.rmtree(output, ignore_errors=True)
        shutil.copytree(staging, output, copy_function=shutil.copyfile)
    output.chmod(0o755)  # the staging folder was private; the model is not
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m egpo_trl.tiny_model.build",
        description="Build the tiny math reasoning model (tokenizer, Qwen2 model, SFT, evaluation, model card).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--output", required=True, help="directory to write the model to")
    parser.add_argument("--overwrite", action="store_true", help="replace --output even if not an earlier build")
    for name, value in asdict(BuildConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value, help=f"build {name}")
    args = vars(parser.parse_args(argv))
    output, overwrite = Path(args.pop("output")), args.pop("overwrite")
    config = BuildConfig(**args)
    if output.exists() and any(output.iterdir()) and not (output / BUILD_INFO_FILE).exists() and not overwrite:
        raise SystemExit(
            f"{output} exists and does not hold a previous tiny-model build ({BUILD_INFO_FILE} is missing). "
            "Choose another --output, or pass --overwrite to replace its contents."
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    info = build(config, output)
    sampled = info["evaluation"][f"temperature_{config.eval_temperature:g}"]
    print(
        f"Saved to {output} in {info['build_seconds'] / 60:.1f} min. Held-out accuracy "
        f"{sampled['accuracy']:.1%} sampled at T={config.eval_temperature:g} "
        f"(greedy {info['evaluation']['greedy']['accuracy']:.1%}); per level {sampled['by_level']}."
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
