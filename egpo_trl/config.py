"""Configuration of :class:`~egpo_trl.EGPOTrainer`: TRL's ``GRPOConfig`` plus the ``egpo_*`` fields."""

from __future__ import annotations

import inspect
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from egpo_trl.advantages import ADVANTAGE_ESTIMATORS, CLAMP_MODES, ENTROPY_NORMALIZATIONS, NSR_WEIGHTINGS, RENORM_MODES

logger = logging.getLogger(__name__)

# The sampling fields of GRPOConfig that TRL hands to vLLM, with their neutral values (1 == 1.0, 0 == 0.0).
_SAMPLING_FIELDS: dict[str, tuple[object, ...]] = dict(top_p=(1,), top_k=(0, -1), min_p=(0,), repetition_penalty=(1,))
# vLLM ``SamplingParams`` keys that change the distribution vLLM samples from, with the values that leave it unchanged
# (empty: any value changes it; temperature: the config's); in ``generation_kwargs`` they override the fields.
_DISTRIBUTION_CHANGING_KWARGS: dict[str, tuple[object, ...]] = {
    "temperature": (),
    **_SAMPLING_FIELDS,
    **dict.fromkeys(("min_tokens", "presence_penalty", "frequency_penalty"), (0,)),
    **dict.fromkeys(("logit_bias", "allowed_token_ids", "bad_words", "guided_decoding", "structured_outputs"), ()),
    "logits_processors": (),
}
#: ``vllm_importance_sampling_mode`` values that weight a whole completion by the product of its tokens' ratios.
SEQUENCE_IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = ("sequence_truncate", "sequence_mask")
# Numeric fields by rule: (lowest, highest, lowest excluded) -> names; None: no bound (then any finite number).
_NUMBERS = {
    (0.0, None, True): ("egpo_lambda_min", "egpo_entropy_eps"),
    (None, None, False): ("egpo_lambda_max",),
    (0.0, None, False): ("nsr_positive_weight", "overlong_penalty_factor"),
    (1.0, None, False): ("dynamic_sampling_oversample",),
    (0.0, 1.0, False): ("edge_gec_reflect_prob", "edge_gec_answer_prob", "edge_gec_solution_prob"),
}
# Integer fields that must be >= 1 (None allowed for overlong_buffer_length: no penalty).
_COUNTS = ("dynamic_sampling_max_rounds", "edge_gec_max_new_tokens", "overlong_buffer_length")


def trl_computes_old_logps(config) -> bool:
    """Whether TRL 1.16 runs its old-log-prob pass for ``config`` (TRL's rule)."""
    generate_every = (config.steps_per_generation or config.gradient_accumulation_steps) * config.num_iterations
    return config.gradient_accumulation_steps % generate_every != 0 or bool(
        config.use_vllm and config.vllm_importance_sampling_correction
    )


def distribution_changing_sampling_options(config) -> dict[str, object]:
    """The sampling options of ``config`` (``{name: value}``) that make vLLM sample from another distribution than
    the policy's at ``temperature``, which TRL's trainer-side log-probs describe."""
    kwargs = config.generation_kwargs if isinstance(config.generation_kwargs, dict) else {}  # JSON: parsed by then
    found: dict[str, object] = {}
    for name, neutral in _SAMPLING_FIELDS.items():
        value = getattr(config, name, None)
        if name not in kwargs and value is not None and value not in neutral:
            found[name] = value
    for key, neutral in _DISTRIBUTION_CHANGING_KWARGS.items():
        value = kwargs.get(key)
        neutral = (getattr(config, "temperature", 1.0),) if key == "temperature" else neutral
        if value is not None and value not in neutral and not (isinstance(value, (dict, list, tuple)) and not value):
            found[f"generation_kwargs.{key}"] = value
    if getattr(config, "vllm_structured_outputs_regex", None):
        found["vllm_structured_outputs_regex"] = config.vllm_structured_outputs_regex
    return found


