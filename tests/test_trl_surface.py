"""Every part of TRL and transformers beyond their documented API that egpo_trl relies on, checked against the
installed versions.

``EGPOTrainer`` overrides private methods of ``GRPOTrainer`` and of transformers' ``Trainer``, reads and restores
attributes they set, relies on the shapes of what their private methods return, patches TRL's vLLM generator and
imports helpers from TRL's internal modules. A release may change any of these without notice. The tables below list
them all, in one place, with the file that uses each; the first test checks the installed TRL and transformers
against every entry and fails with one message that lists everything missing or changed, so that an upgrade fails
here first rather than deep inside a training step (or a resumed one).

vLLM's own internals (the colocated engine's sleep and wake-up, the CPU weight reload, sampling seeds) are listed in
``VLLM``; the second test checks them when vLLM is installed and is skipped otherwise.

When egpo_trl starts to use another internal of TRL, transformers or vLLM, add it here.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import inspect

import pytest
import torch
from conftest import make_prompt_dataset, parity_reward
from conftest import trainer_config as config

# Functions imported from TRL's internal modules: (module, name, leading parameter names, used by).
FUNCTIONS = [
    ("trl.trainer.utils", "get_config_model_id", ["config"], "egpo_trl/trainer.py"),
    ("trl.trainer.utils", "get_callable_name", ["func"], "egpo_trl/correctness.py (reproduces its names)"),
    ("trl.models.utils", "disable_gradient_checkpointing", ["model", "gradient_checkpointing_kwargs"], "trainer.py"),
    ("trl.data_utils", "is_conversational", ["example"], "egpo_trl/sampling/gec.py"),
    (
        "transformers.trainer",
        "deactivate_neftune",
        ["model", "hook_handle", "accelerator"],
        "egpo_trl/resume_state.py (a finished run's end)",
    ),
    ("trl.trainer.utils", "selective_log_softmax", ["logits", "index", "temperature"], "benchmarks/is_gap.py"),
    ("trl.trainer.utils", "nanstd", ["tensor", "dim", "keepdim"], "egpo_trl/sampling/dynamic.py"),
    ("trl.trainer.utils", "is_async_callable", ["func"], "egpo_trl/sampling/gec.py (rescoring async rewards)"),
    (
        "trl.trainer.utils",
        "add_fused_lm_head",
        ["model", "temperature", "cast_lm_head_to_fp32", "outputs"],
        "egpo_trl/old_logps.py (the fused_lm_head=True forward GRPOTrainer installs)",
    ),
]

# Module-level values of TRL and transformers that egpo_trl relies on: (module, name, expected value, used by).
CONSTANTS = [
    (
        "transformers.trainer_utils",
        "PREFIX_CHECKPOINT_DIR",
        "checkpoint",
        "egpo_trl/resume_state.py, egpo_trl/script/resume.py (checkpoint-<step> folders)",
    ),
]

# Private methods of GRPOTrainer that EGPOTrainer overrides or calls: (name, leading parameter names after self,
# used by). Calls pass these names positionally or as keywords, so both order and names matter.
METHODS = [
    ("_generate_and_score_completions", ["inputs"], "trainer.py (override), sampling/dynamic.py"),
    ("_calculate_rewards", ["inputs", "prompts", "completions", "completion_ids_list"], "trainer.py, gec.py"),
    ("_generate", ["prompts"], "trainer.py (override, Guided Error Correction)"),
    ("_generate_single_turn", ["prompt_ids", "images", "multimodal_fields", "num_generations"], "sampling/gec.py"),
    (
        "_get_per_token_logps_and_entropies",
        ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"],
        "trainer.py (override, and the extra entropy pass)",
    ),
    ("_compute_loss", ["model", "inputs"], "tests/recording.py"),
    (
        "compute_loss",
        ["model", "inputs", "return_outputs", "num_items_in_batch"],
        "trainer.py (override: marks the rows of the loss's forward for the deferred entropy metrics)",
    ),
    ("__init__", ["model", "reward_funcs", "args"], "trainer.py (passes them positionally)"),
    (
        "_prepare_inputs",
        ["generation_batch"],
        "trainer.py (override: fused.py groups the shuffled rows in blocks), resume_state.py (override: Ctrl-C held "
        "from a step's last micro-batch)",
    ),
    (
        "training_step",
        ["model", "inputs", "num_items_in_batch"],
        "trainer.py (override: fused.py keeps a block's micro-batches until the last one's step)",
    ),
    # transformers.Trainer's, overridden by ExactResumeMixin (egpo_trl/resume_state.py) for exact resume.
    (
        "_save_checkpoint",
        ["model", "trial"],
        "resume_state.py (override: saves GRPO's state too), script/resume.py (Ctrl-C checkpoint)",
    ),
    ("_load_rng_state", ["checkpoint"], "resume_state.py (override: restores GRPO's state)"),
    ("_get_train_sampler", ["dataset"], "resume_state.py (override: keeps the sampler)"),
    (
        "_init_training_state",
        ["max_steps", "num_update_steps_per_epoch", "num_train_epochs", "resume_from_checkpoint", "trial"],
        "resume_state.py (override: replays the sampler's permutations of the epochs trained)",
    ),
    (
        "_maybe_log_save_evaluate",
        ["tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval", "start_time", "learning_rate"],
        "resume_state.py (override: the step-boundary snapshot for the Ctrl-C checkpoint)",
    ),
    ("_get_output_dir", ["trial"], "resume_state.py (the checkpoint folder)"),
    (
        "train",
        ["resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
        "resume_state.py (override: a run resumed at its last step trains nothing), script/run.py",
    ),
    ("_load_best_model", [], "resume_state.py (a finished run's end, with load_best_model_at_end)"),
    ("get_train_dataloader", [], "script/resume.py (trainer_last_step: the steps of an epoch-sized run)"),
    (
        "set_initial_training_values",
        ["args", "dataloader"],
        "script/resume.py (trainer_last_step: max_steps, the last of the values it returns)",
    ),
]

# Everything of GRPOTrainer that EGPOTrainer or its mixins define again, on purpose. Any other name they share (a
# helper of a mixin that a new TRL release also defines, say) would silently replace TRL's.
OVERRIDES = {
    "__init__",
    "_tag_names",
    "_name",
    "_calculate_rewards",
    "_generate",
    "_generate_and_score_completions",
    "_get_per_token_logps_and_entropies",
    "compute_loss",
    "_prepare_inputs",
    "training_step",
    # ExactResumeMixin (egpo_trl/resume_state.py): transformers.Trainer's, for exact resume.
    "_save_checkpoint",
    "_load_rng_state",
    "_get_train_sampler",
    "_init_training_state",
    "_maybe_log_save_evaluate",
    "train",
}

# Attributes GRPOTrainer.__init__ sets that egpo_trl reads (or, for the generation settings, changes for a while):
# (name, check on a real trainer, what is expected, used by).
INSTANCE_ATTRIBUTES = [
    (
        "_metrics",
        lambda v: set(v) == {"train", "eval"} and isinstance(v["train"], collections.defaultdict),
        "{'train': defaultdict(list), 'eval': ...}",
        "trainer.py, dynamic.py, gec.py",
    ),
    (
        "_logs",
        lambda v: (
            {"prompt", "completion", "advantages", "rewards", "extra"} <= set(v)
            and isinstance(v["advantages"], collections.deque)
            and isinstance(v["rewards"], collections.defaultdict)
        ),
        "dict with prompt/completion/advantages deques and rewards/extra defaultdicts",
        "trainer.py, dynamic.py",
    ),
    ("_tokenizer", lambda v: hasattr(v, "pad_token_id") and callable(v), "the tokenizer", "dynamic.py, gec.py"),
    (
        "eos_token_ids",
        lambda v: isinstance(v, list) and v and all(isinstance(i, int) for i in v),
        "list of int",
        "sampling/gec.py",
    ),
    ("generation_config", lambda v: hasattr(v, "max_new_tokens"), "a GenerationConfig", "sampling/gec.py"),
    ("generation_kwargs", lambda v: isinstance(v, dict), "dict", "sampling/gec.py"),
    ("reward_funcs", lambda v: isinstance(v, list), "list", "trainer.py"),
    (
        "reward_func_names",
        lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
        "list of str",
        "trainer.py, script/run.py",
    ),
    ("reward_weights", lambda v: isinstance(v, torch.Tensor) and v.dim() == 1, "1-D tensor", "trainer.py"),
    ("scale_rewards", lambda v: v in ("group", "batch", "none", True, False), "str", "trainer.py"),
    ("num_generations", lambda v: isinstance(v, int), "int", "trainer.py, gec.py"),
    ("num_generations_eval", lambda v: isinstance(v, int), "int", "trainer.py"),
    ("num_iterations", lambda v: isinstance(v, int), "int", "trainer.py"),
    ("max_completion_length", lambda v: isinstance(v, int), "int", "sampling/gec.py"),
    ("use_vllm", lambda v: isinstance(v, bool), "bool", "trainer.py, gec.py"),
    ("vllm_importance_sampling_correction", lambda v: isinstance(v, bool), "bool", "trainer.py"),
    ("tools", lambda v: v is None or isinstance(v, list), "list or None", "sampling/dynamic.py"),
    ("rollout_func", lambda v: v is None, "None here", "sampling/dynamic.py"),
    ("environment_factories", lambda v: v is None, "None here", "sampling/dynamic.py"),
    ("_is_vlm", lambda v: v is False, "False for a text model", "sampling/dynamic.py"),
    (
        "multi_objective_aggregation",
        lambda v: v in ("sum_then_normalize", "normalize_then_sum"),
        "'sum_then_normalize' or 'normalize_then_sum'",
        "trainer.py",
    ),
    (
        "_pending_extra_logs",
        lambda v: isinstance(v, collections.defaultdict) and v.default_factory is list,
        "defaultdict(list)",
        "sampling/gec.py (moves what reward functions log between the two scorings of a round)",
    ),
    (
        "_pending_metrics",
        lambda v: isinstance(v, collections.defaultdict) and v.default_factory is list,
        "defaultdict(list)",
        "sampling/gec.py",
    ),
    (
        "_step",
        lambda v: v == 0,
        "0 (the micro-step counter)",
        "resume_state.py (saved and restored), fused.py, dynamic.py",
    ),
    (
        "_current_train_step_time",
        lambda v: v == 0.0,
        "0.0 (the step_time metric's running sum)",
        "fused.py (a kept micro-batch's time counts in the step)",
    ),
    ("_buffered_inputs", lambda v: v is None, "None (the generation batch buffer)", "resume_state.py"),
    ("train_dataset", lambda v: v is not None and len(v) > 0, "the dataset", "sampling/dynamic.py, gec.py"),
    ("processing_class", lambda v: hasattr(v, "pad_token_id"), "the tokenizer", "trainer.py, gec.py, run.py"),
]

# Text that TRL's source must contain: each is a behaviour egpo_trl relies on and a signature cannot show.
# (object, text, why, used by).
SOURCE = [
    (
        "Trainer.training_step",
        "loss_is_scaled_for_ga = self.loss_is_scaled_for_ga",
        "the loss's scaling for gradient accumulation, which a block's earlier micro-batches repeat for their own "
        "backwards",
        "fused.py (_fused_backward_now)",
    ),
    (
        "Trainer.training_step",
        'kwargs["scale_wrt_gas"] = False',
        "DeepSpeed is told not to scale the loss again (so is each of a block's earlier backwards)",
        "fused.py (_fused_backward_now)",
    ),
    (
        "Trainer.training_step",
        "self.accelerator.backward(loss, **kwargs)",
        "the backward goes through accelerator.backward, as a block's earlier micro-batches' do",
        "fused.py (_fused_backward_now)",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        "= self._generate(prompts)",
        "generation goes through _generate (the Guided Error Correction hook)",
        "trainer.py",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        "self._calculate_rewards(inputs, prompts, completions, ",
        "scoring goes through _calculate_rewards (where the per-function rewards are captured)",
        "trainer.py",
    ),
    (
        "GRPOTrainer._compute_loss",
        "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(",
        "the loss's forward goes through _get_per_token_logps_and_entropies (the deferred entropy metrics read it)",
        "trainer.py",
    ),
    (
        "GRPOTrainer.compute_loss",
        "return self._compute_loss(model, inputs)",
        "compute_loss runs the loss's forward (EGPOTrainer.compute_loss marks its rows first)",
        "trainer.py",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        "old_per_token_logps, _, _ = self._get_per_token_logps_and",
        "the old-policy pass goes through _get_per_token_logps_and_entropies",
        "trainer.py",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        "if self.args.gradient_accumulation_steps % generate_every != 0 or (\n"
        "                self.use_vllm and self.vllm_importance_sampling_correction",
        "the rule for computing old log-probs, mirrored by _trl_computes_old_logps",
        "trainer.py",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        '"sampling/importance_sampling_ratio/mean"',
        "the metric the low-ratio warning reads",
        "trainer.py",
    ),
    ("GRPOTrainer._generate_and_score_completions", 'output["old_per_token_logps"]', "output key", "trainer.py"),
    ("GRPOTrainer._generate_and_score_completions", 'output["sampling_per_token_logps"]', "output key", "trainer.py"),
    ("GRPOTrainer._generate_and_score_completions", 'output["tool_mask"]', "output key", "trainer.py"),
    (
        "GRPOTrainer.__init__",
        "self.vllm_generation = VLLMGeneration(",
        "the vLLM generator's attribute",
        "gec.py, tests/vllm_cpu.py",
    ),
    (
        "VLLMGeneration.generate",
        "max_completion_length = self.max_completion_length",
        "the length limit is read at each call (GEC sets it for a continuation)",
        "sampling/gec.py",
    ),
    (
        "GRPOTrainer.__init__",
        "max_num_seqs=args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,",
        "the colocated engine holds a generation batch's share (raised for an oversampled first round)",
        "sampling/dynamic.py",
    ),
    (
        "VLLMGeneration._init_vllm",
        "max_num_seqs=self.max_num_seqs,",
        "the engine is started with the max_num_seqs the trainer gives",
        "sampling/dynamic.py",
    ),
    ("VLLMGeneration.__init__", "self.mode = mode", "colocate or server", "tests/vllm_cpu.py"),
    ("VLLMGeneration._init_vllm", "self.llm = LLM(", "the colocated engine", "tests/vllm_cpu.py"),
    ("VLLMGeneration.sync_weights", "", "replaced on CPU builds by cpu_sync_weights", "tests/vllm_cpu.py"),
    ("VLLMGeneration._iter_named_params", "", "the weights cpu_sync_weights streams", "tests/vllm_cpu.py"),
    (
        "VLLMGeneration.sync_weights",
        "self._iter_named_params()",
        "every sync path reads the weights from _iter_named_params (patched to freeze the sampler's weights)",
        "benchmarks/canary_rewards.py",
    ),
    (
        "VLLMGeneration.sync_weights",
        'if self.mode == "colocate" and self.enable_sleep_mode: empty_cache() '
        "# required to avoid OOM in some cases "
        'self.llm.wake_up(tags=["weights"]) self._llm_weights_sleeping = False',
        "a sync wakes a sleeping engine's weights (GEC's awake block syncs when they were discarded)",
        "sampling/gec.py",
    ),
    ("VLLMGeneration.__init__", "self.enable_sleep_mode = enable_sleep_mode", "sleep mode flag", "sampling/gec.py"),
    (
        "VLLMGeneration.__init__",
        "self.tensor_parallel_size = tensor_parallel_size",
        "the ranks of one tensor-parallel group share a sampling seed",
        "resume_state.py",
    ),
    ("VLLMGeneration.__init__", "self.max_completion_length = max_completion_length", "length limit", "gec.py"),
    (
        "VLLMGeneration._init_vllm",
        "self._llm_weights_sleeping = self.enable_sleep_mode",
        "whether the engine's weights were discarded",
        "sampling/gec.py",
    ),
    (
        "VLLMGeneration.generate",
        'if self.enable_sleep_mode: self.llm.wake_up(tags=["kv_cache"])',
        "generate wakes the engine only in sleep mode (GEC turns the flag off to keep it awake over a round)",
        "sampling/gec.py",
    ),
    (
        "VLLMGeneration.generate",
        "if self.enable_sleep_mode: self.llm.sleep(level=2) self._llm_weights_sleeping = True",
        "generate puts the engine to sleep only in sleep mode, discarding the weights (level 2)",
        "sampling/gec.py",
    ),
    (
        "VLLMGeneration.generate",
        'if self.mode == "colocate" and self.enable_sleep_mode and self._llm_weights_sleeping: self.sync_weights()',
        "discarded weights are pushed again before generating",
        "sampling/gec.py",
    ),
    (
        "VLLMGeneration.generate",
        "self.llm.generate(vllm_prompts, sampling_params=sampling_params, use_tqdm=False)",
        "one SamplingParams per call, passed to the engine's generate (wrapped to give each prompt its own seed)",
        "resume_state.py",
    ),
    (
        "GRPOTrainer.__init__",
        "self._last_loaded_step = -1",
        "the step whose weights vLLM holds",
        "sampling/gec.py",
    ),
    (
        "GRPOTrainer._generate_single_turn",
        "if self.state.global_step != self._last_loaded_step: with profiling_context(self, "
        '"sync_weights"): self.vllm_generation.sync_weights() self._last_loaded_step = self.state.global_step',
        "weights are synced once per step, keyed on _last_loaded_step (GEC's awake block sets it after its sync)",
        "sampling/gec.py",
    ),
    (
        "GRPOTrainer.__init__",
        "add_fused_lm_head( self.model.get_base_model() if is_peft_model(self.model) else self.model, "
        "temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32, "
        'outputs=("log_probs", "entropy"), )',
        "the policy gets TRL's fused LM head with entropies, at the sampling temperature",
        "old_logps.py",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        "self._pending_extra_logs.clear()",
        "what reward functions log is flushed after scoring (GEC puts one value per row back before that)",
        "sampling/gec.py",
    ),
    (
        "GRPOTrainer._generate_and_score_completions",
        "self._pending_metrics.clear()",
        "scalars reward functions log are flushed after scoring",
        "sampling/gec.py",
    ),
    (
        "GRPOTrainer._prepare_inputs",
        "if self._step % generate_every == 0 or self._buffered_inputs is None:",
        "a generation batch is generated at a multiple of _step or when no buffer is held (restored on resume)",
        "resume_state.py",
    ),
    (
        "GRPOTrainer._prepare_inputs",
        "generation_batch = shuffle_sequence_dict(generation_batch)",
        "the generation batch is shuffled through the module's shuffle_sequence_dict, then split (fused.py groups "
        "the shuffled rows by patching that name for the call)",
        "fused.py",
    ),
    (
        "GRPOTrainer.training_step",
        "self._step += 1",
        "GRPOTrainer.training_step counts micro-steps and step_time (fused.py does the same for a kept micro-batch)",
        "fused.py",
    ),
    (
        "GRPOTrainer._compute_loss",
        "old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps",
        "without old log-probs from scoring, the loss's forward is pi_old's (what loss_forward relies on)",
        "fused.py",
    ),
    (
        "GRPOTrainer._prepare_inputs",
        "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]",
        "steps train on slices of the buffered generation batch",
        "resume_state.py",
    ),
    (
        "GRPOTrainer.get_train_dataloader",
        "sampler_fn=self._get_train_sampler",
        "the training sampler comes from _get_train_sampler (ExactResumeMixin keeps it)",
        "resume_state.py",
    ),
    (
        "RepeatSampler.__iter__",
        "indexes = torch.randperm(self.num_samples, generator=self.generator).tolist()",
        "one permutation per epoch from the seeded generator (replayed for the epochs trained on resume)",
        "resume_state.py",
    ),
    ("RepeatSampler.__init__", "self.shuffle = shuffle", "read before replaying permutations", "resume_state.py"),
    (
        "Trainer._inner_training_loop",
        "epochs_trained, steps_trained_in_current_epoch = self._init_training_state(",
        "_init_training_state returns (epochs trained, steps trained in the epoch)",
        "resume_state.py",
    ),
    (
        "Trainer._run_epoch",
        "self._load_rng_state(resume_from_checkpoint)",
        "on resume the RNG states are restored just before the first step (where GRPO's state is restored too)",
        "resume_state.py",
    ),
    (
        "Trainer._inner_training_loop",
        "self._tr_loss = torch.tensor(0.0, device=args.device)",
        "the loss not yet logged, a tensor restored in place",
        "resume_state.py",
    ),
    (
        "Trainer._inner_training_loop",
        "self._globalstep_last_logged = self.state.global_step",
        "the step of the last log, saved and restored",
        "resume_state.py",
    ),
    (
        "Trainer._run_epoch",
        "self._maybe_log_save_evaluate( self._tr_loss,",
        "each step ends in _maybe_log_save_evaluate (the step-boundary snapshot)",
        "resume_state.py",
    ),
    (
        "Trainer._save_checkpoint",
        'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"',
        "the checkpoint folder, which ExactResumeMixin writes its state into",
        "resume_state.py",
    ),
    (
        "Trainer._save_checkpoint",
        "run_dir = self._get_output_dir(trial=trial)",
        "the checkpoint folder's parent",
        "resume_state.py",
    ),
    (
        "Trainer._inner_training_loop",
        "self.control = self.callback_handler.on_train_begin(args, self.state, self.control)",
        "training begins after the checkpoint is loaded and state.max_steps is this run's (the finished-run stop)",
        "resume_state.py",
    ),
    (
        "Trainer._inner_training_loop",
        ") = self.set_initial_training_values(args, train_dataloader)",
        "train() counts its steps from its own dataloader as trainer_last_step does, before anything is written",
        "script/resume.py",
    ),
    (
        "Trainer.set_initial_training_values",
        "steps_in_epoch, max_steps, )",
        "max_steps is the last of the values returned (trainer_last_step reads it)",
        "script/resume.py",
    ),
    (
        "Trainer._finalize_training",
        "deactivate_neftune(self.model, self.neftune_hook_handle, self.accelerator)",
        "the end of training removes NEFTune's hook (done alike when a finished run trains nothing)",
        "resume_state.py",
    ),
    (
        "Trainer._finalize_training",
        "self._memory_tracker.stop_and_update_metrics(metrics)",
        "the end of training closes the memory tracker's stage (done alike when a finished run trains nothing)",
        "resume_state.py",
    ),
    (
        "ProgressCallback.__init__",
        "self.training_bar = None",
        "the progress bar CompactProgressCallback sets its postfix on",
        "egpo_trl/script/callbacks.py",
    ),
]

# vLLM's own internals, checked only when vLLM is installed: (module, qualified name, parameter names it must take
# (None: it must exist), used by). The engine's attribute chains llm.llm_engine.model_executor.driver_worker
# .model_runner (tests/vllm_cpu.py) and llm.llm_engine.vllm_config.cache_config (trainer.py) exist only on a running
# engine and are not checked here (tests/test_vllm_cpu.py runs one).
VLLM = [
    ("vllm", "LLM.generate", ["prompts", "sampling_params"], "resume_state.py (per-prompt sampling seeds)"),
    ("vllm", "LLM.sleep", ["level"], "sampling/gec.py, benchmarks/timing_rewards.py (counted)"),
    ("vllm", "LLM.wake_up", ["tags"], "sampling/gec.py, benchmarks/timing_rewards.py (counted)"),
    ("vllm", "LLM.reset_prefix_cache", None, "tests/vllm_cpu.py (after a CPU weight reload)"),
    ("vllm", "SamplingParams.clone", None, "resume_state.py (one SamplingParams per prompt)"),
    ("vllm", "SamplingParams.seed", None, "resume_state.py"),
    (
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner.reload_weights",
        ["weights_iterator", "is_checkpoint_format"],
        "tests/vllm_cpu.py (cpu_sync_weights)",
    ),
    ("vllm.config", "CacheConfig.kv_cache_size_tokens", None, "trainer.py (vllm_kv_cache_tokens, the start-up line)"),
    ("vllm.platforms", "current_platform.is_cpu", None, "tests/vllm_cpu.py (is_vllm_cpu_build)"),
]

# What TRL's private methods return, checked by calling them on a real trainer: (method, what is expected).
RETURNS = [
    (
        "_generate",
        "an 8-tuple (prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images)",
    ),
    ("_generate_single_turn", "a pair (completion_ids, logprobs)"),
    ("_calculate_rewards", "a tensor [completions, reward functions]"),
    ("_get_per_token_logps_and_entropies", "a triple (logps, entropies, aux_loss)"),
    ("model(..., fused_lm_head=True)", "an output with log_probs and entropy, each [rows, columns]"),
    (
        "_generate_and_score_completions",
        "a dict with prompt_ids, prompt_mask, completion_ids, completion_mask and advantages",
    ),
]

# GRPOConfig's sampling fields, all of which egpo_trl.config.distribution_changing_sampling_options judges, and the
# importance-sampling modes its guard sorts into token and sequence level. A new field or mode must be judged there.
SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "generation_kwargs",
    "vllm_structured_outputs_regex",
}
# Fields whose names look like sampling options but are not: top_entropy_quantile selects tokens for the loss.
NOT_SAMPLING_FIELDS = {"top_entropy_quantile"}
IMPORTANCE_SAMPLING_MODES = {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}


def _parameters(func) -> list[str]:
    names = list(inspect.signature(func).parameters)
    return names[1:] if names and names[0] == "self" else names


def _squeezed(text: str) -> str:
    """``text`` with every run of whitespace made one space (source texts are matched across line breaks)."""
    return " ".join(text.split())


def _static_problems() -> list[str]:
    from transformers import Trainer
    from transformers.trainer_callback import ProgressCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.utils import RepeatSampler

    from egpo_trl.old_logps import FORWARD_KEYS

    problems = []
    for module_name, name, expected, used_by in FUNCTIONS:
        try:
            func = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as error:
            problems.append(f"{module_name}.{name} is gone ({error}); used by {used_by}")
            continue
        found = _parameters(func)
        if found[: len(expected)] != expected:
            problems.append(f"{module_name}.{name}: parameters {found}, expected to start with {expected} ({used_by})")
    for module_name, name, expected, used_by in CONSTANTS:
        value = getattr(importlib.import_module(module_name), name, None)
        if value != expected:
            problems.append(f"{module_name}.{name} is {value!r}, expected {expected!r} ({used_by})")
    for name, expected, used_by in METHODS:
        method = getattr(GRPOTrainer, name, None)
        if not callable(method):
            problems.append(f"GRPOTrainer.{name} is gone; used by {used_by}")
            continue
        found = _parameters(method)
        if found[: len(expected)] != expected:
            problems.append(f"GRPOTrainer.{name}: parameters {found}, expected to start with {expected} ({used_by})")
    logps_parameters = _parameters(GRPOTrainer._get_per_token_logps_and_entropies)
    missing = [key for key in FORWARD_KEYS if key not in logps_parameters]
    if missing:
        problems.append(
            f"GRPOTrainer._get_per_token_logps_and_entropies no longer takes {missing} (old_logps.py's FORWARD_KEYS)"
        )
    from egpo_trl import EGPOTrainer

    ours = {
        name
        for cls in EGPOTrainer.__mro__
        if cls.__module__.startswith("egpo_trl")
        for name in vars(cls)
        if name == "__init__" or not (name.startswith("__") and name.endswith("__"))
    }
    shared = {name for name in ours if hasattr(GRPOTrainer, name)}
    if shared != OVERRIDES:
        unexpected, gone = sorted(shared - OVERRIDES), sorted(OVERRIDES - shared)
        problems.append(
            f"EGPOTrainer and GRPOTrainer now share {sorted(shared)}: unexpected {unexpected} (rename egpo_trl's, or "
            f"make it a deliberate override), no longer in TRL {gone}"
        )
    owners = {
        "GRPOTrainer": GRPOTrainer,
        "VLLMGeneration": VLLMGeneration,
        "Trainer": Trainer,
        "RepeatSampler": RepeatSampler,
        "ProgressCallback": ProgressCallback,
    }
    for path, text, why, used_by in SOURCE:
        owner, _, attribute = path.partition(".")
        member = getattr(owners[owner], attribute, None)
        if member is None:
            problems.append(f"{path} is gone ({why}); used by {used_by}")
        elif text and _squeezed(text) not in _squeezed(inspect.getsource(member)):
            problems.append(f"{path} no longer contains {text!r}: {why} ({used_by})")
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    sampling = {
        name
        for name in fields
        if name in SAMPLING_FIELDS
        or any(part in name for part in ("top_", "min_p", "penalty", "structured", "logit_bias", "sampling_params"))
    } - NOT_SAMPLING_FIELDS
    if sampling != SAMPLING_FIELDS:
        problems.append(
            f"GRPOConfig's sampling fields are {sorted(sampling)}, expected {sorted(SAMPLING_FIELDS)}: judge the new "
            "ones in egpo_trl.config.distribution_changing_sampling_options"
        )
    mode_help = fields["vllm_importance_sampling_mode"].metadata.get("help", "")
    modes = {mode for mode in IMPORTANCE_SAMPLING_MODES if f"'{mode}'" in mode_help}
    if modes != IMPORTANCE_SAMPLING_MODES or mode_help.count("'") != 2 * len(IMPORTANCE_SAMPLING_MODES):
        problems.append(
            f"GRPOConfig.vllm_importance_sampling_mode's values changed (help: {mode_help!r}): sort them into "
            "egpo_trl.config.SEQUENCE_IMPORTANCE_SAMPLING_MODES or the token-level ones"
        )
    return problems


def _instance_problems(trainer) -> list[str]:
    from egpo_trl.correctness import reward_func_names

    problems = []
    for name, check, expected, used_by in INSTANCE_ATTRIBUTES:
        if not hasattr(trainer, name):
            problems.append(f"GRPOTrainer instances have no {name} ({used_by})")
        elif not check(getattr(trainer, name)):
            problems.append(f"GRPOTrainer.{name} is {getattr(trainer, name)!r}, expected {expected} ({used_by})")
    if reward_func_names(trainer.reward_funcs) != trainer.reward_func_names:
        problems.append(
            f"GRPOTrainer names its reward functions {trainer.reward_func_names}, egpo_trl.correctness names them "
            f"{reward_func_names(trainer.reward_funcs)}"
        )

    # One generation batch through TRL's own methods, checking what each returns.
    returns = dict(RETURNS)
    inputs = [row for row in make_prompt_dataset(2) for _ in range(trainer.num_generations)]
    prompts = [row["prompt"] for row in inputs]
    trainer.model.train()
    generated = trainer._generate(prompts)
    if not (isinstance(generated, tuple) and len(generated) == 8):
        problems.append(f"GRPOTrainer._generate returned {type(generated).__name__}, expected {returns['_generate']}")
        return problems
    prompt_ids, completion_ids, _, completions, *_ = generated
    single = trainer._generate_single_turn(prompt_ids[:1], None, {}, 1)
    if not (isinstance(single, tuple) and len(single) == 2 and len(single[0]) == 1):
        problems.append(
            f"GRPOTrainer._generate_single_turn returned {single!r}, expected {returns['_generate_single_turn']}"
        )
    rewards = trainer._calculate_rewards(inputs, prompts, completions, completion_ids)
    if not (isinstance(rewards, torch.Tensor) and tuple(rewards.shape) == (len(inputs), len(trainer.reward_funcs))):
        problems.append(
            f"GRPOTrainer._calculate_rewards returned {rewards!r}, expected {returns['_calculate_rewards']}"
        )
    output = trainer._generate_and_score_completions(inputs)
    expected_keys = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"}
    if not (isinstance(output, dict) and expected_keys <= set(output)):
        problems.append(
            f"GRPOTrainer._generate_and_score_completions returned keys {sorted(output)}, expected "
            f"{returns['_generate_and_score_completions']}"
        )
        return problems
    with torch.no_grad():
        result = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
            torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
            output["completion_ids"].size(1),
            batch_size=4,
            compute_entropy=True,
        )
    if not (isinstance(result, tuple) and len(result) == 3 and result[0].shape == output["completion_ids"].shape):
        problems.append(
            f"GRPOTrainer._get_per_token_logps_and_entropies returned {type(result).__name__} of "
            f"{len(result) if isinstance(result, tuple) else '?'}, expected "
            f"{returns['_get_per_token_logps_and_entropies']}"
        )

    # TRL's fused LM head, called as egpo_trl.old_logps calls it.
    input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : output["prompt_ids"].size(1)] = -100
    with torch.no_grad():
        fused = trainer.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    shapes = [getattr(getattr(fused, key, None), "shape", None) for key in ("log_probs", "entropy")]
    if any(shape is None or tuple(shape[:1]) != (input_ids.size(0),) for shape in shapes):
        problems.append(
            f"the policy's forward with fused_lm_head=True returned {type(fused).__name__} with log_probs/entropy "
            f"shapes {shapes}, expected {returns['model(..., fused_lm_head=True)']} (old_logps.py)"
        )
    return problems


def test_every_trl_internal_egpo_trl_relies_on_is_there(tmp_path, tiny_model_dir):
    from trl import GRPOConfig, GRPOTrainer

    problems = _static_problems()
    trainer = GRPOTrainer(
        tiny_model_dir, parity_reward, config(tmp_path, GRPOConfig), train_dataset=make_prompt_dataset()
    )
    problems += _instance_problems(trainer)
    if problems:
        import trl

        pytest.fail(
            f"TRL {trl.__version__} changed {len(problems)} of the internals egpo_trl relies on (tests/"
            "test_trl_surface.py lists them all):\n  - " + "\n  - ".join(problems),
            pytrace=False,
        )


@pytest.mark.vllm
def test_every_vllm_internal_egpo_trl_relies_on_is_there():
    pytest.importorskip("vllm", reason="vLLM is not installed: its internals are checked where it is")
    problems = []
    for module_name, path, expected, used_by in VLLM:
        try:
            member = importlib.import_module(module_name)
            for part in path.split("."):
                member = getattr(member, part) if hasattr(member, part) else member.__dataclass_fields__[part]
        except (ImportError, AttributeError, KeyError, TypeError) as error:
            problems.append(f"{module_name}.{path} is gone ({error!r}); used by {used_by}")
            continue
        if expected is not None:
            missing = [name for name in expected if name not in _parameters(member)]
            if missing:
                problems.append(f"{module_name}.{path} no longer takes {missing} ({used_by})")
    if problems:
        import vllm

        pytest.fail(
            f"vLLM {vllm.__version__} changed {len(problems)} of the internals egpo_trl relies on (VLLM in tests/"
            "test_trl_surface.py):\n  - " + "\n  - ".join(problems),
            pytrace=False,
        )
