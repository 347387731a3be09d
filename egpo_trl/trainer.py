"""``EGPOTrainer``: TRL's ``GRPOTrainer`` with EGPO's entropy-calibrated advantages.

The trainer is glue. TRL generates, scores and builds the batch as usual; after
``GRPOTrainer._generate_and_score_completions`` returns, EGPO

1. takes the old policy's per-token log-probs of the completion tokens the loss scores (TRL's
   ``completion_mask`` after ``mask_truncated_completions``, times its ``tool_mask``),
2. turns them into one entropy proxy per completion (:func:`~egpo_trl.advantages.sequence_entropy`),
3. gathers entropies across processes (groups may span processes; TRL gathers the rewards the same
   way), computes the advantages on the global tensors with the configured estimator
   (:func:`~egpo_trl.advantages.egpo_advantages` by default), and keeps this process's slice,
4. puts the result where TRL expects it (``advantages`` in the batch and in the completions table).

TRL's clipped objective, every loss type, ``num_iterations``, gradient accumulation, PEFT, vLLM and
multi-process training are untouched.

Where the log-probs come from (the paper's "zero-overhead" proxy):

* ``old_per_token_logps`` when TRL computed them: with ``num_iterations > 1``, when generation and
  optimisation steps are misaligned, and with vLLM importance-sampling correction (on by default).
  No extra cost.
* otherwise, with ``egpo_entropy_logps="sampler"``, the sampling log-probs vLLM returned (``use_vllm``
  without importance-sampling correction), when sampling is plain (no top-p, top-k, min-p, penalties or
  ``min_tokens``: see :func:`~egpo_trl.config.distribution_changing_sampling_options`), so that they are
  the policy's at the temperature up to the engines' numerical differences. No extra cost.
* otherwise (the default ``egpo_entropy_logps="policy"``, and plain transformers generation with
  ``num_iterations = 1``) one extra no-grad forward pass of the policy over the generation batch, as verl
  (the paper's trainer) computes the old policy's log-probs. It costs about a third of a training step's
  forward+backward; ``benchmarks/`` and ``docs/multi_gpu.md`` measure it.

The baselines run through the same trainer (``docs/baselines.md``):

* ``advantage_estimator="edge_grpo"`` reads full-distribution Shannon entropies. When TRL computes the
  old log-probs it computes them in that same no-grad pass; otherwise the one extra pass above returns
  both. They are constants of the objective, taken under the policy that sampled the batch.
* ``dynamic_sampling`` (DAPO) generates extra rounds for prompts drawn from the training set until the
  generation batch is made of informative groups; the decision is taken on gathered tensors, so every
  process keeps the same groups, and the batch keeps its shape. TRL's dataloader, epochs, buffering,
  shuffling and ``num_iterations`` see a normal generation batch.
* ``edge_gec`` (EDGE-GRPO's Guided Error Correction) rewrites incorrect completions after generation and
  before TRL scores them.
* ``overlong_buffer_length`` (DAPO) adds :func:`~egpo_trl.rewards.overlong_penalty_reward` to the reward
  functions.
"""

from __future__ import annotations

import inspect
import logging
import time
from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id

from egpo_trl.advantages import (
    GROUP_ALL_CORRECT,
    GROUP_ALL_INCORRECT,
    GROUP_MIXED,
    AdvantageOutput,
    get_advantage_estimator,
    get_entropy_input,
    normalize_then_sum_advantages,
    sequence_entropy,
    sequence_mean,
)
from egpo_trl.config import EGPOConfig, distribution_changing_sampling_options
from egpo_trl.rewards import answers_match, extract_last_boxed, make_overlong_penalty_reward

logger = logging.getLogger(__name__)

__all__ = ["EGPOTrainer"]

# Keyword arguments of GRPOTrainer's log-prob helper that the batch may carry (multimodal inputs).
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# Batch tensors that are left-padded (the prompt side); every other per-token tensor is right-padded.
_LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")
# Per-token entropies captured from TRL's old-log-prob pass travel in the batch under this key until used.
_TOKEN_ENTROPY_KEY = "egpo_token_entropies"
# TRL's importance-sampling correction multiplies the loss by its ratios: below this mean, the run is told.
IS_RATIO_WARNING_THRESHOLD = 0.5


_BOXED = "\\boxed{"
# Appended to a reference solution (Guided Error Correction) whose last box does not give the reference answer.
SOLUTION_ANSWER_SUFFIX = "\n\nThe final answer is \\boxed{{answer}}."


def _ends_inside_boxed(text: str) -> bool:
    """Whether ``text`` stops inside a ``\\boxed{...}`` (or inside the command itself, e.g. ``... \\box``)."""
    start = text.rfind(_BOXED)
    if start >= 0:
        depth = 1
        for char in text[start + len(_BOXED) :]:
            depth += 1 if char == "{" else -1 if char == "}" else 0
            if depth == 0:
                break
        if depth > 0:
            return True
    return any(text.endswith(_BOXED[:k]) for k in range(1, len(_BOXED)))


def boxed_safe_prefix(ids: list[int], decode) -> list[int]:
    """The longest prefix of ``ids`` whose text (``decode(ids)``) does not stop inside a ``\\boxed{}``.

    Guided Error Correction shortens a completion to make room for the injected text. Cutting inside the
    completion's own ``\\boxed{`` would leave the injected answer inside an unclosed box: the prefix is cut back
    to before it instead.
    """
    n = len(ids)
    while n > 0 and _ends_inside_boxed(decode(ids[:n])):
        n -= 1
    return ids[:n]


