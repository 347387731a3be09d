"""``EGPOTrainer``: TRL's ``GRPOTrainer`` with EGPO's entropy-calibrated advantages on each generation batch."""

from __future__ import annotations

import inspect
import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from trl import GRPOTrainer
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
    weighted_reward_sum,
)
from egpo_trl.config import EGPOConfig, distribution_changing_sampling_options, trl_computes_old_logps
from egpo_trl.correctness import binary_correctness_features, correctness_reward_index, reward_func_names
from egpo_trl.fused import GROUP_KEY, LossForwardEntropyMixin, random_training_forward
from egpo_trl.heldout import NO_CORRECT_CAUSES
from egpo_trl.input_checks import check_trainer_inputs
from egpo_trl.old_logps import FORWARD_KEYS, can_realign, shifted_logps
from egpo_trl.resume_state import ExactResumeMixin
from egpo_trl.rewards import with_overlong_reward
from egpo_trl.sampling.dynamic import DynamicSamplingMixin, vllm_sequences_for_oversampling
from egpo_trl.sampling.gec import GuidedErrorCorrectionMixin
from egpo_trl.segments import scope_mask

logger = logging.getLogger(__name__)

__all__ = ["EGPOTrainer"]

# Batch keys: entropies of TRL's old-log-prob pass, each row's index (for the loss's log-probs), completion lengths.
_TOKEN_ENTROPY_KEY, _ROW_KEY = "egpo_token_entropies", "egpo_row_index"
_LENGTHS_KEY, _TRUNCATED_KEY = "egpo_completion_lengths", "egpo_completion_truncated"
#: ``egpo/entropy_source``: where the entropy proxy's log-probs came from.
_SOURCES = ("none", "old_per_token_logps", "forward", "sampling_per_token_logps", "training_forward", "loss_forward")
ENTROPY_SOURCE_CODES = {source: code for code, source in enumerate(_SOURCES)}
IS_RATIO_WARNING_THRESHOLD = 0.5  # a mean importance-sampling ratio below this is warned about
NO_CORRECT_WARNING_STEPS = 4  # optimizer steps without a correct completion before the run is told


def _mean_of(values: torch.Tensor, where: torch.Tensor) -> float | None:
    """The mean of ``values`` over ``where`` (``None`` when empty)."""
    return values[where].mean().item() if where.any() else None


