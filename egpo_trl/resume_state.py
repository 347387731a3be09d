"""Exact resume: GRPO's state beyond the Trainer's checkpoint, a Ctrl-C checkpoint, and per-prompt vLLM seeds."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import signal
import threading
from typing import Any

import numpy as np
import torch
from accelerate.utils import send_to_device
from transformers.trainer import deactivate_neftune
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

logger = logging.getLogger(__name__)

__all__ = ["RESUME_STATE_NAME", "ExactResumeMixin", "generation_seed"]

# ``_<process index>`` before ``.pt`` with several processes.
RESUME_STATE_NAME = "egpo_resume_state.pt"
_COUNTERS = ("_step", "_globalstep_last_logged", "_gec_calls")
# With the process count, the layout of the saved buffer and micro-step counter.
_LAYOUT_ARGS = ("per_device_train_batch_size", "steps_per_generation", "num_iterations", "gradient_accumulation_steps")
# With every field named _BATCH_PREFIXES* (but _OPERATIONAL), what the saved generation batch was made with.
_BATCH_ARGS = (
    "num_generations", "advantage_estimator", "scale_rewards", "multi_objective_aggregation",
    "nsr_positive_weight", "edge_grpo_entropy_normalization", "overlong_buffer_length", "overlong_penalty_factor",
    "beta", "temperature", "mask_truncated_completions", "use_vllm", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
    "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs",
)  # fmt: skip
_BATCH_PREFIXES = ("egpo_", "dynamic_sampling", "edge_gec")
# Fields of those that change speed, memory or what is logged, not the batch.
_OPERATIONAL = {"egpo_entropy_metrics", "egpo_shift_prompt_padding"}


class _FinishedRun(Exception):
    pass


class _StopWhenFinished(TrainerCallback):
    """Ends ``Trainer.train`` at ``on_train_begin`` when the resumed run has nothing left to train."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            raise _FinishedRun