def _distributed_engine(args) -> str | None:
    """``"DeepSpeed"`` or ``"FSDP"`` when the run is configured for one (arguments or ``accelerate launch``), else None."""
    for engine, name in (("DeepSpeed", "deepspeed"), ("FSDP", "fsdp")):
        if getattr(args, name, None) or os.environ.get(f"ACCELERATE_USE_{name.upper()}", "").lower() in ("1", "true"):
            return engine
    return None


def loss_forward_error(problems: list[str]) -> str:
    """The error for settings that ``egpo_entropy_logps="loss_forward"`` cannot serve, naming the way out."""
    return (
        f"egpo_entropy_logps='loss_forward' cannot be used here: {'; '.join(problems)}. "
        "Use egpo_entropy_logps='policy' (one no-grad pass, the default)."
    )


def oversampling_layout_error(args: Any) -> str | None:
    """Why ``args`` cannot oversample dynamic sampling's first round (``dynamic_sampling_oversample``), or ``None``:
    the added groups go to every process as whole groups, so each process's share must be whole groups too."""
    if not args.dynamic_sampling or args.dynamic_sampling_oversample <= 1.0:
        return None
    local_rows = args.per_device_train_batch_size * args.steps_per_generation
    if local_rows % args.num_generations == 0:
        return None
    return (
        f"dynamic_sampling_oversample={args.dynamic_sampling_oversample:g} adds whole groups to each process's share "
        f"of the first round, so that share must be whole groups: per_device_train_batch_size x steps_per_generation "
        f"({args.per_device_train_batch_size} x {args.steps_per_generation} = {local_rows}) must be a multiple of "
        f"num_generations ({args.num_generations}). Change one of them, or set dynamic_sampling_oversample: 1.0."
    )


