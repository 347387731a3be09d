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
* otherwise the sampling log-probs vLLM returned (``use_vllm`` without importance-sampling
  correction). No extra cost.
* otherwise one extra no-grad forward pass of the policy over the generation batch (plain
  transformers generation with ``num_iterations = 1``). It costs about a third of a training
  step's forward+backward; ``benchmarks/`` measures it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from egpo_trl.advantages import (
    GROUP_ALL_CORRECT,
    GROUP_ALL_INCORRECT,
    GROUP_MIXED,
    AdvantageOutput,
    get_advantage_estimator,
    sequence_entropy,
)
from egpo_trl.config import EGPOConfig

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
    the weighted sum of all rewards, as GRPO does.

    Metrics logged beside TRL's, per generation batch (``egpo/*``): the fraction of entirely-correct,
    mixed and entirely-incorrect groups, the mean weight on correct and on incorrect completions, the
    mean entropy of correct and of incorrect completions and their gap (incorrect minus correct), the
    fraction of raw weights at each clip bound, and whether an extra forward pass was needed.
    """

    _tag_names = ["trl", "egpo"]
    _name = "EGPO"

    def __init__(self, model, reward_funcs=None, args: EGPOConfig | None = None, *pos_args: Any, **kwargs: Any):
        if args is None:
            from trl.models.utils import get_config_model_id

            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = EGPOConfig(f"{model_name.split('/')[-1]}-EGPO")
        elif not isinstance(args, EGPOConfig):
            raise TypeError(
                f"EGPOTrainer needs an EGPOConfig, got {type(args).__name__}. Build one with the same fields, e.g. "
                "`EGPOConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})`."
            )
        super().__init__(model, reward_funcs, args, *pos_args, **kwargs)

        self._egpo_estimator = get_advantage_estimator(args.advantage_estimator)
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
        self._egpo_rewards_per_func: torch.Tensor | None = None
        #: What the last generation batch computed (global tensors), for inspection and tests.
        self.egpo_last_batch: dict[str, Any] = {}

    # ------------------------------------------------------------------ TRL hooks
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._egpo_rewards_per_func = rewards_per_func  # gathered over processes, [B_global, num_funcs]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._egpo_rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        if self._egpo_rewards_per_func is None:  # pragma: no cover - TRL always scores through _calculate_rewards
            raise RuntimeError("EGPOTrainer could not capture the rewards of this batch; is the TRL version 1.16.0?")
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval

        entropies, source = self._egpo_entropies(output)
        result = self._egpo_compute(self._egpo_rewards_per_func, entropies, num_generations)

        local = output["advantages"].shape[0]
        process_slice = slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)
        output["advantages"] = result.advantages[process_slice].to(output["advantages"].dtype)

        # The completions table shows the advantages the loss uses.
        logged = self._logs["advantages"]
        for _ in range(min(len(logged), result.advantages.numel())):
            logged.pop()
        logged.extend(result.advantages.tolist())

        self._egpo_log_metrics(mode, result, entropies, num_generations, source)
        self.egpo_last_batch = {
            "rewards_per_func": self._egpo_rewards_per_func,
            "entropies": entropies,
            "result": result,
            "entropy_source": source,
            "process_slice": process_slice,
            "num_generations": num_generations,
        }
        self._egpo_rewards_per_func = None
        return output

    # ------------------------------------------------------------------ pieces
    def _egpo_loss_mask(self, output: dict[str, Any]) -> torch.Tensor:
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        if self.args.egpo_entropy_scope != "completion":
            from egpo_trl.segments import segment_masks

            thinking, answer = segment_masks(output["completion_ids"], mask, self.processing_class)
            mask = thinking if self.args.egpo_entropy_scope == "thinking" else answer
        return mask

    def _egpo_entropies(self, output: dict[str, Any]) -> tuple[torch.Tensor, str]:
        """Global ``Tensor[B_global]`` entropy proxies of this generation batch, and where the log-probs came from."""
        mask = self._egpo_loss_mask(output)
        if output.get("old_per_token_logps") is not None:
            logps, source = output["old_per_token_logps"], "old_per_token_logps"
        elif output.get("sampling_per_token_logps") is not None:
            logps, source = output["sampling_per_token_logps"], "sampling_per_token_logps"
        else:
            logps, source = self._egpo_forward_logps(output), "forward"
        local = sequence_entropy(logps, mask)
        return self.accelerator.gather(local), source

    @torch.no_grad()
    def _egpo_forward_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """One no-grad pass of the (old) policy over the batch: per-token log-probs ``[B_local, C]``."""
        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        forward_kwargs = {key: output[key] for key in _FORWARD_KEYS if output.get(key) is not None}
        was_training = self.model.training
        self.model.eval()  # no dropout: the proxy is the old policy's, and no RNG is consumed
        try:
            with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    batch_size=batch_size,
                    **forward_kwargs,
                )
        finally:
            self.model.train(was_training)
        return logps

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
        }

    def _egpo_compute(
        self, rewards_per_func: torch.Tensor, entropies: torch.Tensor, num_generations: int
    ) -> AdvantageOutput:
        """Advantages on the global batch from TRL's per-function rewards and the entropies."""
        device = rewards_per_func.device
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        # The weighted reward sum, exactly as GRPOTrainer forms it.
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        correct = rewards_per_func[:, self._egpo_correctness_index] > 0
        return self._egpo_estimator(
            rewards,
            entropies.to(device),
            num_generations,
            correct=correct,
            **self._egpo_advantage_kwargs(),
        )

    def _egpo_log_metrics(
        self, mode: str, result: AdvantageOutput, entropies: torch.Tensor, num_generations: int, source: str
    ) -> None:
        metrics = self._metrics[mode]
        group_type = result.group_type[::num_generations]
        for name, code in (
            ("frac_all_correct", GROUP_ALL_CORRECT),
            ("frac_mixed", GROUP_MIXED),
            ("frac_all_incorrect", GROUP_ALL_INCORRECT),
        ):
            metrics[f"egpo/{name}"].append((group_type == code).float().mean().item())
        entropies = entropies.float().to(result.weights.device)
        finite = torch.isfinite(entropies)
        correct = result.correct
        incorrect = ~correct & (result.group_type != -1)

        def mean_of(values: torch.Tensor, where: torch.Tensor) -> float | None:
            return values[where].mean().item() if where.any() else None

        values = {
            "weight_correct": mean_of(result.weights, correct),
            "weight_incorrect": mean_of(result.weights, incorrect),
            "entropy_mean": mean_of(entropies, finite),
            "entropy_correct": mean_of(entropies, correct & finite),
            "entropy_incorrect": mean_of(entropies, incorrect & finite),
        }
        if values["entropy_correct"] is not None and values["entropy_incorrect"] is not None:
            values["entropy_gap"] = values["entropy_incorrect"] - values["entropy_correct"]
        valid = finite & (result.group_type != -1)
        if valid.any() and self.args.advantage_estimator == "egpo":
            raw = result.raw_weights[valid]
            values["frac_at_lambda_min"] = (raw <= self.args.egpo_lambda_min).float().mean().item()
            values["frac_at_lambda_max"] = (raw >= self.args.egpo_lambda_max).float().mean().item()
        values["entropy_extra_pass"] = float(source == "forward")
        for name, value in values.items():
            if value is not None:  # an undefined mean (no correct completion, say) is left out, not logged as NaN
                metrics[f"egpo/{name}"].append(value)