class _SigintHold:
    """Holds a Ctrl-C back from :meth:`start` to :meth:`stop` in the main thread; a second one interrupts at once."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.active, self.forced = enabled, False, False
        self._previous, self._received = None, False

    def start(self) -> None:
        if not self.enabled or self.active or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return

        def handler(signum, frame):
            if self._received:
                self.forced = True
                raise KeyboardInterrupt
            self._received = True
            os.write(2, b"\nCtrl-C: finishing this step first (Ctrl-C again stops at once, without a checkpoint)\n")

        self._received = False
        self._previous, self.active = signal.signal(signal.SIGINT, handler), True

    def stop(self, raise_held: bool = True) -> None:
        """Puts the previous handler back; raises a held ``KeyboardInterrupt`` (unless ``raise_held`` is false)."""
        if not self.active:
            return
        signal.signal(signal.SIGINT, self._previous)
        received, self._received, self.active = self._received, False, False
        if received and raise_held:
            raise KeyboardInterrupt


def generation_seed(seed: int, global_step: int, call: int, instance: int, index: int) -> int:
    """The sampling seed of prompt ``index`` of generation ``call`` of vLLM ``instance``, from its place in the run."""
    key = f"egpo-generation:{seed}:{global_step}:{call}:{instance}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


class ExactResumeMixin:
    """Exact-resume checkpoints, a Ctrl-C checkpoint at the last step boundary and per-prompt vLLM seeds."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._egpo_boundary: dict[str, Any] | None = None
        self._egpo_train_sampler = None
        self._egpo_generation_calls: tuple[tuple[int, bool], int] = ((-1, True), 0)
        self._egpo_sigint = _SigintHold(enabled=self.args.world_size == 1)
        self._egpo_seed_vllm_sampling()

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; resumed at the run's last step it loads the checkpoint and ends without a step."""
        stop, self._egpo_sigint.forced = _StopWhenFinished(), False
        if resume_from_checkpoint:
            self.callback_handler.callbacks.insert(0, stop)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except _FinishedRun:
            pass
        finally:
            self._egpo_sigint.stop(raise_held=False)  # an error inside a held span: the handler must not outlive it
            if stop in self.callback_handler.callbacks:
                self.callback_handler.callbacks.remove(stop)
        state, args = self.state, self.args
        if args.max_steps > 0:
            setting, fix = f"max_steps={args.max_steps}", "max_steps"
        else:
            setting = f"num_train_epochs={args.num_train_epochs:g} over this run's data and batch sizes"
            fix = "num_train_epochs (or set max_steps)"
        logger.warning(
            f"Nothing to train: the checkpoint is at step {state.global_step} and this run stops at step "
            f"{state.max_steps} ({setting}); raise {fix} to train further."
        )
        # Trainer's end of a run, less its logs, callbacks and checkpoint deletions.
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._load_best_model()
        self._memory_tracker.stop_and_update_metrics({})
        if self.neftune_noise_alpha is not None:
            deactivate_neftune(self.model, self.neftune_hook_handle, self.accelerator)
        self.is_in_train = False
        return TrainOutput(state.global_step, 0.0, {})

    def _egpo_resume_state(self, cpu: bool = True) -> dict[str, Any]:
        """GRPO's state between steps (on the CPU, or as it is)."""
        move = (lambda x: send_to_device(x, "cpu")) if cpu else (lambda x: x)
        state: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS if hasattr(self, name)}
        buffered = getattr(self, "_buffered_inputs", None)
        tr_loss = getattr(self, "_tr_loss", None)
        return {
            **state,
            "buffered_inputs": move(buffered) if buffered is not None else None,
            "metrics_train": {key: list(values) for key, values in self._metrics["train"].items()},
            "tr_loss": move(tr_loss.detach().clone()) if isinstance(tr_loss, torch.Tensor) else None,
            "layout": self._egpo_batch_layout(),
        }

    def _egpo_batch_layout(self) -> dict[str, Any]:
        """The process count, batch shape and settings the saved state belongs to."""
        args = self.args
        named = sorted(name for name in vars(args) if name.startswith(_BATCH_PREFIXES) and name not in _OPERATIONAL)
        return {
            "world_size": int(args.world_size),
            "process_index": int(args.process_index),
            **{name: int(getattr(args, name)) for name in _LAYOUT_ARGS},
            **{name: getattr(args, name, None) for name in (*_BATCH_ARGS, *named)},
            "reward_weights": self.reward_weights.tolist(),  # the weights in use (unset: 1.0 per function)
        }

    def _egpo_restore_resume_state(self, state: dict[str, Any]) -> None:
        for name in _COUNTERS:
            if name in state:
                setattr(self, name, state[name])
        buffered = state.get("buffered_inputs")
        self._buffered_inputs = send_to_device(buffered, self.accelerator.device) if buffered is not None else None
        self._metrics["train"].clear()
        for key, values in state.get("metrics_train", {}).items():
            self._metrics["train"][key].extend(values)
        tr_loss = state.get("tr_loss")
        if tr_loss is not None and isinstance(getattr(self, "_tr_loss", None), torch.Tensor):
            self._tr_loss.copy_(tr_loss.to(self._tr_loss.device))

    def _egpo_state_file(self, checkpoint: str) -> str:
        suffix = f"_{self.args.process_index}.pt" if self.args.world_size > 1 else ".pt"
        return os.path.join(checkpoint, RESUME_STATE_NAME.replace(".pt", suffix))

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not self.args.save_only_model:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            os.makedirs(folder, exist_ok=True)
            torch.save(self._egpo_resume_state(), self._egpo_state_file(folder))

    def _load_rng_state(self, checkpoint):
        # Trainer calls this once on resume, after fetching the first batch and just before the first step.
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = self._egpo_state_file(checkpoint)
        state = torch.load(path, weights_only=True) if os.path.isfile(path) else None
        if state is None:
            others = sorted(
                n
                for n in os.listdir(checkpoint)
                if n.startswith(RESUME_STATE_NAME[: -len(".pt")]) and n.endswith(".pt")
            )
            held = f"it holds {', '.join(others)} but not" if others else "it has no"
            mismatch = f"{held} {os.path.basename(path)} (saved by another trainer, version or process count)"
        else:
            saved, current = state.get("layout") or {}, self._egpo_batch_layout()
            differ = [f"{k}={saved.get(k)} (now {v})" for k, v in current.items() if saved.get(k) != v]
            mismatch = "it was saved with " + ", ".join(differ) if differ else None
            if not current.keys() <= saved.keys():
                mismatch = "its saved state does not record the batch layout and settings (an older version)"
        if self.args.world_size > 1:
            # Every process must decide alike, or their collective calls would mismatch.
            flags = self.accelerator.gather(torch.tensor([int(mismatch is None)], device=self.accelerator.device))
            if mismatch is None and int(flags.min()) == 0:
                mismatch = "another process cannot restore its own saved state"
        if mismatch is None:
            self._egpo_restore_resume_state(state)
            return
        logger.warning(
            "%s cannot be resumed exactly: %s. Its GRPO state (the generation batch in progress, the micro-step "
            "counter and the metrics not yet logged) is ignored on every process; the weights, optimizer and "
            "schedule are restored, and the run generates a new batch at its first step.",
            checkpoint,
            mismatch,
        )

    def _get_train_sampler(self, *args: Any, **kwargs: Any):
        self._egpo_train_sampler = super()._get_train_sampler(*args, **kwargs)
        return self._egpo_train_sampler

    def _init_training_state(self, *args: Any, **kwargs: Any):
        epochs_trained, steps_in_epoch = super()._init_training_state(*args, **kwargs)
        # The sampler draws one permutation per epoch: draw those of the epochs already trained.
        sampler = self._egpo_train_sampler
        if epochs_trained > 0 and getattr(sampler, "shuffle", False) and hasattr(sampler, "generator"):
            for _ in range(epochs_trained):
                torch.randperm(sampler.num_samples, generator=sampler.generator)
        return epochs_trained, steps_in_epoch

    def _prepare_inputs(self, *args: Any, **kwargs: Any):
        inputs = super()._prepare_inputs(*args, **kwargs)
        # The step's last micro-batch, its generation done: hold Ctrl-C back to the step's end (DeepSpeed updates
        # inside this micro-batch's backward).
        if self.model.training and self.accelerator.sync_gradients:
            self._egpo_sigint.start()
        return inputs

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any):
        self._egpo_sigint.start()
        try:
            super()._maybe_log_save_evaluate(*args, **kwargs)
            cuda_rng = (
                torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
            )
            self._egpo_boundary = {
                "global_step": self.state.global_step,
                "updates": self._egpo_updates(),
                "rng": (random.getstate(), np.random.get_state(), torch.random.get_rng_state(), cuda_rng),
                "num_input_tokens_seen": self.state.num_input_tokens_seen,  # GRPO counts them mid-step
                "resume_state": self._egpo_resume_state(cpu=False),
            }
        except BaseException:
            self._egpo_sigint.stop(raise_held=False)
            raise
        self._egpo_sigint.stop()

    def _egpo_updates(self) -> tuple[int | None, int | None]:
        """The optimizer's step count (its first parameter's) and the DeepSpeed engine's (``None``: unknown)."""
        try:  # DeepSpeed's optimizer keeps no per-parameter state
            steps = next((int(s["step"]) for s in self.optimizer.state.values() if s.get("step") is not None), None)
        except Exception:  # noqa: BLE001
            steps = None
        engine = (
            getattr(self.model_wrapped, "global_steps", None) if getattr(self, "is_deepspeed_enabled", False) else None
        )
        return steps, int(engine) if engine is not None else None

    def save_interrupt_checkpoint(self) -> str | None:
        """After an interruption inside a step, save the last finished step; returns why not, or ``None``."""
        boundary, step = self._egpo_boundary, self.state.global_step
        if boundary is None or boundary["global_step"] != step:
            return f"the state at the end of step {step} was not recorded"
        if self._egpo_sigint.forced:
            return f"a second Ctrl-C stopped step {step + 1} before it had finished"
        if boundary["updates"] != self._egpo_updates():
            return "the interruption came during an optimizer update"
        python, numpy_state, cpu, cuda = boundary["rng"]
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.random.set_rng_state_all(cuda)
        self.state.num_input_tokens_seen = boundary["num_input_tokens_seen"]
        self._egpo_restore_resume_state(boundary["resume_state"])
        self._save_checkpoint(self.model, trial=None)
        return None

    def _egpo_seed_vllm_sampling(self) -> None:
        """Seed each prompt of a colocated vLLM generation with :func:`generation_seed` (unless one is given)."""
        generation = getattr(self, "vllm_generation", None)
        llm = getattr(generation, "llm", None)
        if not getattr(self, "use_vllm", False) or llm is None or getattr(generation, "mode", None) != "colocate":
            return
        if (self.args.generation_kwargs or {}).get("seed") is not None:  # the sampling seed given
            return
        generate = llm.generate
        instance = self.accelerator.process_index // max(1, getattr(generation, "tensor_parallel_size", 1))

        def seeded_generate(prompts, sampling_params=None, *args: Any, **kwargs: Any):
            if (
                sampling_params is None
                or isinstance(sampling_params, (list, tuple))
                or sampling_params.seed is not None
            ):
                return generate(prompts, sampling_params, *args, **kwargs)
            # This generation call's number within the step and mode (evaluation: -1 - n).
            key = (self.state.global_step, bool(self.model.training))
            last_key, count = self._egpo_generation_calls
            count = count + 1 if key == last_key else 0
            self._egpo_generation_calls = (key, count)
            call = count if key[1] else -1 - count
            params = [sampling_params.clone() for _ in prompts]
            for index, param in enumerate(params):
                param.seed = generation_seed(self.args.seed, key[0], call, instance, index)
            return generate(prompts, params, *args, **kwargs)

        llm.generate = seeded_generate
