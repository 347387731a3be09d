"""Exact resume: what a checkpoint must hold beyond the Trainer's own for a resumed run to continue the same run.

``Trainer`` saves the weights, the optimizer, the scheduler, the RNG states and ``trainer_state.json``. GRPO keeps
more state between steps, which a resumed ``GRPOTrainer`` loses:

* the generation-batch buffer (``_buffered_inputs``) and the micro-step counter (``_step``): with
  ``steps_per_generation > gradient_accumulation_steps`` or ``num_iterations > 1`` a step can fall inside a
  generation batch, and a resumed run would generate a new batch there instead of training on the stored one;
* the metrics accumulated since the last log (``_metrics``) and the loss not yet logged (``logging_steps > 1``);
* the per-round counter of Guided Error Correction's draws;
* the prompt order of later epochs (the training sampler's generator has drawn one permutation per epoch).

:class:`ExactResumeMixin` saves these into every checkpoint (``egpo_resume_state.pt``, one per process) and
restores them where ``Trainer`` restores the RNG states, just before the first step after the resume. The state
records the process count and batch shape it was saved with (``per_device_train_batch_size``,
``steps_per_generation``, ``num_iterations``, ``gradient_accumulation_steps``) and the settings its generation batch
was made with (its groups, rewards and advantages, and the log-probs it holds: ``num_generations``, the advantage
estimator and every ``egpo_*`` option, ``scale_rewards``, ``reward_weights``, ...); a resume with other values, or
with another number of processes, ignores it on every process (with a warning that names them: that resume is not
exact, and its first step generates a new batch with the new settings).

A Ctrl-C arrives in the middle of a step, after that step's generation has consumed random numbers. The mixin keeps
a snapshot of the state at the end of the last finished step (RNG states included), and
:meth:`ExactResumeMixin.save_interrupt_checkpoint` writes the checkpoint from it, so that it is the checkpoint a
regular save at that step would have written. A Ctrl-C from the last micro-batch of a step (once its generation is
done; DeepSpeed applies the update inside that micro-batch's backward) to the end of the step's logging, evaluation
and saving is held back until that work is done, so the interruption never lands in a half-applied update (whose
checkpoint could not be saved) and the step it completes is the one saved. With several processes, where an
interruption saves nothing, Ctrl-C is not held back.

With vLLM colocate, each prompt's sampling gets its own seed, :func:`generation_seed` of (``seed``, global step,
generation call in the step, vLLM instance, prompt), so that the completions after a resume are those of the
uninterrupted run (up to the GPU kernels' own nondeterminism); vLLM's random state then needs no checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import threading
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["RESUME_STATE_NAME", "ExactResumeMixin", "finished_run_step", "generation_seed", "seeded_sampling_params"]

#: The file (``_<process index>`` before ``.pt`` with several processes) that holds GRPO's state in a checkpoint.
RESUME_STATE_NAME = "egpo_resume_state.pt"
# Attributes restored as they were (plain numbers).
_COUNTERS = ("_step", "_globalstep_last_logged", "_gec_calls")
# The arguments that, with the process count, fix the layout of the saved generation buffer and micro-step counter.
_LAYOUT_ARGS = ("per_device_train_batch_size", "steps_per_generation", "num_iterations", "gradient_accumulation_steps")
# The arguments, with every egpo_* one, that the saved generation batch was made with: its groups, its rewards and
# advantages, and which log-probs it holds (the reference model's, vLLM's importance-sampling ratios).
_BATCH_ARGS = (
    "num_generations", "advantage_estimator", "scale_rewards", "reward_weights", "multi_objective_aggregation",
    "nsr_positive_weight", "edge_grpo_entropy_normalization", "overlong_buffer_length", "overlong_penalty_factor",
    "beta", "use_vllm", "vllm_importance_sampling_correction",
)  # fmt: skip


def finished_run_step(args: Any, checkpoint: str | os.PathLike | None) -> tuple[int, int, str] | None:
    """``(step, last step, setting)`` when resuming from ``checkpoint`` would train nothing, else ``None``.

    A check before anything loads (the command's): with ``max_steps`` set, the run is finished when the checkpoint's
    step reaches it. A run sized by ``num_train_epochs`` is not judged here: its number of steps depends on this
    run's data and batch sizes, which the command counts once the trainer is built
    (:func:`egpo_trl.script.resume.trainer_last_step`), and the trainer itself once the checkpoint has loaded (see
    :meth:`ExactResumeMixin.train`). Nothing is loaded.
    """
    if not checkpoint or args.max_steps <= 0:
        return None
    path = os.path.join(os.fspath(checkpoint), "trainer_state.json")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        state = json.load(handle)
    step = int(state.get("global_step", 0))
    total = int(args.max_steps)
    return (step, total, f"max_steps={args.max_steps}") if step >= total else None


class _FinishedRun(Exception):
    """Raised by :class:`_StopWhenFinished` when the checkpoint loaded is at the run's last step."""


class _StopWhenFinished(TrainerCallback):
    """Ends ``Trainer.train`` when training begins, where the checkpoint loaded is at the run's last step.

    At ``on_train_begin`` ``Trainer`` has loaded the checkpoint (weights, optimizer, schedule, ``TrainerState``) and
    set ``state.max_steps`` to this run's own number of steps (``max_steps``, or ``num_train_epochs`` over this
    run's data and batch sizes): a resumed run whose step has reached it has nothing to train.
    """

    def __init__(self, always: bool = False):
        self.always = always  # stop whatever the step (the command writing a finished run's missing outputs)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.always or (state.max_steps > 0 and state.global_step >= state.max_steps):
            raise _FinishedRun


class _SigintHold:
    """Holds a Ctrl-C back from :meth:`start` to :meth:`stop` (a second one interrupts at once).

    Main thread only, and only where Python's own Ctrl-C handler is in place: a process that ignores SIGINT (a
    background job), or has a handler of its own, is left as it is. ``enabled=False`` (several processes, where an
    interruption saves no checkpoint) makes it do nothing. ``forced`` tells that a second Ctrl-C stopped a held span
    (its step may be half applied); ``pending``, that one held when an error ended a span is still to be acted on.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.active = False
        self.forced = False
        self.pending = False
        self._previous: Any = None
        self._received = False

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
        try:
            previous = signal.signal(signal.SIGINT, handler)
        except (ValueError, OSError):  # not settable here: leave Ctrl-C as it is
            return
        self._previous, self.active = previous, True

    def stop(self, raise_held: bool = True) -> None:
        """Puts the previous handler back; raises the held ``KeyboardInterrupt``, or with ``raise_held`` false (an
        error is on its way) keeps it ``pending``."""
        if not self.active:
            return
        signal.signal(signal.SIGINT, self._previous)
        received, self._received, self.active = self._received, False, False
        if received and raise_held:
            raise KeyboardInterrupt
        self.pending = self.pending or received


def generation_seed(seed: int, global_step: int, call: int, instance: int, index: int) -> int:
    """The sampling seed of one prompt of one vLLM generation call, a function of where it falls in the run only.

    Args:
        seed: the run's ``seed``.
        global_step: the optimizer steps finished when the generation runs (generation for step ``N + 1`` runs at
            ``global_step = N``).
        call: the number of the generation call within that step and mode (dynamic sampling's rounds and Guided
            Error Correction's continuations generate several times in one step); evaluation calls are numbered
            apart from training ones (``call`` is then ``-1 - n``).
        instance: which vLLM instance generates (the process index divided by the tensor-parallel size: the ranks
            of one tensor-parallel group must draw alike).
        index: the prompt's position in the instance's request list.

    Returns:
        An integer in ``[0, 2**63)``; distinct arguments give independent seeds.
    """
    key = f"egpo-generation:{seed}:{global_step}:{call}:{instance}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def _rng_states() -> dict[str, Any]:
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])


def _to(value: Any, device: torch.device | str) -> Any:
    """``value`` (nested lists, tuples and dicts of tensors) with every tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(item, device) for item in value)
    return value


def _optimizer_steps(optimizer) -> int | None:
    """How many steps the optimizer has taken (the first parameter's ``step`` state), or ``None`` when unknown."""
    try:
        for state in optimizer.state.values():
            step = state.get("step")
            if step is not None:
                return int(step)
    except Exception:  # noqa: BLE001 - an optimizer without per-parameter state (DeepSpeed's) is simply unknown
        return None
    return None


def seeded_sampling_params(sampling_params: Any, count: int, seed: int, global_step: int, call: int, instance: int):
    """``count`` copies of vLLM ``sampling_params``, the ``index``-th seeded with :func:`generation_seed` (``seed``,
    ``global_step``, ``call``, ``instance``, ``index``): one per prompt of a generation call."""
    params = []
    for index in range(count):
        one = sampling_params.clone()
        one.seed = generation_seed(seed, global_step, call, instance, index)
        params.append(one)
    return params


class ExactResumeMixin:
    """Trainer mixin: checkpoints that resume bit for bit, a Ctrl-C checkpoint at the last step boundary, and
    per-prompt vLLM sampling seeds. Meant to sit before ``GRPOTrainer`` in the bases of a ``GRPOTrainer`` subclass.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._egpo_boundary: dict[str, Any] | None = None
        self._egpo_train_sampler = None
        self._egpo_generation_calls: tuple[tuple[int, bool], int] = ((-1, True), 0)
        self._egpo_sigint = _SigintHold(enabled=self.args.world_size == 1)
        self._egpo_seed_vllm_sampling()

    # ------------------------------------------------------------------ a finished run
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; resumed at the run's last step it trains nothing.

        ``Trainer`` would train (and save) one step more in some such cases (a fractional ``num_train_epochs``, a
        ``max_steps`` reached). Here a resumed run whose checkpoint is at this run's last step (``Trainer``'s own
        count: ``max_steps``, or ``num_train_epochs`` over this run's data and batch sizes) loads the checkpoint,
        says so, ends as a finished run does (the best checkpoint with ``load_best_model_at_end``, NEFTune's hook
        removed) and returns without a step; nothing is logged or written. ``egpo_trained_nothing`` tells which
        happened. With ``egpo_load_only`` set (the command writing a finished run's missing outputs) it returns so
        after loading the checkpoint, whatever its step.
        """
        try:
            return self._egpo_train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._egpo_sigint.stop(raise_held=False)  # an error inside a held span: the handler must not outlive it
            self._egpo_sigint.pending = False  # the error, or the interruption, ends the run

    def _egpo_train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        self.egpo_trained_nothing = False
        if not resume_from_checkpoint:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        load_only = getattr(self, "egpo_load_only", False)
        stop = _StopWhenFinished(always=load_only)
        self.callback_handler.callbacks.insert(0, stop)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except _FinishedRun:
            pass
        finally:
            self.callback_handler.callbacks.remove(stop)
        state = self.state
        if not load_only:
            by_steps = self.args.max_steps > 0
            logger.warning(
                "Nothing to train: the checkpoint is at step %d and this run stops at step %d (%s). The checkpoint "
                "is loaded and no step runs; raise %s to train further.",
                state.global_step,
                state.max_steps,
                f"max_steps={self.args.max_steps}"
                if by_steps
                else f"num_train_epochs={self.args.num_train_epochs:g} over this run's data and batch sizes",
                "max_steps" if by_steps else "num_train_epochs (or set max_steps)",
            )
        # What Trainer does at the end of a run that trained, less its logs, callbacks and checkpoint deletions.
        if self.args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._load_best_model()
        self._memory_tracker.stop_and_update_metrics({})
        if self.neftune_noise_alpha is not None:
            from transformers.trainer import deactivate_neftune

            deactivate_neftune(self.model, self.neftune_hook_handle, self.accelerator)
        self.is_in_train = False
        self.egpo_trained_nothing = True
        from transformers.trainer_utils import TrainOutput

        return TrainOutput(state.global_step, 0.0, {})

    # ------------------------------------------------------------------ state
    def _egpo_resume_state(self) -> dict[str, Any]:
        """GRPO's state between steps, on the CPU."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _COUNTERS if hasattr(self, name)}
        state["buffered_inputs"] = _to(getattr(self, "_buffered_inputs", None), "cpu")
        state["metrics_train"] = {key: list(values) for key, values in self._metrics["train"].items()}
        tr_loss = getattr(self, "_tr_loss", None)
        state["tr_loss"] = tr_loss.detach().clone().cpu() if isinstance(tr_loss, torch.Tensor) else None
        state["layout"] = self._egpo_batch_layout()
        return state

    def _egpo_batch_layout(self) -> dict[str, Any]:
        """The process count, batch shape and settings that the saved generation buffer and micro-step counter belong
        to."""
        args = self.args
        settings = [*_BATCH_ARGS, *sorted(name for name in vars(args) if name.startswith("egpo_"))]
        return {
            "world_size": int(args.world_size),
            "process_index": int(args.process_index),
            **{name: int(getattr(args, name)) for name in _LAYOUT_ARGS},
            **{name: getattr(args, name, None) for name in settings},
        }

    def _egpo_layout_mismatch(self, checkpoint: str, state: dict[str, Any] | None) -> str | None:
        """Why this process cannot restore ``state`` (its own file in ``checkpoint``, ``None`` when absent), or
        ``None`` when it can."""
        if state is None:
            others = sorted(
                name
                for name in os.listdir(checkpoint)
                if name.startswith(RESUME_STATE_NAME[: -len(".pt")]) and name.endswith(".pt")
            )
            if others:
                return f"it holds {', '.join(others)} but not {os.path.basename(self._egpo_state_file(checkpoint))}"
            return None  # no state at all: reported as such
        saved = state.get("layout")
        current = self._egpo_batch_layout()
        if saved is None or not current.keys() <= saved.keys():
            return "its saved state does not record the process count, batch shape and settings (an older version)"
        differ = [f"{key}={saved.get(key)} (now {value})" for key, value in current.items() if saved.get(key) != value]
        if differ:
            return "it was saved with " + ", ".join(differ)
        return None

    def _egpo_restore_resume_state(self, state: dict[str, Any]) -> None:
        for name in _COUNTERS:
            if name in state:
                setattr(self, name, state[name])
        buffered = state.get("buffered_inputs")
        self._buffered_inputs = _to(buffered, self.accelerator.device) if buffered is not None else None
        self._metrics["train"].clear()
        for key, values in state.get("metrics_train", {}).items():
            self._metrics["train"][key].extend(values)
        tr_loss = state.get("tr_loss")
        if tr_loss is not None and isinstance(getattr(self, "_tr_loss", None), torch.Tensor):
            self._tr_loss.copy_(tr_loss.to(self._tr_loss.device))

    def _egpo_state_file(self, checkpoint: str) -> str:
        if self.args.world_size > 1:
            name = RESUME_STATE_NAME.replace(".pt", f"_{self.args.process_index}.pt")
        else:
            name = RESUME_STATE_NAME
        return os.path.join(checkpoint, name)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.save_only_model:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self._egpo_resume_state(), self._egpo_state_file(folder))

    def _load_rng_state(self, checkpoint):
        # Trainer calls this once on resume, after fetching the first batch and just before the first step.
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = self._egpo_state_file(checkpoint)
        state = torch.load(path, weights_only=True) if os.path.isfile(path) else None
        mismatch = self._egpo_layout_mismatch(checkpoint, state)
        usable = state is not None and mismatch is None
        if self.args.world_size > 1:
            # Every process must decide alike: a process restoring a generation batch in progress while another
            # generates a new one would make their collective calls mismatch. Restore only where all of them can.
            flags = self.accelerator.gather(torch.tensor([1 if usable else 0], device=self.accelerator.device))
            if usable and int(flags.min()) == 0:
                usable, mismatch = False, "another process cannot restore its own saved state"
        if usable:
            self._egpo_restore_resume_state(state)
            return
        if mismatch is not None:
            logger.warning(
                "%s cannot be resumed exactly: %s. Its GRPO state (the generation batch in progress, the micro-step "
                "counter and the metrics not yet logged) is ignored on every process; the weights, optimizer and "
                "schedule are restored, and the run generates a new batch at its first step, so it does not "
                "continue exactly as it would have.",
                checkpoint,
                mismatch,
            )
        else:
            logger.warning(
                "%s has no %s (saved by another trainer or an older version): the run resumes, but not exactly as "
                "it would have continued (a generation batch in progress is generated again).",
                checkpoint,
                os.path.basename(path),
            )

    # ------------------------------------------------------------------ data order of later epochs
    def _get_train_sampler(self, *args: Any, **kwargs: Any):
        sampler = super()._get_train_sampler(*args, **kwargs)
        self._egpo_train_sampler = sampler
        return sampler

    def _init_training_state(self, *args: Any, **kwargs: Any):
        epochs_trained, steps_in_epoch = super()._init_training_state(*args, **kwargs)
        # The sampler draws one permutation per epoch from its seeded generator; a resumed run starts a fresh one,
        # so draw the permutations of the epochs already trained, as the uninterrupted run did.
        sampler = self._egpo_train_sampler
        if epochs_trained > 0 and getattr(sampler, "shuffle", False) and hasattr(sampler, "generator"):
            for _ in range(epochs_trained):
                torch.randperm(sampler.num_samples, generator=sampler.generator)
        return epochs_trained, steps_in_epoch

    # ------------------------------------------------------------------ step boundaries and Ctrl-C
    def _prepare_inputs(self, *args: Any, **kwargs: Any):
        inputs = super()._prepare_inputs(*args, **kwargs)
        # The last micro-batch of an optimizer step, its generation done: hold Ctrl-C back from here to the step's
        # end. Under DeepSpeed the update runs inside this micro-batch's backward, before the optimizer hooks.
        if self.model.training and self.accelerator.sync_gradients:
            self._egpo_sigint.start()
        return inputs

    def _inner_training_loop(self, *args: Any, **kwargs: Any):
        # auto_find_batch_size runs this again after an out-of-memory error, which may come inside a held span: a
        # Ctrl-C held there stops the run now, and none is held into the new attempt.
        hold = self._egpo_sigint
        hold.stop()
        if hold.pending:
            hold.pending = False
            raise KeyboardInterrupt
        hold.forced = False
        return super()._inner_training_loop(*args, **kwargs)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any):
        # Ctrl-C is held back from the step's last micro-batch (see _prepare_inputs) to here; at an epoch's end,
        # where no update precedes, only over this block.
        self._egpo_sigint.start()
        try:
            super()._maybe_log_save_evaluate(*args, **kwargs)
            tr_loss = getattr(self, "_tr_loss", None)
            self._egpo_boundary = {
                "global_step": self.state.global_step,
                "updates": self._egpo_updates(),
                "rng": _rng_states(),
                # GRPO counts a generation's tokens when it generates, in the middle of a step.
                "num_input_tokens_seen": self.state.num_input_tokens_seen,
                "resume_state": {
                    **{name: getattr(self, name) for name in _COUNTERS if hasattr(self, name)},
                    "buffered_inputs": getattr(self, "_buffered_inputs", None),
                    "metrics_train": {key: list(values) for key, values in self._metrics["train"].items()},
                    "tr_loss": tr_loss.detach().clone() if isinstance(tr_loss, torch.Tensor) else None,
                },
            }
        except BaseException:
            self._egpo_sigint.stop(raise_held=False)
            raise
        self._egpo_sigint.stop()

    def _egpo_updates(self) -> tuple[int | None, int | None]:
        """The updates applied so far: the optimizer's step count and the DeepSpeed engine's (``None`` if unknown)."""
        engine = self.model_wrapped if getattr(self, "is_deepspeed_enabled", False) else None
        engine_steps = getattr(engine, "global_steps", None)
        return _optimizer_steps(self.optimizer), int(engine_steps) if engine_steps is not None else None

    def save_interrupt_checkpoint(self) -> str | None:
        """Save the checkpoint of the last finished step after an interruption in the middle of the next one.

        The weights, optimizer and scheduler have not changed since that step; the RNG states, the generation
        buffer, the pending metrics and the count of tokens seen are put back to what they were at its end, so the
        checkpoint is the one a regular save at that step writes. Returns why nothing was saved, or ``None`` once
        saved.
        """
        boundary = self._egpo_boundary
        step = self.state.global_step
        if boundary is None or boundary["global_step"] != step:
            return f"the state at the end of step {step} was not recorded"
        if self._egpo_sigint.forced:
            return f"a second Ctrl-C stopped step {step + 1} before it had finished"
        if boundary["updates"] != self._egpo_updates():
            return "the interruption came during an optimizer update"
        _set_rng_states(boundary["rng"])
        self.state.num_input_tokens_seen = boundary["num_input_tokens_seen"]
        state = boundary["resume_state"]
        for name in _COUNTERS:
            if name in state:
                setattr(self, name, state[name])
        self._buffered_inputs = state["buffered_inputs"]
        self._metrics["train"].clear()
        for key, values in state["metrics_train"].items():
            self._metrics["train"][key].extend(values)
        if state["tr_loss"] is not None:
            self._tr_loss.copy_(state["tr_loss"])
        self._save_checkpoint(self.model, trial=None)
        return None

    # ------------------------------------------------------------------ vLLM sampling seeds
    def _egpo_seed_vllm_sampling(self) -> None:
        """Give each prompt of a vLLM colocate generation its own :func:`generation_seed` (unless the run set a
        ``seed`` in ``generation_kwargs``). Server mode is left as it is: its engine's state lives in the server."""
        generation = getattr(self, "vllm_generation", None)
        llm = getattr(generation, "llm", None)
        if not getattr(self, "use_vllm", False) or llm is None or getattr(generation, "mode", None) != "colocate":
            return
        if (self.args.generation_kwargs or {}).get("seed") is not None:
            return
        generate = llm.generate
        trainer = self
        instance = self.accelerator.process_index // max(1, getattr(generation, "tensor_parallel_size", 1))

        def seeded_generate(prompts, sampling_params=None, *args: Any, **kwargs: Any):
            if (
                sampling_params is None
                or isinstance(sampling_params, (list, tuple))
                or sampling_params.seed is not None
            ):
                return generate(prompts, sampling_params, *args, **kwargs)
            call = trainer._egpo_next_generation_call()
            params = seeded_sampling_params(
                sampling_params, len(prompts), trainer.args.seed, trainer.state.global_step, call, instance
            )
            return generate(prompts, params, *args, **kwargs)

        llm.generate = seeded_generate

    def _egpo_next_generation_call(self) -> int:
        """The number of this generation call within the current global step and mode (evaluation: ``-1 - n``)."""
        key = (self.state.global_step, bool(self.model.training))
        last_key, count = self._egpo_generation_calls
        count = count + 1 if key == last_key else 0
        self._egpo_generation_calls = (key, count)
        return count if key[1] else -1 - count