class EGPOTrainer(GRPOTrainer):
    """Trainer for Entropy-Guided Policy Optimization (EGPO), a drop-in replacement for TRL's ``GRPOTrainer``.

    It takes exactly ``GRPOTrainer``'s arguments; ``args`` is an :class:`~egpo_trl.EGPOConfig`.

    Example::

        from egpo_trl import EGPOConfig, EGPOTrainer
        from egpo_trl.rewards import boxed_accuracy_reward

        trainer = EGPOTrainer(
            model="Qwen/Qwen2.5-Math-1.5B",
            reward_funcs=boxed_accuracy_reward,
            args=EGPOConfig(output_dir="out", num_generations=16),
            train_dataset=dataset,  # columns: prompt, answer
        )
        trainer.train()

    Correctness rule with several reward functions: a completion is correct when the reward function
    named by ``args.egpo_correctness_reward`` (the first one by default) gives it a reward > 0. Group
    types (entirely-correct, mixed, entirely-incorrect) follow from that; mixed-group advantages use
    the weighted sum of all rewards, as GRPO does. That function must be a binary verifier (+1/-1 or
    1/0 values) for the estimators and features that use group types; any other values stop training
    with an error naming the fix (see the README, "Where EGPOTrainer differs from GRPOTrainer").

    Metrics logged beside TRL's, per generation batch (``egpo/*``): the fraction of entirely-correct,
    mixed and entirely-incorrect groups, the mean weight on correct and on incorrect completions, the
    mean entropy of correct and of incorrect completions and their gap (incorrect minus correct), the
    fraction of raw weights at each clip bound, and whether an extra forward pass was needed. With
    ``edge_grpo``, ``egpo/token_entropy_mean`` (the mean Shannon entropy); with dynamic sampling,
    ``dynamic_sampling/*`` (rounds needed, fraction of informative groups, whether the cap was hit); with
    Guided Error Correction, ``gec/*`` (fraction of completions continued, given the answer, replaced).
    """

    _tag_names = ["trl", "egpo"]
    _name = "EGPO"

    def __init__(self, model, reward_funcs=None, args: EGPOConfig | None = None, *pos_args: Any, **kwargs: Any):
        if args is None:  # as GRPOTrainer: an output folder named after the model
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = EGPOConfig(f"{model_name.split('/')[-1]}-EGPO")
        elif not isinstance(args, EGPOConfig):
            raise TypeError(
                f"EGPOTrainer needs an EGPOConfig, got {type(args).__name__}. Build one with the same fields, e.g. "
                "`EGPOConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})`."
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"This process sees {args.n_gpu} GPUs, so Trainer would wrap the model in nn.DataParallel, which GRPO "
                "and EGPO cannot use (groups and rewards are laid out per process). Run one process per GPU "
                "(`accelerate launch`, or a recipe with `accelerate_config`), or make one GPU visible: "
                "CUDA_VISIBLE_DEVICES=0."
            )
        reward_funcs = self._with_overlong_reward(reward_funcs, args)
        # vLLM colocate mode on a CPU build of vLLM needs its own weight sync (a no-op otherwise): see vllm_cpu.py.
        from egpo_trl.vllm_cpu import colocate_on_cpu

        with colocate_on_cpu(self, model, args):
            super().__init__(model, reward_funcs, args, *pos_args, **kwargs)

        self._egpo_estimator = get_advantage_estimator(args.advantage_estimator)
        self._egpo_entropy_input = get_entropy_input(self._egpo_estimator)
        #: What needs a binary correctness reward (see _egpo_correct), as named in the error.
        self._egpo_binary_features = [
            name
            for name, needed in (
                (
                    f"advantage_estimator={args.advantage_estimator!r}",
                    getattr(self._egpo_estimator, "binary_correctness", False),
                ),
                (
                    "dynamic_sampling_metric='correctness'",
                    args.dynamic_sampling and args.dynamic_sampling_metric == "correctness",
                ),
                ("edge_gec", args.edge_gec),
            )
            if needed
        ]
        if args.egpo_correctness_reward is None:
            self._egpo_correctness_index = 0
        elif args.egpo_correctness_reward in self.reward_func_names:
            self._egpo_correctness_index = self.reward_func_names.index(args.egpo_correctness_reward)
        else:
            raise ValueError(
                f"egpo_correctness_reward={args.egpo_correctness_reward!r} names no reward function; set it to one of "
                f"{self.reward_func_names} (or leave it unset to use the first)."
            )
        if args.egpo_entropy_scope != "completion":
            from egpo_trl.segments import segment_masks  # noqa: F401  (fail at init, not at the first step)
        self._check_sampling_features()
        self._egpo_rewards_per_func: torch.Tensor | None = None
        self._egpo_capture_entropy = False  # capture the entropies of TRL's next old-log-prob pass
        self._egpo_captured_entropies: torch.Tensor | None = None
        self._egpo_round_inputs: list[dict[str, Any]] | None = None
        #: What the last generation batch computed (global tensors), for inspection and tests.
        self.egpo_last_batch: dict[str, Any] = {}

    @staticmethod
    def _with_overlong_reward(reward_funcs, args: EGPOConfig):
        """The reward functions, with DAPO's overlong penalty appended when ``overlong_buffer_length`` is set."""
        if args.overlong_buffer_length is None:
            return reward_funcs
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if any(getattr(func, "__name__", None) == "overlong_penalty" for func in funcs):
            raise ValueError(
                "overlong_buffer_length is set and the reward functions already include overlong_penalty; remove one "
                "of them (the trainer adds the penalty itself when overlong_buffer_length is set)."
            )
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs) + 1:
            raise ValueError(
                f"With overlong_buffer_length set the trainer adds a reward function (overlong_penalty, last), so "
                f"reward_weights needs {len(funcs) + 1} entries, got {len(args.reward_weights)}: append its weight "
                "(1.0) or leave reward_weights unset."
            )
        penalty = make_overlong_penalty_reward(
            args.max_completion_length, args.overlong_buffer_length, args.overlong_penalty_factor
        )
        return [*funcs, penalty]

    def _check_sampling_features(self) -> None:
        """Refuse, at init, combinations that dynamic sampling or Guided Error Correction do not support."""
        args = self.args
        if args.dynamic_sampling or args.edge_gec:
            feature = "dynamic_sampling" if args.dynamic_sampling else "edge_gec"
            unsupported = {
                "vision-language models": bool(getattr(self, "_is_vlm", False)),
                "tools": bool(self.tools),
                "rollout_func": self.rollout_func is not None,
                "environment_factory": self.environment_factories is not None,
            }
            for name, used in unsupported.items():
                if used:
                    raise ValueError(f"{feature} does not support {name}; turn one of them off.")
        if args.dynamic_sampling:
            from datasets import IterableDataset

            if self.train_dataset is None or isinstance(self.train_dataset, IterableDataset):
                raise ValueError(
                    "dynamic_sampling draws extra prompts from train_dataset by index, so it needs a map-style "
                    "datasets.Dataset (not an IterableDataset); load the data without streaming, or turn it off."
                )
        if args.edge_gec:
            if getattr(self, "use_transformers_continuous_batching", False):
                raise ValueError(
                    "edge_gec continues incorrect completions with vLLM or the plain transformers generation, not "
                    "with transformers' continuous batching; turn one of them off."
                )
            columns = getattr(self.train_dataset, "column_names", None) or []
            if "answer" not in columns:
                raise ValueError(
                    f"edge_gec needs the reference answers in an `answer` column of train_dataset; it has {columns}."
                )
            if args.edge_gec_solution_prob > 0 and "solution" not in columns and self.accelerator.is_main_process:
                logger.warning(
                    "edge_gec_solution_prob=%g but train_dataset has no `solution` column: that share of the incorrect "
                    "completions gets the reference answer injected (as edge_gec_answer_prob does) instead of being "
                    "replaced by a reference solution; gec/frac_solution_as_answer logs it. Add a `solution` column, "
                    "or set edge_gec_solution_prob=0 (and give its probability to edge_gec_answer_prob) to say so.",
                    args.edge_gec_solution_prob,
                )

    # ------------------------------------------------------------------ TRL hooks
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._egpo_rewards_per_func = rewards_per_func  # gathered over processes, [B_global, num_funcs]
        return rewards_per_func

    @contextmanager
    def _egpo_timed(self, name: str):
        """Add the wall time of the block (after the device's queued work) to ``timing/<name>`` of this batch."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            timings = getattr(self, "_egpo_timings", None)
            if timings is not None:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - start

    def _get_per_token_logps_and_entropies(self, model, *args, compute_entropy=False, **kwargs):
        if not torch.is_grad_enabled():  # an old-policy (or reference) pass, not the loss's forward
            with self._egpo_timed("old_logps_s"):
                return self._egpo_no_grad_logps(model, *args, compute_entropy=compute_entropy, **kwargs)
        return super()._get_per_token_logps_and_entropies(model, *args, compute_entropy=compute_entropy, **kwargs)

    def _egpo_no_grad_logps(self, model, *args, compute_entropy=False, **kwargs):
        if getattr(self, "_egpo_capture_entropy", False):
            # TRL's old-log-prob pass of this generation batch: have it return the Shannon entropies too.
            self._egpo_capture_entropy = False
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model, *args, compute_entropy=True, **kwargs
            )
            self._egpo_captured_entropies = entropies
            return logps, entropies if compute_entropy else None, aux_loss
        return super()._get_per_token_logps_and_entropies(model, *args, compute_entropy=compute_entropy, **kwargs)

    def _generate(self, prompts: list):
        with self._egpo_timed("generation_s"):
            result = super()._generate(prompts)
        if self.args.edge_gec and self.model.training and getattr(self, "_egpo_round_inputs", None) is not None:
            result = self._guided_error_correction(prompts, result)
        return result

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        sampling = None
        self._egpo_timings = {}
        start = time.perf_counter()
        if mode == "train" and self.args.dynamic_sampling:
            output, rewards_per_func, sampling = self._dynamic_sampling(inputs, num_generations)
        else:
            output, rewards_per_func = self._generate_round(inputs)
        output = self._egpo_finish(output, rewards_per_func, mode, num_generations, sampling)
        timings, self._egpo_timings = self._egpo_timings, None
        timings["generate_and_score_s"] = time.perf_counter() - start
        for name, seconds in timings.items():
            self._metrics[mode][f"timing/{name}"].append(seconds)
        self._egpo_check_importance_sampling(mode)
        return output

    def _egpo_check_importance_sampling(self, mode: str) -> None:
        """Warn when TRL's vLLM importance-sampling correction scales this batch's loss far below 1.

        With ``vllm_importance_sampling_correction`` TRL multiplies the loss by ``exp(trainer - vLLM log-probs)``
        (per token or per sequence, truncated or masked). When vLLM samples from another distribution than the
        trainer's (processed logits) or the two disagree numerically over long completions, these ratios fall
        towards 0 and the run learns nothing while every other metric looks normal.
        """
        values = self._metrics[mode].get("sampling/importance_sampling_ratio/mean")
        if not values or not values[-1] < IS_RATIO_WARNING_THRESHOLD:
            return
        self._egpo_low_is_batches = getattr(self, "_egpo_low_is_batches", 0) + 1
        if self._egpo_low_is_batches in (1, 10) or self._egpo_low_is_batches % 100 == 0:
            logger.warning(
                "The vLLM importance-sampling ratios of this batch average %.3g (batch %d with a mean below %.2g): TRL "
                "multiplies the loss by them, so the update is scaled towards zero. Check that the sampling options "
                "leave the policy's distribution unchanged (top_p 1, top_k 0, no min_p, penalties or min_tokens), or "
                "set vllm_importance_sampling_correction: false (the paper's recipes do; docs/multi_gpu.md).",
                values[-1],
                self._egpo_low_is_batches,
                IS_RATIO_WARNING_THRESHOLD,
            )

    # ------------------------------------------------------------------ one generation round
    def _trl_computes_old_logps(self) -> bool:
        """Whether TRL 1.16's ``_generate_and_score_completions`` runs its old-log-prob pass (same rule as TRL)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _generate_round(self, inputs: list[dict[str, Any]]) -> tuple[dict[str, Any], torch.Tensor]:
        """TRL's generation and scoring for ``inputs``: the local batch dict and the gathered rewards per function."""
        self._egpo_rewards_per_func = None
        self._egpo_captured_entropies = None
        self._egpo_capture_entropy = self._egpo_entropy_input == "shannon" and self._trl_computes_old_logps()
        self._egpo_round_inputs = inputs
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._egpo_capture_entropy = False
            self._egpo_round_inputs = None
        rewards_per_func = self._egpo_rewards_per_func
        if rewards_per_func is None:  # pragma: no cover - TRL always scores through _calculate_rewards
            raise RuntimeError("EGPOTrainer could not capture the rewards of this batch; is the TRL version 1.16.0?")
        if self._egpo_captured_entropies is not None:
            output[_TOKEN_ENTROPY_KEY] = self._egpo_captured_entropies
            self._egpo_captured_entropies = None
        self._egpo_rewards_per_func = None
        return output, rewards_per_func

    def _egpo_finish(
        self,
        output: dict[str, Any],
        rewards_per_func: torch.Tensor,
        mode: str,
        num_generations: int,
        sampling: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Advantages of the final generation batch from its gathered rewards and entropies, written back for TRL."""
        entropies = self._egpo_entropies(output)
        estimator_entropies = {"nll": entropies["nll"], "shannon": entropies["shannon"], "none": None}[
            self._egpo_entropy_input
        ]
        result = self._egpo_compute(rewards_per_func, estimator_entropies, num_generations)

        local = output["advantages"].shape[0]
        process_slice = slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)
        output["advantages"] = result.advantages[process_slice].to(output["advantages"].dtype)

        # The completions table shows the advantages the loss uses.
        logged = self._logs["advantages"]
        for _ in range(min(len(logged), result.advantages.numel())):
            logged.pop()
        logged.extend(result.advantages.tolist())

        self._egpo_log_metrics(mode, result, entropies, num_generations)
        self.egpo_last_batch = {
            "rewards_per_func": rewards_per_func,
            "entropies": entropies["nll"],
            "token_entropies": entropies["shannon"],
            "result": result,
            "entropy_source": entropies["source"],
            "process_slice": process_slice,
            "num_generations": num_generations,
        }
        if sampling is not None:
            self.egpo_last_batch["dynamic_sampling"] = sampling
        return output

    # ------------------------------------------------------------------ entropies
    def _egpo_loss_mask(self, output: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens the entropy proxy averages over, and (for a ``thinking``/``answer`` scope) which rows fell back
        to their whole completion because their segment is empty (``None`` for the ``completion`` scope).

        A completion without ``</think>`` (cut off by the length limit, or a model that does not write the tags) has
        no answer segment, and one that closes the tag at once has no thinking segment. Their segment entropy is
        undefined; rather than leave them out of the group mean (weight 1, as if unscored), the proxy falls back to
        the whole completion, as :func:`egpo_trl.segments.scope_mask` does, and ``egpo/frac_entropy_scope_fallback``
        logs how often.
        """
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        if self.args.egpo_entropy_scope == "completion":
            return mask, None
        from egpo_trl.segments import segment_masks

        thinking, answer = segment_masks(output["completion_ids"], mask, self.processing_class)
        chosen = thinking if self.args.egpo_entropy_scope == "thinking" else answer
        fallback = ((chosen != 0).sum(dim=1) == 0) & ((mask != 0).sum(dim=1) > 0)
        return torch.where(fallback.unsqueeze(1), mask, chosen), fallback

    def _egpo_entropies(self, output: dict[str, Any]) -> dict[str, Any]:
        """Global per-completion entropies of this generation batch.

        Returns a dict with ``nll`` (``Tensor[B_global]``, the Eq. 5 proxy, or ``None`` when neither the estimator
        nor ``egpo_entropy_metrics`` asks for it), ``shannon`` (the mean Shannon entropy, for estimators that read
        it, else ``None``), ``source`` (where the proxy's log-probs came from: ``old_per_token_logps``,
        ``sampling_per_token_logps``, ``forward`` or ``none``) and ``extra_pass`` (whether this method ran a forward
        pass of its own).
        """
        token_entropies = output.pop(_TOKEN_ENTROPY_KEY, None)
        need_nll = self._egpo_entropy_input == "nll" or self.args.egpo_entropy_metrics
        need_shannon = self._egpo_entropy_input == "shannon"
        logps, source = None, "none"
        if need_nll:
            if output.get("old_per_token_logps") is not None:
                logps, source = output["old_per_token_logps"], "old_per_token_logps"
            elif (
                output.get("sampling_per_token_logps") is not None
                and not distribution_changing_sampling_options(self.args)
                and (self.args.egpo_entropy_logps == "sampler" or self._egpo_entropy_input != "nll")
            ):
                # Plain sampling: vLLM's processed log-probs are the policy's at the temperature, up to the two
                # engines' numerical differences. They feed the proxy when egpo_entropy_logps="sampler" (and the
                # metrics of estimators that do not use it); by default ("policy") the proxy comes from the policy's
                # own pass below, as verl computes pi_old. With top-p, top-k, min-p, penalties or min_tokens they are
                # those of another distribution, so the pass below is used whatever the setting.
                logps, source = output["sampling_per_token_logps"], "sampling_per_token_logps"
        extra_pass = (need_nll and logps is None) or (need_shannon and token_entropies is None)
        if extra_pass:
            forward_logps, forward_entropies = self._egpo_forward(
                output, compute_entropy=need_shannon and token_entropies is None
            )
            if need_nll and logps is None:
                logps, source = forward_logps, "forward"
            if need_shannon and token_entropies is None:
                token_entropies = forward_entropies
        mask, fallback = self._egpo_loss_mask(output)
        nll = self.accelerator.gather(sequence_entropy(logps, mask)) if need_nll else None
        shannon = self.accelerator.gather(sequence_mean(token_entropies, mask)) if need_shannon else None
        if fallback is not None:
            fallback = self.accelerator.gather(fallback)
            self._egpo_warn_scope_fallback(fallback)
        return {
            "nll": nll,
            "shannon": shannon,
            "source": source,
            "extra_pass": extra_pass,
            "scope_fallback": fallback,
        }

    def _egpo_warn_scope_fallback(self, fallback: torch.Tensor) -> None:
        """Warn once per run when completions of a ``thinking``/``answer`` entropy scope fall back to the whole
        completion."""
        if not fallback.any() or getattr(self, "_egpo_scope_fallback_warned", False):
            return
        self._egpo_scope_fallback_warned = True
        if self.accelerator.is_main_process:
            scope = self.args.egpo_entropy_scope
            reason = "no `</think>`" if scope == "answer" else "an empty thinking segment"
            logger.warning(
                "egpo_entropy_scope=%r: %d of %d completions of this batch have %s (cut off by max_completion_length, "
                "or the model does not write the tags), so their entropy proxy is taken over the whole completion "
                "instead; egpo/frac_entropy_scope_fallback logs the fraction at every step. Raise "
                "max_completion_length, or use egpo_entropy_scope='completion'.",
                scope,
                int(fallback.sum()),
                fallback.numel(),
                reason,
            )

    @torch.no_grad()
    def _egpo_forward(self, output: dict[str, Any], compute_entropy: bool = False):
        """One no-grad pass of the (old) policy over the batch: per-token log-probs ``[B_local, C]`` and, when asked,
        per-token Shannon entropies of the full next-token distribution (else ``None``)."""
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        forward_kwargs = {key: output[key] for key in _FORWARD_KEYS if output.get(key) is not None}
        was_training = self.model.training
        self.model.eval()  # no dropout: the proxy is the old policy's, and no RNG is consumed
        try:
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                logps, entropies, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    batch_size=batch_size,
                    compute_entropy=compute_entropy,
                    **forward_kwargs,
                )
        finally:
            self.model.train(was_training)
        return logps, entropies

    # ------------------------------------------------------------------ advantages
    def _egpo_advantage_kwargs(self) -> dict[str, Any]:
        args = self.args
        return {
            "lambda_min": args.egpo_lambda_min,
            "lambda_max": args.egpo_lambda_max,
            "entropy_eps": args.egpo_entropy_eps,
            "clamp": args.egpo_clamp,
            "renorm": args.egpo_renorm,
            "nsr": args.egpo_nsr,
            "nsr_weighting": args.egpo_nsr_weighting,
            "scale_rewards": self.scale_rewards,
            "nsr_scale": 1.0,
            "positive_weight": args.nsr_positive_weight,
            "entropy_normalization": args.edge_grpo_entropy_normalization,
        }

    def _estimator_kwargs(self) -> dict[str, Any]:
        """The options of :meth:`_egpo_advantage_kwargs` that the configured estimator's signature accepts."""
        kwargs = self._egpo_advantage_kwargs()
        parameters = inspect.signature(self._egpo_estimator).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return kwargs
        return {key: value for key, value in kwargs.items() if key in parameters}

    def _egpo_compute(
        self, rewards_per_func: torch.Tensor, entropies: torch.Tensor | None, num_generations: int
    ) -> AdvantageOutput:
        """Advantages on the global batch from TRL's per-function rewards and the entropies."""
        device = rewards_per_func.device
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        # The weighted reward sum, exactly as GRPOTrainer forms it.
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        correct, incorrect_value = self._egpo_correct(rewards_per_func)
        kwargs = self._estimator_kwargs()
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            kwargs["group_advantages"] = normalize_then_sum_advantages(
                rewards_per_func, self.reward_weights.to(device), num_generations
            )
        if "nsr_scale" in kwargs:
            # Half the gap between a correct and an incorrect reward of the correctness function, weighted as in
            # the reward sum: 1 for the paper's +1/-1 reward, 0.5 for a 1/0 reward.
            weight = float(self.reward_weights[self._egpo_correctness_index])
            kwargs["nsr_scale"] = weight * (1.0 - incorrect_value) / 2
        return self._egpo_estimator(
            rewards,
            entropies.to(device) if entropies is not None else None,
            num_generations,
            correct=correct,
            **kwargs,
        )

    def _egpo_correct(self, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Which completions are correct (the correctness reward function's value > 0), and the reward value of an
        incorrect one (-1 or 0).

        The group types of EGPO and NSR, dynamic sampling's ``correctness`` filter and Guided Error Correction need
        a binary verifier: a correctness reward whose values are those of a +1/-1 or a 1/0 reward. Any other value
        (a length, a score, a reward model's logit) would make every positive reward "correct", every group
        entirely-correct and every advantage 0, a run that trains nothing: it is refused with the fix.
        """
        values = rewards_per_func[:, self._egpo_correctness_index]
        scored = values[~torch.isnan(values)]
        distinct = set(scored.unique().tolist())
        binary = distinct <= {-1.0, 1.0} or distinct <= {0.0, 1.0}
        if not binary and self._egpo_binary_features:
            name = self.reward_func_names[self._egpo_correctness_index]
            shown = ", ".join(f"{v:g}" for v in sorted(distinct)[:6]) + (", ..." if len(distinct) > 6 else "")
            features = ", ".join(self._egpo_binary_features)
            raise ValueError(
                f"{features} need(s) a binary correctness reward (the paper's +1/-1, or 1/0), but the reward function "
                f"{name!r}, which decides correct (> 0) versus incorrect, returned {len(distinct)} distinct values in "
                f"this batch ({shown}). With such rewards every positive completion would count as correct and every "
                "group as entirely-correct, with advantage 0: nothing would train. Either add a binary verifier (such "
                "as egpo_trl.rewards.boxed_accuracy_reward) and name it in egpo_correctness_reward (the other reward "
                "functions still shape the mixed groups' advantages), or use advantage_estimator='grpo' (TRL's GRPO, "
                "which takes any reward)."
            )
        return values > 0, (0.0 if 0.0 in distinct else -1.0)

    def _egpo_log_metrics(
        self, mode: str, result: AdvantageOutput, entropies: dict[str, Any], num_generations: int
    ) -> None:
        metrics = self._metrics[mode]
        group_type = result.group_type[::num_generations]
        for name, code in (
            ("frac_all_correct", GROUP_ALL_CORRECT),
            ("frac_mixed", GROUP_MIXED),
            ("frac_all_incorrect", GROUP_ALL_INCORRECT),
        ):
            metrics[f"egpo/{name}"].append((group_type == code).float().mean().item())
        correct = result.correct
        incorrect = ~correct & (result.group_type != -1)

        def mean_of(values: torch.Tensor, where: torch.Tensor) -> float | None:
            return values[where].mean().item() if where.any() else None

        values = {
            "weight_correct": mean_of(result.weights, correct),
            "weight_incorrect": mean_of(result.weights, incorrect),
        }
        if entropies["nll"] is not None:
            nll = entropies["nll"].float().to(result.weights.device)
            finite = torch.isfinite(nll)
            values["entropy_mean"] = mean_of(nll, finite)
            values["entropy_correct"] = mean_of(nll, correct & finite)
            values["entropy_incorrect"] = mean_of(nll, incorrect & finite)
            if values["entropy_correct"] is not None and values["entropy_incorrect"] is not None:
                values["entropy_gap"] = values["entropy_incorrect"] - values["entropy_correct"]
            valid = finite & (result.group_type != -1)
            if valid.any() and self.args.advantage_estimator == "egpo":
                raw = result.raw_weights[valid]
                values["frac_at_lambda_min"] = (raw <= self.args.egpo_lambda_min).float().mean().item()
                values["frac_at_lambda_max"] = (raw >= self.args.egpo_lambda_max).float().mean().item()
        if entropies["shannon"] is not None:
            shannon = entropies["shannon"].float()
            values["token_entropy_mean"] = mean_of(shannon, torch.isfinite(shannon))
        values["entropy_extra_pass"] = float(entropies["extra_pass"])
        if entropies.get("scope_fallback") is not None:
            values["frac_entropy_scope_fallback"] = entropies["scope_fallback"].float().mean().item()
        for name, value in values.items():
            if value is not None:  # an undefined mean (no correct completion, say) is left out, not logged as NaN
                metrics[f"egpo/{name}"].append(value)

    # ------------------------------------------------------------------ dynamic sampling (DAPO)
    def _informative_groups(self, rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
        """``bool Tensor[G]``: which groups carry a learning signal under GRPO (``dynamic_sampling_metric``).

        ``"correctness"``: the group's scored completions are neither all correct nor all incorrect according to
        the correctness reward function. ``"reward"``: its scored completions do not all have the same total
        reward. A group with fewer than two scored completions is uninformative.
        """
        if self.args.dynamic_sampling_metric == "correctness":
            values = rewards_per_func[:, self._egpo_correctness_index].view(-1, num_generations)
            scored = ~torch.isnan(values)
            n_correct = (self._egpo_correct(rewards_per_func)[0].view(-1, num_generations) & scored).sum(dim=1)
            return (n_correct > 0) & (n_correct < scored.sum(dim=1))
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards = rewards.masked_fill(unscorable, float("nan")).view(-1, num_generations)
        scored = ~torch.isnan(rewards)
        highest = torch.where(scored, rewards, torch.full_like(rewards, -float("inf"))).max(dim=1).values
        lowest = torch.where(scored, rewards, torch.full_like(rewards, float("inf"))).min(dim=1).values
        return (scored.sum(dim=1) >= 2) & (highest > lowest)

    def _dynamic_sampling(
        self, inputs: list[dict[str, Any]], num_generations: int
    ) -> tuple[dict[str, Any], torch.Tensor, dict[str, Any]]:
        """DAPO's dynamic sampling over whole generation batches.

        Generates ``inputs`` as TRL would, then, while fewer than ``G`` groups (the generation batch's number of
        groups) are informative, another round for ``G`` prompts drawn from ``train_dataset``, up to
        ``dynamic_sampling_max_rounds`` rounds in all. The first ``G`` informative groups, in generation order, make
        the batch; when the cap stops the search, uninformative groups (first round first) fill it and a warning is
        logged. Decisions use the gathered rewards, so every process keeps the same groups; rows move between
        processes as needed, and each keeps its usual number of rows.
        """
        local_rows = len(inputs)
        global_rows = local_rows * self.accelerator.num_processes
        target = global_rows // num_generations
        max_rounds = self.args.dynamic_sampling_max_rounds
        rounds: list[dict[str, Any]] = []
        found = 0
        round_inputs = inputs
        for round_index in range(max_rounds):
            output, rewards_per_func = self._generate_round(round_inputs)
            informative = self._informative_groups(rewards_per_func, num_generations)
            rounds.append(
                {
                    "output": output,
                    "rewards_per_func": rewards_per_func,
                    "informative": informative,
                    "logs": self._snapshot_logs(global_rows),
                }
            )
            found += int(informative.sum().item())
            if found >= target or round_index + 1 == max_rounds:
                break
            round_inputs = self._refill_inputs(local_rows, num_generations, round_index + 1)

        selected = [
            (r, int(g)) for r, record in enumerate(rounds) for g in torch.nonzero(record["informative"]).flatten()
        ][:target]
        cap_hit = len(selected) < target
        if cap_hit:
            fillers = [
                (r, g) for r, record in enumerate(rounds) for g in range(target) if not record["informative"][g]
            ]
            fillers = fillers[: target - len(selected)]
            if self.accelerator.is_main_process:
                logger.warning(
                    "Dynamic sampling: %d of the %d groups of this generation batch are informative after %d generation "
                    "rounds (dynamic_sampling_max_rounds=%d, step %d); %d uninformative groups fill the batch and "
                    "give no GRPO signal. Raise dynamic_sampling_max_rounds, train on prompts of a better-suited "
                    "difficulty, or set dynamic_sampling=False.",
                    len(selected),
                    target,
                    len(rounds),
                    max_rounds,
                    self.state.global_step,
                    len(fillers),
                )
            selected = selected + fillers

        if selected == [(0, g) for g in range(target)]:  # the first round was informative throughout
            output, rewards_per_func = rounds[0]["output"], rounds[0]["rewards_per_func"]
        else:
            output, rewards_per_func = self._assemble_groups(rounds, selected, num_generations, local_rows)
            self._restore_logs(rounds, selected, num_generations, global_rows)

        generated = target * len(rounds)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(float(len(rounds)))
        metrics["dynamic_sampling/frac_informative"].append(found / generated)
        metrics["dynamic_sampling/cap_hit"].append(float(cap_hit))
        sampling = {
            "rounds": len(rounds),
            "target_groups": target,
            "informative": [record["informative"] for record in rounds],
            "selected": selected,
            "cap_hit": cap_hit,
        }
        return output, rewards_per_func, sampling

    def _refill_inputs(self, local_rows: int, num_generations: int, round_index: int) -> list[dict[str, Any]]:
        """This process's rows of a generation batch of fresh prompts from ``train_dataset``.

        The prompts are a seeded random draw (from ``seed``, the global step and the round), the same on every
        process and again after resuming; each prompt is repeated ``num_generations`` times and the global batch
        is split across processes exactly as TRL's sampler splits it. TRL's own dataloader is not advanced.
        """
        dataset = self.train_dataset
        num_groups = local_rows * self.accelerator.num_processes // num_generations
        generator = torch.Generator().manual_seed(
            (self.args.seed + 1) * 1_000_003 + self.state.global_step * 1_009 + round_index
        )
        order = torch.randperm(len(dataset), generator=generator).tolist()
        prompts = [order[i % len(order)] for i in range(num_groups)]
        start = self.accelerator.process_index * local_rows
        return [dict(dataset[prompts[row // num_generations]]) for row in range(start, start + local_rows)]

    def _gather_rows(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this process's rows) gathered over processes, per-token tensors padded to a common width."""
        if tensor.dim() >= 2:
            pad_value = self._pad_value(key)
            tensor = self.accelerator.pad_across_processes(
                tensor, dim=1, pad_index=pad_value, pad_first=key in _LEFT_PADDED_KEYS
            )
        return self.accelerator.gather(tensor)

    def _pad_value(self, key: str) -> int | float:
        if key in ("prompt_ids", "completion_ids"):
            return self._tokenizer.pad_token_id
        if key == "tool_mask":
            return 1
        return 0

    def _assemble_groups(
        self, rounds: list[dict[str, Any]], selected: list[tuple[int, int]], num_generations: int, local_rows: int
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """The batch made of the ``selected`` (round, group) pairs: this process's rows and the gathered rewards."""
        global_rows = local_rows * self.accelerator.num_processes
        first = rounds[0]["output"]
        keys = [
            k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.size(0) == local_rows
        ]
        others = [k for k, v in first.items() if k not in keys and k != "num_items_in_batch"]
        if others:
            raise ValueError(f"dynamic_sampling cannot regroup the batch entries {others} (multimodal inputs?).")
        used = sorted({r for r, _ in selected})  # rounds that contribute a group; the others are never gathered
        position = {r: i for i, r in enumerate(used)}
        rows = torch.tensor(
            [position[r] * global_rows + g * num_generations + j for r, g in selected for j in range(num_generations)],
            dtype=torch.long,
        )
        start = self.accelerator.process_index * local_rows
        output = {}
        for key in keys:
            gathered = [self._gather_rows(key, rounds[r]["output"][key]) for r in used]
            if gathered[0].dim() >= 2:
                width = max(t.size(1) for t in gathered)
                padded = []
                for t in gathered:
                    missing = width - t.size(1)
                    if missing:
                        fill = torch.full(
                            (t.size(0), missing, *t.shape[2:]), self._pad_value(key), dtype=t.dtype, device=t.device
                        )
                        t = torch.cat([fill, t] if key in _LEFT_PADDED_KEYS else [t, fill], dim=1)
                    padded.append(t)
                gathered = padded
            merged = torch.cat(gathered, dim=0)
            output[key] = merged[rows.to(merged.device)][start : start + local_rows]
        loss_mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            loss_mask = loss_mask * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        rewards = torch.cat([rounds[r]["rewards_per_func"] for r in used], dim=0)
        return output, rewards[rows.to(rewards.device)]

    def _snapshot_logs(self, global_rows: int) -> dict[str, Any]:
        """The completions-table entries TRL logged for the last generation round (the last ``global_rows``)."""

        def tail(values) -> list | None:
            return list(values)[-global_rows:] if len(values) >= global_rows else None

        logs = self._logs
        return {
            "prompt": tail(logs["prompt"]),
            "completion": tail(logs["completion"]),
            "advantages": tail(logs["advantages"]),
            "rewards": {name: tail(values) for name, values in logs["rewards"].items()},
            "extra": {name: tail(values) for name, values in logs["extra"].items()},
        }

    def _restore_logs(
        self, rounds: list[dict[str, Any]], selected: list[tuple[int, int]], num_generations: int, global_rows: int
    ) -> None:
        """Make the completions table show the rows of the assembled batch, not those of the last round."""
        rows = [(r, g * num_generations + j) for r, g in selected for j in range(num_generations)]

        def replace(target, name_path: tuple[str, ...]) -> None:
            snapshots = []
            for record in rounds:
                snapshot = record["logs"]
                for part in name_path:
                    snapshot = snapshot.get(part) if isinstance(snapshot, dict) else None
                snapshots.append(snapshot)
            for _ in range(min(len(target), global_rows)):
                target.pop()
            if all(snapshot is not None for snapshot in snapshots):
                target.extend(snapshots[r][i] for r, i in rows)

        replace(self._logs["prompt"], ("prompt",))
        replace(self._logs["completion"], ("completion",))
        replace(self._logs["advantages"], ("advantages",))
        for name, values in self._logs["rewards"].items():
            replace(values, ("rewards", name))
        for name, values in self._logs["extra"].items():
            replace(values, ("extra", name))

    # ------------------------------------------------------------------ Guided Error Correction (EDGE-GRPO)
    def _guided_error_correction(self, prompts: list, result: tuple) -> tuple:
        """EDGE-GRPO's Guided Error Correction on one generation round, before TRL scores it.

        Each completion that is incorrect according to the correctness reward function (and, with
        ``edge_gec_scope="all_incorrect_groups"``, belongs to a group without a correct completion) is, with the
        configured probabilities: continued by the policy after ``edge_gec_reflection_cue`` (``reflect``); given the
        reference answer with ``edge_gec_answer_template`` (``answer``); replaced by the reference solution
        (``solution``, the row's ``solution`` column, else ``answer``, counted in ``gec/frac_solution_as_answer``;
        a solution whose last box does not give the reference answer, or that must be shortened, ends with
        ``SOLUTION_ANSWER_SUFFIX``, counted in ``gec/frac_solution_boxed``). The rewritten completion keeps the
        original's tokens (shortened when needed, so that it fits ``max_completion_length``) and ends with EOS,
        except a continuation that runs out of tokens. TRL then scores and trains on the rewritten completions.
        """
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = result
        args = self.args
        inputs = self._egpo_round_inputs
        device = self.accelerator.device
        local_rows = len(completion_ids)
        num_generations = self.num_generations

        # Correctness of the sampled completions (gathered, since a group may span processes).
        rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids)
        values = rewards_per_func[:, self._egpo_correctness_index]
        scored = ~torch.isnan(values)
        is_correct = self._egpo_correct(rewards_per_func)[0]
        eligible = scored & ~is_correct
        if args.edge_gec_scope == "all_incorrect_groups":
            grouped = is_correct.view(-1, num_generations).any(dim=1, keepdim=True)
            eligible = eligible & ~grouped.expand(-1, num_generations).reshape(-1)
        start = self.accelerator.process_index * local_rows
        eligible = eligible[start : start + local_rows].cpu()

        self._gec_calls = getattr(self, "_gec_calls", 0) + 1  # a fresh draw for every round of every step
        generator = torch.Generator().manual_seed(
            (args.seed + 7) * 1_000_003 + self._gec_calls * 1_009 + self.accelerator.process_index
        )
        draws = torch.rand(local_rows, generator=generator)
        reflect_below = args.edge_gec_reflect_prob
        answer_below = reflect_below + args.edge_gec_answer_prob
        solution_below = answer_below + args.edge_gec_solution_prob
        eos = self.eos_token_ids[0]
        max_length = self.max_completion_length
        tokenizer = self._tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        def body(ids: list[int]) -> list[int]:
            return ids[:-1] if ids and ids[-1] in self.eos_token_ids else list(ids)

        new_ids = [list(ids) for ids in completion_ids]
        strategy = [None] * local_rows
        solution_as_answer = [False] * local_rows  # the solution share, for a row without a solution
        solution_boxed = [False] * local_rows  # a solution that got the answer's box appended
        kept_tokens = [0] * local_rows  # leading tokens of the sampled completion that a rewrite keeps
        cue = encode(args.edge_gec_reflection_cue)
        # Room kept for a continuation: up to edge_gec_max_new_tokens, at least half of what the cue leaves free;
        # a long original is shortened to make that room, a short one is kept whole.
        room = min(args.edge_gec_max_new_tokens, (max_length - len(cue)) // 2)
        reflect_rows, reflect_prompts, budget = [], [], 0
        for i in range(local_rows):
            if not eligible[i]:
                continue
            u = float(draws[i])
            answer = inputs[i].get("answer")
            solution = inputs[i].get("solution")
            choice = None
            if u < reflect_below and room >= 1:
                choice = "reflect"
            elif u < reflect_below or u < answer_below:
                choice = "answer"
            elif u < solution_below:
                choice = "solution" if solution else "answer"
                solution_as_answer[i] = not solution
            if choice in ("answer", "solution") and (answer is None or str(answer) == ""):
                choice = None
                solution_as_answer[i] = False
            if choice == "reflect":
                kept = body(completion_ids[i])[: max_length - len(cue) - room]
                new_ids[i] = kept + cue
                kept_tokens[i] = len(kept)
                budget = max(budget, min(args.edge_gec_max_new_tokens, max_length - len(new_ids[i])))
                reflect_rows.append(i)
                reflect_prompts.append(list(prompt_ids[i]) + new_ids[i])
            elif choice == "answer":
                injected = encode(args.edge_gec_answer_template.replace("{answer}", str(answer)))[: max_length - 1]
                original = body(completion_ids[i])
                kept = original[: max(0, max_length - 1 - len(injected))]
                if len(kept) < len(original):  # shortened: never leave the injected answer inside an open box
                    kept = boxed_safe_prefix(kept, tokenizer.decode)
                new_ids[i] = kept + injected + [eos]
                kept_tokens[i] = len(kept)
            elif choice == "solution":
                # The reference solution, scored by its last box: when that box does not give the reference answer
                # (no box, another box last), or the solution must be shortened to fit, it ends with the answer's
                # box, so that the replaced completion is the correct one it stands for.
                text = str(solution)
                body_ids = encode(text)
                suffix = []
                if not answers_match(extract_last_boxed(text), answer) or len(body_ids) > max_length - 1:
                    suffix = encode(SOLUTION_ANSWER_SUFFIX.replace("{answer}", str(answer)))[: max_length - 1]
                    solution_boxed[i] = True
                if len(body_ids) > max_length - 1 - len(suffix):
                    body_ids = boxed_safe_prefix(body_ids[: max(0, max_length - 1 - len(suffix))], tokenizer.decode)
                new_ids[i] = body_ids + suffix + [eos]
            strategy[i] = choice

        # Continuations: every process generates together when any needs to (generation may be collective).
        needed = self.accelerator.gather(torch.tensor([len(reflect_rows)], device=device)).sum().item()
        continued: dict[int, tuple[list[int], list[float] | None]] = {}  # row -> continuation ids and log-probs
        if needed:
            batch = reflect_prompts or [list(prompt_ids[0])]  # a process with nothing to continue runs a dummy row
            continuations, continuation_logps = self._continue_generation(batch, max(budget, 1))
            for k, (i, continuation) in enumerate(zip(reflect_rows, continuations)):
                room_left = min(args.edge_gec_max_new_tokens, max_length - len(new_ids[i]))
                tail_logps = None if continuation_logps is None else list(continuation_logps[k])[:room_left]
                continued[i] = (list(continuation)[:room_left], tail_logps)
                new_ids[i] = new_ids[i] + continued[i][0]

        changed = [i for i in range(local_rows) if strategy[i] is not None]
        if changed and logprobs is not None:
            # vLLM's sampling log-probs: kept for the sampled tokens that stay, and for a continuation; NaN for the
            # injected tokens, which TRL's importance-sampling correction then leaves uncorrected (ratio 1).
            logprobs = [list(row) for row in logprobs]
            for i in changed:
                rewritten = list(logprobs[i][: kept_tokens[i]])
                if strategy[i] == "reflect":
                    tail_ids, tail_logps = continued.get(i, ([], None))
                    rewritten += [float("nan")] * (len(new_ids[i]) - len(rewritten) - len(tail_ids))
                    rewritten += list(tail_logps) if tail_logps is not None else [float("nan")] * len(tail_ids)
                rewritten += [float("nan")] * (len(new_ids[i]) - len(rewritten))
                logprobs[i] = rewritten
        if changed:
            completion_ids = new_ids
            completions = list(completions)
            conversational = is_conversational({"prompt": prompts[0]})
            texts = self.processing_class.batch_decode([new_ids[i] for i in changed], skip_special_tokens=True)
            for i, text in zip(changed, texts):
                completions[i] = [{"role": "assistant", "content": text}] if conversational else text

        counts = torch.tensor(
            [float(eligible.sum())]
            + [float(sum(s == name for s in strategy)) for name in ("reflect", "answer", "solution")]
            + [float(sum(solution_as_answer)), float(sum(solution_boxed))],
            device=device,
        )
        totals = self.accelerator.gather(counts.unsqueeze(0)).sum(dim=0) / (
            local_rows * self.accelerator.num_processes
        )
        names = (
            "frac_eligible",
            "frac_reflect",
            "frac_answer",
            "frac_solution",
            "frac_solution_as_answer",
            "frac_solution_boxed",
        )
        for name, value in zip(names, totals.tolist()):
            self._metrics["train"][f"gec/{name}"].append(value)
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images

    def _continue_generation(
        self, prompt_ids: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One continuation of at most ``max_new_tokens`` tokens for each token-id prompt, with TRL's generation
        backend (vLLM, which also returns the sampled tokens' log-probs, or transformers, which returns ``None``)."""
        if self.use_vllm:
            generation = self.vllm_generation
            previous = generation.max_completion_length
            generation.max_completion_length = max_new_tokens
            try:
                return self._generate_single_turn(prompt_ids, None, {}, 1)
            finally:
                generation.max_completion_length = previous
        previous = self.generation_config.max_new_tokens, self.generation_kwargs.get("max_new_tokens")
        self.generation_config.max_new_tokens = max_new_tokens
        self.generation_kwargs["max_new_tokens"] = max_new_tokens
        try:
            continuations, _ = self._generate_single_turn(prompt_ids, None, {}, 1)
        finally:
            self.generation_config.max_new_tokens, self.generation_kwargs["max_new_tokens"] = previous
        return continuations, None