def _judged_rows(result: AdvantageOutput, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct and the incorrect rows among those with a verdict (``scored``) in a scored group."""
    scored = scored.to(result.correct.device)
    return result.correct & scored, ~result.correct & scored & (result.group_type != -1)


class EGPOTrainer(
    ExactResumeMixin, DynamicSamplingMixin, GuidedErrorCorrectionMixin, LossForwardEntropyMixin, GRPOTrainer
):
    """EGPO, a drop-in replacement for TRL's ``GRPOTrainer`` taking an :class:`~egpo_trl.EGPOConfig`; a completion is
    correct when the reward named by ``egpo_correctness_reward`` is > 0. Logs ``egpo/*`` besides TRL's metrics."""

    _tag_names = ["trl", "egpo"]
    _name = "EGPO"
    # Per-batch state, also there for a trainer built without __init__ (as TRL's own unit tests build one).
    _egpo_rewards_per_func: torch.Tensor | None = None
    _egpo_capture_entropy = False  # capture the entropies of TRL's next old-log-prob pass
    _egpo_captured_entropies: torch.Tensor | None = None
    _egpo_loss_rows = _egpo_deferred_entropies = None
    _egpo_timings = _egpo_sampled_rewards = None  # of the generation batch being made
    _egpo_incorrect_seen: int | None = 0  # completions, all incorrect, seen before the first correct one

    def __init__(self, model, reward_funcs=None, args: EGPOConfig | None = None, *pos_args: Any, **kwargs: Any):
        model = check_trainer_inputs(model, reward_funcs, args, pos_args, kwargs)  # before anything loads
        if args is None:  # as GRPOTrainer: an output folder named after the model
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = EGPOConfig(f"{model_name.split('/')[-1]}-EGPO")
        elif not isinstance(args, EGPOConfig):
            raise TypeError(f"EGPOTrainer needs an EGPOConfig, got {type(args).__name__}.")
        if args.n_gpu > 1:
            raise ValueError(f"{args.n_gpu} GPUs in one process: use `accelerate launch`, or CUDA_VISIBLE_DEVICES=0.")
        reward_funcs = with_overlong_reward(reward_funcs, args)
        # Pick the correctness reward before any model loads; TRL's own error on mismatched reward counts comes first.
        environment = kwargs.get("environment_factory", pos_args[10] if len(pos_args) > 10 else None) is not None
        processing_classes = kwargs.get("reward_processing_classes", pos_args[3] if len(pos_args) > 3 else None)
        given = (args.reward_weights, processing_classes)
        counts = {len(value) if isinstance(value, list) else 1 for value in given if value is not None}
        correctness_names = reward_func_names(reward_funcs)
        correctness_index = None
        if counts <= {len(correctness_names)}:
            correctness_index = correctness_reward_index(reward_funcs, args, complete=not environment)
        with vllm_sequences_for_oversampling(args):
            super().__init__(model, reward_funcs, args, *pos_args, **kwargs)

        generation = getattr(self, "vllm_generation", None)
        if getattr(self, "use_vllm", False) and getattr(generation, "mode", None) == "colocate":
            kwargs = generation.generation_kwargs  # token ids only: TRL decodes them itself
            if "detokenize" not in kwargs and not kwargs.get("stop"):
                generation.generation_kwargs = {**kwargs, "detokenize": False}  # args.generation_kwargs stays as given
        self._egpo_estimator = get_advantage_estimator(args.advantage_estimator)
        self._egpo_entropy_input = get_entropy_input(self._egpo_estimator)
        self._egpo_binary_features = binary_correctness_features(args)
        if correctness_index is None or list(self.reward_func_names) != correctness_names:
            # Environments added reward functions of their own (get_reward): decide again with all of them.
            correctness_index = correctness_reward_index(self.reward_funcs, args, names=self.reward_func_names)
        self._egpo_correctness_index = correctness_index
        if args.dynamic_sampling:
            self._check_dynamic_sampling()
        if args.edge_gec:
            self._check_guided_error_correction()
        self._check_loss_forward_entropy()
        self._egpo_warned: set[str] = set()
        self._egpo_round_inputs: list[dict[str, Any]] | None = None
        #: What the last generation batch computed (global tensors), for inspection.
        self.egpo_last_batch: dict[str, Any] = {}

    def vllm_kv_cache_tokens(self) -> int | None:
        """How many tokens the colocated vLLM engine's KV cache holds (``None`` where unknown)."""
        generation = getattr(self, "vllm_generation", None)
        if not getattr(self, "use_vllm", False) or getattr(generation, "mode", None) != "colocate":
            return None
        try:  # set by the engine once its KV cache exists
            tokens = generation.llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
        except AttributeError:
            return None
        return int(tokens) if isinstance(tokens, (int, float)) and tokens > 0 else None

    # ------------------------------------------------------------------ TRL hooks
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        batch = (inputs, prompts, completions, completion_ids_list)
        if getattr(self, "_gec_scored", None) is not None:  # Guided Error Correction: re-score the rewritten rows
            rewards_per_func = self._gec_rescore(super()._calculate_rewards, *batch)
        else:
            rewards_per_func = super()._calculate_rewards(*batch)
            if self._egpo_sampled_rewards is not None:  # the completions as sampled, before any is rewritten
                self._egpo_sampled_rewards.append(rewards_per_func)
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
            if self._egpo_timings is not None:
                self._egpo_timings[name] = self._egpo_timings.get(name, 0.0) + time.perf_counter() - start

    def _get_per_token_logps_and_entropies(self, model, *args, compute_entropy=False, **kwargs):
        if torch.is_grad_enabled() and getattr(self, "_fused", False) and self._fused_cache:
            return self._fused_cache.pop(0)  # the loss of a block: its forward already ran (egpo_trl/fused.py)
        if torch.is_grad_enabled():
            result = self._egpo_trl_pass(model, *args, compute_entropy=compute_entropy, **kwargs)
            if self._egpo_loss_rows is not None:
                self._egpo_record_loss_logps(result[0])  # the loss's forward: the deferred entropy metrics' log-probs
            return result
        # An old-policy (or reference) pass; TRL's old-log-prob pass of a batch also returns the Shannon entropies.
        capture, self._egpo_capture_entropy = self._egpo_capture_entropy, False
        with self._egpo_timed("old_logps_s"):
            logps, entropies, aux = self._egpo_trl_pass(
                model, *args, compute_entropy=compute_entropy or capture, **kwargs
            )
        if capture:
            self._egpo_captured_entropies = entropies
        return logps, entropies if compute_entropy else None, aux

    def _egpo_trl_pass(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        """TRL's log-prob pass, on rows shifted past their prompt padding where ``can_realign`` allows it."""
        others = {k: v for k, v in kwargs.items() if k not in ("batch_size", "compute_entropy", "compute_aux_loss")}
        if (
            self.args.egpo_shift_prompt_padding
            and not kwargs.get("compute_aux_loss")
            and not getattr(self, "aux_loss_enabled", False)
            and logits_to_keep > 0
            and all(value is None for value in others.values())
        ):
            prompt_mask, completion_mask = attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
            if can_realign(self.accelerator.unwrap_model(model), prompt_mask, completion_mask):
                autocast = self.accelerator.autocast
                full = trl_computes_old_logps(self.args) or self.beta != 0.0
                entropy, size = kwargs.get("compute_entropy", False), kwargs.get("batch_size")
                logps = shifted_logps(model, input_ids, attention_mask, logits_to_keep, size, entropy, autocast, full)
                return *logps, None
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs)

    def _generate(self, prompts: list):
        gec = getattr(self, "_egpo_round_inputs", None) is not None and self.args.edge_gec and self.model.training
        with self._gec_vllm_awake() if gec else nullcontext():
            with self._egpo_timed("generation_s"):
                result = super()._generate(prompts)
            if gec:
                sampled_lengths = self._egpo_completion_lengths(result[1], result[2])[0]
                with self._egpo_timed("gec_s"):  # scoring, rewrites and continuations
                    result = self._guided_error_correction(prompts, result)  # GuidedErrorCorrectionMixin
        lengths, truncated = self._egpo_completion_lengths(result[1], result[2])
        self._egpo_round_lengths = (lengths, truncated)
        if gec:  # TRL logged the lengths of the completions as sampled: log those of the rewritten ones instead
            metrics = self._metrics["train"]
            for name, value in self._egpo_length_metrics(lengths, truncated).items():
                if metrics.get(name):
                    metrics[name][-1] = value
            self.state.num_input_tokens_seen += self.accelerator.gather(lengths - sampled_lengths).sum().item()
            metrics["num_tokens"] = [self.state.num_input_tokens_seen]
        return result

    def _egpo_completion_lengths(self, completion_ids: list, tool_mask: list | None) -> tuple[torch.Tensor, ...]:
        """This process's completion lengths and whether each was truncated, counted as TRL's ``_generate`` does."""
        device = self.accelerator.device
        if tool_mask is not None:
            lengths = torch.tensor([sum(mask) for mask in tool_mask], device=device)
        else:
            lengths = torch.tensor([len(ids) for ids in completion_ids], device=device)
        eos_and_pad = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        truncated = torch.tensor([bool(ids) and ids[-1] not in eos_and_pad for ids in completion_ids], device=device)
        return lengths, truncated

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        sampling = None
        if mode == "train":  # a batch whose loss did not see every row logs no egpo/entropy_* metrics
            self._egpo_deferred_entropies = None
        self._egpo_timings = {}
        self._egpo_sampled_rewards = []
        start = time.perf_counter()
        if mode == "train" and self.args.dynamic_sampling:  # DynamicSamplingMixin
            output, rewards_per_func, sampling = self._dynamic_sampling(inputs, num_generations)
        else:
            output, rewards_per_func = self._generate_round(inputs)
        output = self._egpo_finish(output, rewards_per_func, mode, num_generations, sampling)
        timings, self._egpo_timings = self._egpo_timings, None
        timings["generate_and_score_s"] = time.perf_counter() - start
        for name, seconds in timings.items():
            self._metrics[mode][f"timing/{name}"].append(seconds)
        self._egpo_check_importance_sampling(mode)
        sampled, self._egpo_sampled_rewards = self._egpo_sampled_rewards, None
        if mode == "train":
            self._egpo_check_any_correct(torch.cat(sampled))
        return output

    def _egpo_check_any_correct(self, rewards_per_func: torch.Tensor) -> None:
        """Warn once when no completion of the run's first ``NO_CORRECT_WARNING_STEPS`` optimizer steps was correct."""
        if self._egpo_incorrect_seen is None:  # told already, or a completion was correct
            return
        values = rewards_per_func[:, self._egpo_correctness_index]
        values = values[~torch.isnan(values)]
        if not set(values.unique().tolist()) <= {-1.0, 0.0}:
            self._egpo_incorrect_seen = None
            return
        self._egpo_first_step = getattr(self, "_egpo_first_step", self.state.global_step)
        self._egpo_incorrect_seen += values.numel()
        steps = self.state.global_step + 1 - self._egpo_first_step
        if steps >= NO_CORRECT_WARNING_STEPS:
            self._egpo_warn_once(
                "No completion of the first %d optimizer steps was correct (%d completions, none scored above 0 by "
                "the correctness reward %r): every group is entirely incorrect (egpo/frac_all_incorrect 1). %s",
                *(steps, self._egpo_incorrect_seen, self.reward_func_names[self._egpo_correctness_index]),
                NO_CORRECT_CAUSES,
            )
            self._egpo_incorrect_seen = None

    def _egpo_check_importance_sampling(self, mode: str) -> None:
        """Warn when TRL's vLLM importance-sampling correction scales this batch's loss far below 1."""
        values = self._metrics[mode].get("sampling/importance_sampling_ratio/mean")
        if not values or not values[-1] < IS_RATIO_WARNING_THRESHOLD:
            return
        self._egpo_low_is_batches = getattr(self, "_egpo_low_is_batches", 0) + 1
        if self._egpo_low_is_batches in (1, 10) or self._egpo_low_is_batches % 100 == 0:
            logger.warning(
                "The vLLM importance-sampling ratios of this batch average %.3g (batch %d below %.2g), scaling the "
                "loss towards zero: keep the sampling options distribution-preserving or set "
                "vllm_importance_sampling_correction: false.",
                *(values[-1], self._egpo_low_is_batches, IS_RATIO_WARNING_THRESHOLD),
            )

    # ------------------------------------------------------------------ one generation round
    def _generate_round(self, inputs: list[dict[str, Any]]) -> tuple[dict[str, Any], torch.Tensor]:
        """TRL's generation and scoring for ``inputs``: the local batch dict and the gathered rewards per function."""
        self._egpo_rewards_per_func = self._egpo_captured_entropies = self._egpo_round_lengths = None
        self._egpo_capture_entropy = self._egpo_entropy_input == "shannon" and trl_computes_old_logps(self.args)
        self._egpo_round_inputs, self._gec_scored = inputs, None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._egpo_capture_entropy, self._egpo_round_inputs, self._gec_scored = False, None, None
        entropies, self._egpo_captured_entropies = self._egpo_captured_entropies, None
        if entropies is not None:
            output[_TOKEN_ENTROPY_KEY] = entropies
        lengths, self._egpo_round_lengths = self._egpo_round_lengths, None
        if lengths is not None and lengths[0].numel() == output["completion_ids"].size(0):
            output[_LENGTHS_KEY], output[_TRUNCATED_KEY] = lengths
        rewards_per_func, self._egpo_rewards_per_func = self._egpo_rewards_per_func, None
        return output, rewards_per_func

    def _egpo_finish(self, output: dict, rewards_per_func: torch.Tensor, mode: str, num_generations: int, sampling):
        """Advantages of the final generation batch from its gathered rewards and entropies, written back for TRL."""
        output.pop(_LENGTHS_KEY, None)
        output.pop(_TRUNCATED_KEY, None)
        if mode == "train" and getattr(self, "_fused", False):
            result = self._fused_finish(output, rewards_per_func, num_generations)
            entropies = {"nll": None, "shannon": None, "source": "loss_forward"}
            process_slice = self._fused_batch["rows"]
        else:
            entropies = self._egpo_entropies(output, mode)
            estimator_entropies = {**entropies, "none": None}[self._egpo_entropy_input]
            result = self._egpo_compute(rewards_per_func, estimator_entropies, num_generations)
            local = output["advantages"].shape[0]
            process_slice = slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)
            output["advantages"] = result.advantages[process_slice].to(output["advantages"].dtype)
            logged = self._logs["advantages"]
            for _ in range(min(len(logged), result.advantages.numel())):
                logged.pop()
            logged.extend(result.advantages.tolist())
            # Rows without a correctness verdict are neither correct nor incorrect in the per-correctness metrics.
            judged = ~torch.isnan(rewards_per_func[:, self._egpo_correctness_index])
            self._egpo_log_metrics(mode, result, entropies, num_generations, scored=judged)
        self.egpo_last_batch = {
            "rewards_per_func": rewards_per_func,
            "num_generations": num_generations,
            "entropies": entropies["nll"],
            "token_entropies": entropies["shannon"],
            "result": result,
            "entropy_source": entropies["source"],
            "process_slice": process_slice,
            **({"dynamic_sampling": sampling} if sampling is not None else {}),
        }
        if entropies.get("deferred") is not None:
            # The egpo/entropy_* metrics follow once the loss's forwards have seen every row of this batch.
            entropies["deferred"].update(mode=mode, result=result, scored=judged, batch=self.egpo_last_batch)
            self._egpo_deferred_entropies = entropies["deferred"]
        return output

    # ------------------------------------------------------------------ entropies
    def _egpo_loss_mask(self, output: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens the entropy proxy averages over, and which rows of the global batch fell back to their whole
        completion (warned about once)."""
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        mask, fallback = scope_mask(
            output["completion_ids"], mask, self.processing_class, self.args.egpo_entropy_scope
        )
        if fallback is None:
            return mask, None
        fallback = self.accelerator.gather(fallback)
        if fallback.any():
            self._egpo_warn_once(
                "egpo_entropy_scope=%r: %d of %d completions have no %s segment, so their entropy proxy is taken over "
                "the whole completion (egpo/frac_entropy_scope_fallback).",
                *(self.args.egpo_entropy_scope, int(fallback.sum()), fallback.numel(), self.args.egpo_entropy_scope),
            )
        return mask, fallback

    def _egpo_entropies(self, output: dict[str, Any], mode: str = "train") -> dict[str, Any]:
        """Global per-completion entropies of this generation batch (``nll`` is the Eq. 5 proxy) and their source."""
        token_entropies = output.pop(_TOKEN_ENTROPY_KEY, None)
        need_nll = self._egpo_entropy_input == "nll" or self.args.egpo_entropy_metrics
        need_shannon = self._egpo_entropy_input == "shannon"
        mask, fallback = self._egpo_loss_mask(output)
        logps, source = None, "none"
        if need_nll:
            if output.get("old_per_token_logps") is not None:
                logps, source = output["old_per_token_logps"], "old_per_token_logps"
            elif (
                output.get("sampling_per_token_logps") is not None
                and not distribution_changing_sampling_options(self.args)
                and self.args.egpo_entropy_logps == "sampler"
            ):
                logps, source = output["sampling_per_token_logps"], "sampling_per_token_logps"
                # Tokens injected by Guided Error Correction have no sampling log-prob: every process falls back.
                local = torch.isnan(logps).logical_and(mask != 0).any().float().view(1)
                if bool(self.accelerator.gather(local).any()):
                    logps, source = None, "none"
                    self._egpo_warn_once(
                        "egpo_entropy_logps='sampler': tokens without a sampling log-prob (injected by Guided Error "
                        "Correction) make the entropy proxy of such batches take a no-grad pass."
                    )
        deferred = None
        metrics_only = self._egpo_entropy_input == "none"
        if need_nll and logps is None and metrics_only and self._egpo_defers_entropy_metrics(mode):
            # Only the metrics need the proxy: take the log-probs from the loss's forwards.
            rows, columns = output["completion_ids"].shape
            seen = torch.zeros(rows, dtype=torch.bool, device=mask.device)
            deferred = dict(mask=mask, logps=torch.zeros(rows, columns, device=mask.device), seen=seen)
            output[_ROW_KEY] = torch.arange(rows, device=mask.device)
            need_nll, source = False, "training_forward"
        extra_pass = (need_nll and logps is None) or (need_shannon and token_entropies is None)
        if extra_pass:
            forward_logps, forward_entropies = self._egpo_forward(output, need_shannon and token_entropies is None)
            if need_nll and logps is None:
                logps, source = forward_logps, "forward"
            if need_shannon and token_entropies is None:
                token_entropies = forward_entropies
        nll = self.accelerator.gather(sequence_entropy(logps, mask)) if need_nll else None
        shannon = self.accelerator.gather(sequence_mean(token_entropies, mask)) if need_shannon else None
        return dict(
            nll=nll, shannon=shannon, source=source, extra_pass=extra_pass, scope_fallback=fallback, deferred=deferred
        )

    def _egpo_defers_entropy_metrics(self, mode: str) -> bool:
        """Whether this batch's ``egpo/entropy_*`` metrics come from the loss's forwards (when they are the old
        policy's: no NEFTune noise, no random training forward)."""
        args = self.args
        deferrable = mode == "train" and not trl_computes_old_logps(args) and not args.neftune_noise_alpha
        return deferrable and not random_training_forward(self.model)

    def _prepare_inputs(self, generation_batch):
        if getattr(self, "_fused", False) and self.model.training:
            return self._fused_prepare_inputs(super()._prepare_inputs, generation_batch)
        return super()._prepare_inputs(generation_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if getattr(self, "_fused", False):  # called in training only (the model may not be in train mode yet)
            return self._fused_training_step(
                model, inputs, lambda: super(EGPOTrainer, self).training_step(model, inputs, num_items_in_batch)
            )
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        def loss_of(model, batch):
            return super(EGPOTrainer, self).compute_loss(model, batch, return_outputs, num_items_in_batch)

        if getattr(self, "_fused", False) and model.training and GROUP_KEY in inputs:
            return self._fused_block_loss(model, inputs, loss_of)
        deferred = self._egpo_deferred_entropies is not None and model.training
        self._egpo_loss_rows = inputs.get(_ROW_KEY) if deferred else None
        try:
            return loss_of(model, inputs)
        finally:
            self._egpo_loss_rows = None

    def _egpo_record_loss_logps(self, logps: torch.Tensor) -> None:
        """Keep the loss forward's log-probs for the deferred entropy metrics; log them once every row was seen."""
        deferred, rows = self._egpo_deferred_entropies, self._egpo_loss_rows
        self._egpo_loss_rows = None  # one forward per micro-batch
        fresh = ~deferred["seen"][rows]  # under num_iterations > 1 a row comes back: its first forward counts
        deferred["logps"][rows[fresh]] = logps.detach()[fresh].float()
        deferred["seen"][rows] = True
        if bool(deferred["seen"].all()):
            self._egpo_deferred_entropies = None
            nll = self.accelerator.gather(sequence_entropy(deferred["logps"], deferred["mask"]))
            deferred["batch"]["entropies"] = nll
            self._egpo_append_metrics(
                deferred["mode"], self._egpo_entropy_values(deferred["result"], nll, deferred["scored"])
            )

    def _egpo_warn_once(self, message: str, *values: Any) -> None:
        """Log ``message`` once per run (on the main process)."""
        if message not in self._egpo_warned:
            self._egpo_warned.add(message)
            if self.accelerator.is_main_process:
                logger.warning(message, *values)

    @torch.no_grad()
    def _egpo_forward(self, output: dict[str, Any], compute_entropy: bool = False):
        """One no-grad pass of the (old) policy: per-token log-probs and, when asked, Shannon entropies."""
        kwargs = {key: output[key] for key in FORWARD_KEYS if output.get(key) is not None}
        training, args, width = self.model.training, self.args, output["completion_ids"].size(1)
        kwargs.update(compute_entropy=compute_entropy)
        kwargs["batch_size"] = args.per_device_train_batch_size if training else args.per_device_eval_batch_size
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        self.model.eval()  # no dropout: the proxy is the old policy's, and no RNG is consumed
        try:
            with disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
                logps, entropies, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, width, **kwargs)
        finally:
            self.model.train(training)
        return logps, entropies

    # ------------------------------------------------------------------ advantages
    def _estimator_kwargs(self) -> dict[str, Any]:
        """The advantage options that the configured estimator's signature accepts."""
        names = ("lambda_min", "lambda_max", "entropy_eps", "clamp", "renorm", "nsr", "nsr_weighting")
        kwargs = {name: getattr(self.args, f"egpo_{name}") for name in names}
        kwargs.update(scale_rewards=self.scale_rewards, nsr_scale=1.0, positive_weight=self.args.nsr_positive_weight)
        kwargs["entropy_normalization"] = self.args.edge_grpo_entropy_normalization
        parameters = inspect.signature(self._egpo_estimator).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return kwargs
        return {key: value for key, value in kwargs.items() if key in parameters}

    def _egpo_verdicts(self, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The per-function rewards (unscored without a verdict, for a binary estimator), correctness and incorrect value."""
        correct, incorrect_value = self._egpo_correct(rewards_per_func)
        no_verdict = torch.isnan(rewards_per_func[:, self._egpo_correctness_index])
        if no_verdict.any():
            correct = correct.float().masked_fill(no_verdict, float("nan"))
            if getattr(self._egpo_estimator, "binary_correctness", False):
                rewards_per_func = rewards_per_func.masked_fill(no_verdict.unsqueeze(1), float("nan"))
        return rewards_per_func, correct, incorrect_value

    def _egpo_compute(self, rewards_per_func: torch.Tensor, entropies: torch.Tensor | None, num_generations: int):
        """Advantages on the global batch from TRL's per-function rewards and the entropies."""
        device = rewards_per_func.device
        rewards_per_func, correct, incorrect_value = self._egpo_verdicts(rewards_per_func)
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights)  # exactly as GRPOTrainer forms it
        kwargs = self._estimator_kwargs()
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            kwargs["group_advantages"] = normalize_then_sum_advantages(
                rewards_per_func, self.reward_weights.to(device), num_generations
            )
        if "nsr_scale" in kwargs:
            # Half the weighted gap between a correct and an incorrect reward: 1 for +1/-1, 0.5 for 1/0.
            weight = float(self.reward_weights[self._egpo_correctness_index])
            kwargs["nsr_scale"] = weight * (1.0 - incorrect_value) / 2
        entropies = entropies.to(device) if entropies is not None else None
        return self._egpo_estimator(rewards, entropies, num_generations, correct=correct, **kwargs)

    def _egpo_correct(self, rewards_per_func: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Which completions are correct (correctness reward > 0) and an incorrect one's reward (-1 or 0)."""
        values = rewards_per_func[:, self._egpo_correctness_index]
        scored = values[~torch.isnan(values)]
        distinct = set(scored.unique().tolist())
        binary = distinct <= {-1.0, 1.0} or distinct <= {0.0, 1.0}
        if not binary and self._egpo_binary_features:
            name = self.reward_func_names[self._egpo_correctness_index]
            shown = ", ".join(f"{v:g}" for v in sorted(distinct)[:6]) + (", ..." if len(distinct) > 6 else "")
            features = ", ".join(self._egpo_binary_features)
            raise ValueError(
                f"{features} need(s) a binary correctness reward (+1/-1 or 1/0), but {name!r} returned {len(distinct)} "
                f"distinct values in this batch ({shown}). Name a binary verifier (such as "
                "egpo_trl.rewards.boxed_accuracy_reward) in egpo_correctness_reward, or use advantage_estimator='grpo'."
            )
        return values > 0, (0.0 if 0.0 in distinct else -1.0)

    def _egpo_log_metrics(self, mode: str, result: AdvantageOutput, entropies: dict, num_generations: int, scored):
        """Log a batch's ``egpo/*`` metrics; rows without a verdict (``~scored``) are out of the per-correctness means."""
        group_type = result.group_type[::num_generations]
        codes = {"all_correct": GROUP_ALL_CORRECT, "mixed": GROUP_MIXED, "all_incorrect": GROUP_ALL_INCORRECT}
        values = {f"frac_{name}": (group_type == code).float().mean().item() for name, code in codes.items()}
        values["frac_unscored"] = 1.0 - scored.float().mean().item()
        correct, incorrect = _judged_rows(result, scored)
        values.update(
            weight_correct=_mean_of(result.weights, correct), weight_incorrect=_mean_of(result.weights, incorrect)
        )
        if entropies["nll"] is not None:
            values.update(self._egpo_entropy_values(result, entropies["nll"], scored))
        if entropies["shannon"] is not None:
            shannon = entropies["shannon"].float()
            values["token_entropy_mean"] = _mean_of(shannon, torch.isfinite(shannon))
        values["entropy_extra_pass"] = float(entropies["extra_pass"])
        values["entropy_source"] = float(ENTROPY_SOURCE_CODES[entropies["source"]])
        if entropies.get("scope_fallback") is not None:
            values["frac_entropy_scope_fallback"] = entropies["scope_fallback"].float().mean().item()
        self._egpo_append_metrics(mode, values)

    def _egpo_append_metrics(self, mode: str, values: dict[str, float | None]) -> None:
        """Append ``egpo/<name>`` values to this step's metrics, leaving out undefined means (``None``)."""
        for name, value in values.items():
            if value is not None:
                self._metrics[mode][f"egpo/{name}"].append(value)

    def _egpo_entropy_values(self, result: AdvantageOutput, nll: torch.Tensor, scored: torch.Tensor) -> dict:
        """The ``egpo/entropy_*`` (and clamp-bound) metrics of a batch from its global entropy proxy ``nll``."""
        correct, incorrect = _judged_rows(result, scored)
        nll = nll.float().to(result.weights.device)
        finite = torch.isfinite(nll)
        values = {"entropy_mean": _mean_of(nll, finite), "entropy_correct": _mean_of(nll, correct & finite)}
        values["entropy_incorrect"] = _mean_of(nll, incorrect & finite)
        if values["entropy_correct"] is not None and values["entropy_incorrect"] is not None:
            values["entropy_gap"] = values["entropy_incorrect"] - values["entropy_correct"]
        valid = finite & (result.group_type != -1)
        if valid.any() and self.args.advantage_estimator == "egpo":
            raw = result.raw_weights[valid]
            values["frac_at_lambda_min"] = (raw <= self.args.egpo_lambda_min).float().mean().item()
            values["frac_at_lambda_max"] = (raw >= self.args.egpo_lambda_max).float().mean().item()
        return values
