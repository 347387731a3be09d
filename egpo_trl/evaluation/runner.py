"""An evaluation run: ``run.json`` (protocol, checked on resume), ``records/<name>.jsonl``, ``summary.json``/``.md``."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from egpo_trl.evaluation.backends import Generation, SamplingSettings, request_seed
from egpo_trl.evaluation.benchmarks import BenchmarkSpec, build_messages, load_problems
from egpo_trl.evaluation.records import RecordStore
from egpo_trl.evaluation.scoring import score_completion
from egpo_trl.evaluation.summary import benchmark_stats, format_summary_markdown
from egpo_trl.segments import segment_spans

logger = logging.getLogger(__name__)


# Settings that change what a sample is: a resumed run must use the same ones.
PROTOCOL_KEYS = ("model", "temperature", "top_p", "top_k", "max_new_tokens", "chat_template", "system_prompt")
_SPEC_KEYS = ("source", "question_field", "answer_field", "answer_format", "choices_field", "split", "subset")
_SPEC_KEYS += ("instruction",)
LOGPROB_DIGITS = 6


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)


def evaluate(
    backend: Any,
    model_name: str,
    benchmarks: Sequence[BenchmarkSpec],
    output_dir: str,
    settings: SamplingSettings,
    num_samples: int = 8,
    limit: int | None = None,
    seed: int = 0,
    chat_template: str = "auto",
    system_prompt: str | None = None,
    chunk_size: int | None = None,
    label: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate ``model_name`` on ``benchmarks`` with ``num_samples`` samples per problem, continuing a run in
    ``output_dir``; returns the summary, also written to ``summary.json``/``summary.md``."""
    from tqdm.auto import tqdm

    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}.")
    if chat_template not in ("auto", "on", "off"):
        raise ValueError(f"chat_template={chat_template!r}: choose 'auto', 'on' or 'off'.")
    tokenizer = backend.tokenizer
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_template:
        raise ValueError("--chat-template on, but the tokenizer has no chat template; use --chat-template off.")
    use_chat_template = has_template if chat_template == "auto" else chat_template == "on"
    chunk_size = chunk_size or getattr(backend, "batch_size", 256)
    given_label = label
    label = label or os.path.basename(os.path.normpath(model_name)) or model_name

    loaded = [load_problems(spec, limit) for spec in benchmarks]
    if len({spec.name for spec, _ in loaded}) < len(loaded):
        raise ValueError(f"A benchmark is given twice ({[spec.name for spec, _ in loaded]}); each needs its own name.")
    run = {
        "model": model_name,
        "label": label,
        "backend": backend.name,
        "created": _now(),
        "protocol": {
            "model": model_name,
            **asdict(settings),
            "num_samples": num_samples,
            "chat_template": use_chat_template,
            "system_prompt": system_prompt,
        },
        "benchmarks": {spec.name: asdict(spec) for spec, _ in loaded},
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()},
    }
    path = os.path.join(output_dir, "run.json")
    if os.path.exists(path):  # a resumed run: the same protocol and benchmark definitions
        with open(path, encoding="utf-8") as handle:
            existing = json.load(handle)
        for key in PROTOCOL_KEYS:
            if existing.get("protocol", {}).get(key) != run["protocol"][key]:
                raise ValueError(
                    f"{output_dir} holds a run with {key}={existing.get('protocol', {}).get(key)!r}, but this run asks "
                    f"for {key}={run['protocol'][key]!r}. Resuming would mix two protocols: use another --output-dir, "
                    "or the same settings to continue that run."
                )
        for name, spec in run["benchmarks"].items():
            previous = existing.get("benchmarks", {}).get(name) or spec
            for key in (key for key in _SPEC_KEYS if previous.get(key) != spec.get(key)):
                raise ValueError(
                    f"{output_dir}: benchmark {name!r} was evaluated with {key}={previous.get(key)!r}, now "
                    f"{key}={spec.get(key)!r}. Use another --output-dir for a different benchmark definition."
                )
        merged = {**existing, "benchmarks": {**existing.get("benchmarks", {}), **run["benchmarks"]}}
        merged["protocol"] = {**existing.get("protocol", {}), "num_samples": run["protocol"]["num_samples"]}
        merged.setdefault("resumed", []).append({"at": _now(), "backend": run["backend"]})
        run = merged
    _write_json(path, run)
    label = given_label or run.get("label") or label  # a resumed run keeps its name unless given a new one

    results: dict[str, Any] = {}
    for spec, problems in loaded:
        store = RecordStore(os.path.join(output_dir, "records", f"{spec.name}.jsonl"))
        finished = store.load()
        prompts = {}  # the chat template with the generation prompt, or the contents joined by blank lines
        for problem in problems:
            messages = build_messages(problem, spec, system_prompt)
            if use_chat_template:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                prompts[problem.id] = text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                text = "\n\n".join(message["content"] for message in messages)
                prompts[problem.id] = text, list(tokenizer(text)["input_ids"])
        pending = [(problem, sample) for problem in problems for sample in range(num_samples)]
        pending = [(problem, sample) for problem, sample in pending if (problem.id, sample) not in finished]
        # Longest prompts first, so that batches are padded little and memory peaks early.
        pending.sort(key=lambda item: (-len(prompts[item[0].id][1]), item[0].index, item[1]))
        context = getattr(backend, "max_context", None)
        too_long = [item for item in pending if context and len(prompts[item[0].id][1]) >= context]
        if too_long:  # recorded as unanswered
            logger.warning(
                "%s: %d of %d problems have prompts of at least the model's context (%d tokens); their samples "
                "are recorded with finish_reason='prompt_too_long' and count as incorrect.",
                *(spec.name, len({problem.id for problem, _ in too_long}), len(problems), context),
            )
            pending = pending[len(too_long) :]
        if finished:
            logger.info("%s: %d samples already finished, %d to go.", spec.name, len(finished), len(pending))
        total = len(problems) * num_samples
        chunks = [too_long] if too_long else []
        chunks += [pending[start : start + chunk_size] for start in range(0, len(pending), chunk_size)]
        with tqdm(total=total, initial=total - len(pending), desc=spec.display_name, disable=not progress) as bar:
            for chunk in chunks:
                seeds = [request_seed(seed, spec.name, problem.id, sample) for problem, sample in chunk]
                if chunk is too_long:
                    generations = [Generation([], [], "", "prompt_too_long") for _ in chunk]
                else:
                    generations = backend.generate([prompts[problem.id][1] for problem, _ in chunk], settings, seeds)
                padded = pad_sequence([torch.tensor(g.token_ids, dtype=torch.long) for g in generations], True)
                mask = pad_sequence([torch.ones(len(g.token_ids), dtype=torch.long) for g in generations], True)
                spans = segment_spans(padded, mask, tokenizer)
                records = []
                for row, ((problem, sample), generation, sample_seed) in enumerate(zip(chunk, generations, seeds)):
                    text, ids, logprobs = generation.text, generation.token_ids, generation.logprobs
                    extracted, correct = score_completion(text, problem.gold, spec.answer_format, problem.choices)
                    prompt_text, prompt_ids = prompts[problem.id]
                    record = {"benchmark": spec.name, "problem_id": problem.id, "problem_index": problem.index}
                    record |= {"sample": sample, "prompt": prompt_text, "completion": text, "gold": problem.gold}
                    record |= {"extracted": extracted, "correct": correct, "finish_reason": generation.finish_reason}
                    record |= {"num_prompt_tokens": len(prompt_ids), "num_completion_tokens": len(ids)}
                    record["entropy"] = -sum(logprobs) / len(logprobs) if logprobs else None
                    record["thinking_span"] = [int(spans.thinking_start[row]), int(spans.thinking_end[row])]
                    record["answer_span"] = [int(spans.answer_start[row]), int(spans.answer_end[row])]
                    record |= {"completion_ids": ids, "logprobs": [round(value, LOGPROB_DIGITS) for value in logprobs]}
                    records.append(record | {"backend": backend.name, "seed": sample_seed, "meta": problem.meta})
                store.append(records)
                for record in records:
                    finished.setdefault((record["problem_id"], record["sample"]), record)
                bar.update(len(chunk))
        wanted = {problem.id for problem in problems}
        kept = [record for (problem_id, _), record in finished.items() if problem_id in wanted]
        stats = benchmark_stats(kept, num_samples, len(problems))
        if stats["unscored_samples"]:
            logger.warning(
                "%s: %d samples without a verdict, left out of pass@1.", spec.name, stats["unscored_samples"]
            )
        results[spec.name] = {**stats, "display_name": spec.display_name}

    path = os.path.join(output_dir, "summary.json")
    previous: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            previous = json.load(handle).get("benchmarks", {})
    backend_name = run["resumed"][-1]["backend"] if "resumed" in run else run["backend"]
    summary = {"model": run["model"], "label": label, "backend": backend_name, "protocol": run["protocol"]}
    summary |= {"updated": _now(), "benchmarks": {**previous, **results}}  # earlier benchmarks of this run stay
    _write_json(path, summary)
    with open(os.path.join(output_dir, "summary.md"), "w", encoding="utf-8") as handle:
        handle.write(format_summary_markdown(summary))
    return summary