@dataclass
class EGPOConfig(GRPOConfig):
    r"""
    Configuration class for [`EGPOTrainer`]: TRL's [`~trl.GRPOConfig`] plus the fields of EGPO and its baselines,
    each documented by its `help` (`egpo-trl train --help-all`).
    """

    advantage_estimator: str = field(
        default="egpo",
        metadata={
            "help": "'egpo' (the paper), 'grpo' (TRL's), 'nsr', 'edge_grpo', or a name in ADVANTAGE_ESTIMATORS."
        },
    )
    egpo_lambda_min: float = field(default=0.8, metadata={"help": "Lower clip bound of the EGPO weight (Eq. 9); > 0."})
    egpo_lambda_max: float = field(default=2.0, metadata={"help": "Upper clip bound of the EGPO weight (Eq. 9)."})
    egpo_entropy_eps: float = field(
        default=1e-6, metadata={"help": "epsilon_H in mean(H) / (H_i + epsilon_H) (Eq. 8)."}
    )
    egpo_clamp: str = field(
        default="asymmetric",
        metadata={
            "help": "Weight bounds: 'asymmetric' (paper Eq. 9), ablations 'symmetric' (C1), 'negative_only' (C2), "
            "'positive_only' (C3), or 'none' (w = 1).",
            "choices": list(CLAMP_MODES),
        },
    )
    egpo_renorm: str = field(
        default="none",
        metadata={
            "help": "Renormalise weights to group mean 1: 'none' (paper), 'after_clamp' (C5) or 'before_clamp' (C6).",
            "choices": list(RENORM_MODES),
        },
    )
    egpo_nsr: bool = field(
        default=True,
        metadata={"help": "Negative sample reinforcement: all-incorrect groups get advantage -1 (Sec. 3.2)."},
    )
    egpo_nsr_weighting: str = field(
        default="entropy",
        metadata={"help": "All-incorrect groups' weights: 'entropy' or 'unit' (C4).", "choices": list(NSR_WEIGHTINGS)},
    )
    egpo_correctness_reward: str | None = field(
        default=None,
        metadata={
            "help": "The binary reward function deciding correctness (unset: the only one, or boxed_accuracy_reward)."
        },
    )
    egpo_entropy_scope: str = field(
        default="completion",
        metadata={
            "help": "Tokens the entropy proxy averages: 'completion' (Eq. 5), 'thinking' or 'answer' (around </think>).",
            "choices": ["completion", "thinking", "answer"],
        },
    )
    egpo_entropy_logps: str = field(
        default="policy",
        metadata={
            "help": "Entropy proxy's log-probs where TRL computes none: 'policy' (a no-grad pass), 'sampler' (vLLM's) "
            "or 'loss_forward' (the loss's forward; egpo and edge_grpo).",
            "choices": ["policy", "sampler", "loss_forward"],
        },
    )
    egpo_entropy_metrics: bool = field(
        default=True, metadata={"help": "Log the egpo/entropy_* metrics also for grpo and nsr, which ignore entropy."}
    )
    egpo_shift_prompt_padding: bool = field(
        default=True,
        metadata={
            "help": "Shift rows past prompt padding in the log-prob passes so that SDPA uses its causal kernel."
        },
    )
    nsr_positive_weight: float = field(
        default=0.0, metadata={"help": "nsr: a correct completion's advantage (0: NSR; 0.1: Weighted-REINFORCE)."}
    )
    edge_grpo_entropy_normalization: str = field(
        default="group",
        metadata={
            "help": "edge_grpo: normalise entropy by the mean over its 'group' (paper) or the 'batch'.",
            "choices": list(ENTROPY_NORMALIZATIONS),
        },
    )
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "DAPO's dynamic sampling: replace uninformative groups by new generations."}
    )
    dynamic_sampling_max_rounds: int = field(
        default=10, metadata={"help": "Most generation rounds per batch; then uninformative groups fill it."}
    )
    dynamic_sampling_oversample: float = field(
        default=1.0, metadata={"help": "The first round generates this many times the batch's groups (>= 1)."}
    )
    dynamic_sampling_metric: str = field(
        default="correctness",
        metadata={
            "help": "A group is uninformative when all are correct or all incorrect ('correctness', DAPO's) or all "
            "have the same total reward ('reward').",
            "choices": ["correctness", "reward"],
        },
    )
    overlong_buffer_length: int | None = field(
        default=None,
        metadata={
            "help": "DAPO's overlong penalty grows over this many tokens before max_completion_length; None: off."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"help": "The largest overlong penalty, reached at max_completion_length."}
    )
    edge_gec: bool = field(
        default=False,
        metadata={"help": "EDGE-GRPO's Guided Error Correction of incorrect completions ('answer' column)."},
    )
    edge_gec_scope: str = field(
        default="incorrect",
        metadata={
            "help": "Completions GEC may change: every 'incorrect' one or those of 'all_incorrect_groups' only.",
            "choices": ["incorrect", "all_incorrect_groups"],
        },
    )
    edge_gec_reflect_prob: float = field(
        default=0.5, metadata={"help": "Probability that GEC continues a completion after the reflection cue."}
    )
    edge_gec_answer_prob: float = field(
        default=0.25, metadata={"help": "Probability that GEC appends the reference answer to a completion."}
    )
    edge_gec_solution_prob: float = field(
        default=0.25, metadata={"help": "Probability that GEC uses the 'solution' column; the three sum to <= 1."}
    )
    edge_gec_reflection_cue: str = field(
        default=" Hold on, something in this solution is wrong. Let me check it again.",
        metadata={"help": "Text appended to an incorrect completion before the policy continues it."},
    )
    edge_gec_answer_template: str = field(
        default="\nHold on, something in this solution is wrong. Checking it again, the answer is \\boxed{{answer}}.",
        metadata={"help": "Text giving the reference answer in place of '{answer}', e.g. \\boxed{{answer}}."},
    )
    edge_gec_max_new_tokens: int = field(
        default=256, metadata={"help": "Most tokens the policy generates after the reflection cue."}
    )

    def __post_init__(self):
        # TRL's own check divides by num_generations first: 0 would end in a ZeroDivisionError, not a message.
        if isinstance(self.num_generations, int) and self.num_generations < 2:
            raise ValueError(
                f"num_generations must be at least 2 (completions per prompt: a group's advantages compare them), got "
                f"{self.num_generations}."
            )
        from egpo_trl.input_checks import batch_shape_problem, training_value_problems

        problems = training_value_problems(self)
        if problems:
            raise ValueError(f"EGPOConfig: {'; '.join(problems)}.")
        given = (self.steps_per_generation, self.generation_batch_size)
        try:
            super().__post_init__()
        except ValueError as error:  # the line the CLI gives, in the fields users set
            if "divisible by num_generations" not in str(error):
                raise
            sizes = (self.per_device_train_batch_size, self.world_size, self.gradient_accumulation_steps)
            raise ValueError(batch_shape_problem(*sizes, self.num_generations, *given) or str(error)) from None
        self._validate_egpo()

    def _note_sampler_fallback(self) -> None:
        """Say when ``egpo_entropy_logps="sampler"`` has no usable sampling log-probs and a pass runs instead."""
        if trl_computes_old_logps(self):
            return  # the proxy takes TRL's old-policy log-probs, at no cost
        reason = "generation without vLLM returns no sampling log-probs"
        if self.use_vllm:
            options = distribution_changing_sampling_options(self)
            if not options:
                return
            reason = f"vLLM samples from another distribution than the policy's at the temperature ({options})"
        logger.warning(
            "egpo_entropy_logps='sampler': %s, so the entropy proxy comes from one no-grad pass of the policy. Set "
            "egpo_entropy_logps='policy' to say so.",
            reason,
        )

    def _validate_loss_forward(self, problems: list[str] | None = None) -> None:
        """Refuse what ``egpo_entropy_logps="loss_forward"`` cannot serve exactly (see ``egpo_trl/fused.py``), in one
        error with ``problems`` (what the trainer found) added."""
        from egpo_trl.fused import block_size, deepspeed_problem, reentrant_checkpointing

        found, problems = list(problems or []), []
        if self.advantage_estimator not in ("egpo", "edge_grpo"):
            problems.append(
                f"advantage_estimator is {self.advantage_estimator!r}; it serves EGPO's and EDGE-GRPO's estimators only"
            )
        elif self.advantage_estimator == "edge_grpo" and self.edge_grpo_entropy_normalization != "group":
            problems.append("edge_grpo_entropy_normalization 'batch' needs the whole batch's mean entropy")
        steps = self.steps_per_generation or self.gradient_accumulation_steps
        if self.gradient_accumulation_steps % (steps * self.num_iterations):
            problems.append(
                f"steps_per_generation ({steps}) x num_iterations ({self.num_iterations}) does not divide "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}), so TRL computes the old policy's "
                "log-probs itself (EGPO uses those at no extra cost)"
            )
        if self.num_iterations > 1:
            problems.append("num_iterations > 1 has TRL compute the old policy's log-probs itself")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            problems.append("vLLM's importance-sampling correction has TRL compute the old policy's log-probs itself")
        # Grouping a block's rows changes which rows share a micro-batch: terms normalised per micro-batch change.
        if self.loss_type == "bnpo":
            problems.append("loss_type 'bnpo' averages over each micro-batch's tokens")
        if self.top_entropy_quantile < 1.0:
            problems.append("top_entropy_quantile < 1 takes its threshold within each micro-batch")
        if self.entropy_coef != 0.0 or getattr(self, "use_adaptive_entropy", False):
            problems.append("an entropy bonus (entropy_coef, use_adaptive_entropy) is averaged per micro-batch")
        if "lomo" in str(getattr(self, "optim", "")).lower():
            problems.append(f"optim {self.optim!r} updates the weights during each backward, unlike pi_old's")
        if getattr(self, "neftune_noise_alpha", None):
            problems.append("neftune_noise_alpha adds noise to the training forward's embeddings, unlike pi_old's")
        if (getattr(getattr(self, "parallelism_config", None), "cp_size", 1) or 1) > 1:
            problems.append("context parallelism prepares each micro-batch's inputs in its own forward")
        if (self.per_device_train_batch_size * steps) % self.num_generations:
            problems.append(
                f"each process's generation batch ({self.per_device_train_batch_size * steps} rows: "
                f"per_device_train_batch_size x steps_per_generation) is not a multiple of num_generations "
                f"({self.num_generations}), so a group spans processes"
            )
        world_size, engine = self._loss_forward_launch()
        if engine == "FSDP":
            problems.append("it has not been checked under FSDP yet")
        if engine == "DeepSpeed" and (old_deepspeed := deepspeed_problem()):
            problems.append(old_deepspeed)
        # DDP's and ZeRO's gradient hooks take one report per weight and backward; reentrant checkpointing gives more.
        reentrant = self.gradient_checkpointing and reentrant_checkpointing(self.gradient_checkpointing_kwargs)
        several = world_size > 1 or engine is not None
        if reentrant and several and block_size(self.per_device_train_batch_size, self.num_generations) > 1:
            problems.append(
                "reentrant gradient checkpointing cannot hold several forwards for one backward under data "
                "parallelism or DeepSpeed; set gradient_checkpointing_kwargs: {use_reentrant: false}"
            )
        if problems + found:
            raise ValueError(loss_forward_error(problems + found))

    def _loss_forward_launch(self) -> tuple[int, str | None]:
        """The run's process count and distributed engine (``"DeepSpeed"``, ``"FSDP"`` or ``None``)."""
        return self.world_size, _distributed_engine(self)

    def _validate_egpo(self) -> None:
        for name in EGPOConfig.__annotations__:
            allowed = sorted(ADVANTAGE_ESTIMATORS) if name == "advantage_estimator" else None
            allowed = allowed or self.__dataclass_fields__[name].metadata.get("choices")
            if allowed and getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported; set it to one of: {', '.join(allowed)}."
                )
        if self.max_steps == 0:  # transformers would train one step while saying it trains by epochs
            raise ValueError("max_steps=0 is not a length: set a number of steps, or -1 to use num_train_epochs.")
        for (low, high, strict), name in ((rule, name) for rule, names in _NUMBERS.items() for name in names):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if (
                not number
                or (low is not None and (value <= low if strict else value < low))
                or (high and value > high)
            ):
                bounds = (
                    f" in [{low}, {high}]" if high else f" {'>' if strict else '>='} {low}" if low is not None else ""
                )
                raise ValueError(f"{name} must be a {'finite ' * (low is None)}number{bounds}, got {value!r}.")
        for name in _COUNTS:
            value = getattr(self, name)
            if not (value is None and name == "overlong_buffer_length") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.egpo_lambda_min > self.egpo_lambda_max:
            raise ValueError(
                f"egpo_lambda_min ({self.egpo_lambda_min}) is larger than egpo_lambda_max ({self.egpo_lambda_max}); "
                "set egpo_lambda_min <= egpo_lambda_max (the paper uses 0.8 and 2.0)."
            )
        if self.egpo_clamp == "asymmetric" and not self.egpo_lambda_min <= 1.0 <= self.egpo_lambda_max:
            raise ValueError(
                f"With egpo_clamp='asymmetric' the bounds must bracket 1 (lambda_min <= 1 <= lambda_max), got "
                f"[{self.egpo_lambda_min}, {self.egpo_lambda_max}]; otherwise one side of the clamp is a constant."
            )
        if self.egpo_entropy_logps == "loss_forward":
            self._validate_loss_forward()
        if self.egpo_entropy_logps == "sampler" and self.advantage_estimator == "egpo":
            self._note_sampler_fallback()
        from egpo_trl.input_checks import generation_kwargs_problem

        problem = generation_kwargs_problem(self)
        if problem:
            raise ValueError(problem)
        self._validate_baselines()
        self._validate_importance_sampling()
        estimator = ADVANTAGE_ESTIMATORS[self.advantage_estimator]
        if self.multi_objective_aggregation == "normalize_then_sum" and not _takes_group_advantages(estimator):
            accepting = [name for name, func in ADVANTAGE_ESTIMATORS.items() if _takes_group_advantages(func)]
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} does not use GRPO's group-normalised advantages; set "
                f"multi_objective_aggregation='sum_then_normalize', or use one of {accepting}."
            )

    def _validate_importance_sampling(self) -> None:
        """Refuse vLLM sampling options under which TRL's sequence-level importance-sampling ratio would collapse."""
        mode = self.vllm_importance_sampling_mode
        correcting = self.use_vllm and self.vllm_importance_sampling_correction
        if not correcting or mode not in SEQUENCE_IMPORTANCE_SAMPLING_MODES:
            return
        options = distribution_changing_sampling_options(self)
        if options:
            listed = ", ".join(f"{name}={value!r}" for name, value in options.items())
            raise ValueError(
                f"{listed} with use_vllm and vllm_importance_sampling_mode={mode!r}: vLLM samples from another "
                "distribution than TRL's log-probs describe, so the sequence-level importance-sampling weight falls "
                "towards 0 over a long completion. Sample plainly (top_p: 1.0, top_k: 0, min_p: null, "
                "repetition_penalty: 1.0), use vllm_importance_sampling_mode: token_truncate, or set "
                "vllm_importance_sampling_correction: false (the paper's setup; see docs/multi_gpu.md)."
            )

    def _validate_baselines(self) -> None:
        if self.dynamic_sampling_oversample != 1.0 and not self.dynamic_sampling:
            raise ValueError(
                f"dynamic_sampling_oversample={self.dynamic_sampling_oversample:g} sizes dynamic sampling's first "
                "round, but dynamic_sampling is off; set dynamic_sampling: true, or dynamic_sampling_oversample: 1.0 "
                "(with a recipe that sets it, add --dynamic_sampling_oversample 1.0 to --dynamic_sampling false)."
            )
        layout = oversampling_layout_error(self)
        if layout:
            raise ValueError(layout)
        if self.overlong_buffer_length is not None and self.overlong_buffer_length > self.max_completion_length:
            raise ValueError(
                f"overlong_buffer_length ({self.overlong_buffer_length}) is longer than max_completion_length "
                f"({self.max_completion_length}); set it to at most max_completion_length, or leave it unset."
            )
        total = self.edge_gec_reflect_prob + self.edge_gec_answer_prob + self.edge_gec_solution_prob
        if total > 1.0 + 1e-9:
            raise ValueError(f"the three edge_gec_*_prob add up to {total:g}; lower them to sum to at most 1.")
        if "{answer}" not in self.edge_gec_answer_template:
            raise ValueError(
                f"edge_gec_answer_template must contain '{{answer}}', got {self.edge_gec_answer_template!r}."
            )
        from egpo_trl.rewards import TEMPLATE_PROBE_ANSWER, answer_template_probe

        rendered, readable = answer_template_probe(self.edge_gec_answer_template)
        if ("\\boxed" in rendered or "\\fbox" in rendered) and not readable:
            raise ValueError(
                f"edge_gec_answer_template {self.edge_gec_answer_template!r} gives {rendered!r} for the answer "
                f"{TEMPLATE_PROBE_ANSWER!r}, whose last box does not hold the answer; keep the box's braces around "
                "the placeholder: \\boxed{{answer}}."
            )


def _takes_group_advantages(estimator) -> bool:
    return "group_advantages" in inspect.signature(estimator).parameters
