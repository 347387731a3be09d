"""One training run: held-out accuracy before, training, held-out accuracy after, metrics, plot, model."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ProgressCallback

from egpo_trl.script.args import TrainScriptArguments
from egpo_trl.script.callbacks import PLUS_MINUS_ONE, CompactProgressCallback, MetricsCallback
from egpo_trl.script.data import load_datasets
from egpo_trl.script.outputs import (
    HELDOUT_FILE,
    METRICS_FILE,
    PLOT_FILE,
    prepare_output_dir,
    put_heldout_record,
    read_metrics,
    refuse_output_dir_over_model,
)
from egpo_trl.script.plots import plot_metrics
from egpo_trl.script.resolve import check_model_exists, resolve_model_path, resolve_reward_funcs
from egpo_trl.script.resume import (
    LAST_SAVED_FILE,
    checkpoint_step,
    discard_set_aside,
    finished_message,
    heldout_fingerprint,
    later_final_outputs,
    missing_final_outputs,
    put_back_later_history,
    resume_checkpoint,
    resumed_time,
    resumes_own_run,
    save_interrupted,
    set_aside_later_history,
    stored_heldout_after,
    stored_heldout_before,
    trainer_last_step,
)

logger = logging.getLogger(__name__)

__all__ = ["build_trainer", "precision_label", "run"]


def build_trainer(script_args: TrainScriptArguments, training_args, model_args, train_dataset):
    """An :class:`~egpo_trl.EGPOTrainer` for the resolved arguments (the model is loaded here)."""
    from trl import get_peft_config, get_quantization_config

    from egpo_trl.trainer import EGPOTrainer

    model_path = resolve_model_path(model_args.model_name_or_path)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    quantization_config = get_quantization_config(model_args)
    model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}
    if training_args.model_init_kwargs:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    trainer = EGPOTrainer(
        model=model_path,
        reward_funcs=resolve_reward_funcs(script_args.reward_funcs),
        args=training_args,
        train_dataset=train_dataset,
        quantization_config=quantization_config,
        peft_config=get_peft_config(model_args),
    )
    return trainer


def _shards_parameters(trainer) -> bool:
    """Whether the weights are sharded across processes (DeepSpeed ZeRO-3 or FSDP)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None and plugin.zero_stage == 3)


def _correctness_name(trainer) -> str | None:
    index = getattr(trainer, "_egpo_correctness_index", 0)
    names = getattr(trainer, "reward_func_names", [])
    return names[index] if names else None


def precision_label(trainer) -> str:
    """How the trainer computes, e.g. ``float32 on cpu`` or ``bf16 autocast on cuda``."""
    mixed = trainer.accelerator.mixed_precision
    device = trainer.accelerator.device.type
    if mixed != "no" and trainer.is_deepspeed_enabled:
        return f"{mixed} (DeepSpeed) on {device}"  # DeepSpeed casts the model's weights; no autocast
    if mixed != "no":
        label = f"{mixed} autocast on {device}"
        return f"{label} (--bf16 false trains in float32)" if device == "cpu" and mixed == "bf16" else label
    parameter = next(trainer.model.parameters(), None)
    return f"{str(parameter.dtype).removeprefix('torch.') if parameter is not None else 'float32'} on {device}"


def kv_cache_line(trainer, training_args, max_prompt_length: int | None = None) -> str | None:
    """The colocated vLLM engine's KV cache against one generation batch's sequences (``None`` without one)."""
    tokens = trainer.vllm_kv_cache_tokens()
    if not tokens:
        return None
    from egpo_trl.sampling.dynamic import colocated_engine_sequences

    rows, oversampled = colocated_engine_sequences(training_args, trainer.accelerator.num_processes)
    batch = "oversampled first round" if oversampled else "generation batch"  # what the engine was given
    return kv_cache_message(tokens, (max_prompt_length or 0) + training_args.max_completion_length, rows, batch)


def kv_cache_message(tokens: int, sequence: int, rows: int, batch: str = "generation batch") -> str:
    """How many ``sequence``-token sequences a KV cache of ``tokens`` holds at once, against ``rows`` per ``batch``."""
    at_once = tokens // sequence
    line = (
        f"vLLM's KV cache holds {tokens:,} tokens: {at_once} sequences of {sequence:,} tokens at once (prompt and "
        f"completion at their limits), for {rows} per {batch}"
    )
    if 0 < at_once < rows:
        line += (
            f"; when every completion runs to its limit they are decoded in {-(-rows // at_once)} rounds, the last "
            "sequences starting as the first end (a larger vllm_gpu_memory_utilization, where GPU memory allows, "
            "holds more)"
        )
    return line + "."


def _eval_temperature(script_args, training_args) -> float:
    return training_args.temperature if script_args.eval_temperature is None else script_args.eval_temperature


def _heldout_settings(script_args, training_args, model_args, heldout) -> dict[str, Any]:
    """What a held-out evaluation depends on; a resume reuses a stored one only when all are equal."""
    return {
        "num_problems": len(heldout),
        "num_samples": script_args.eval_num_samples,
        "temperature": _eval_temperature(script_args, training_args),
        "heldout_sha256": heldout_fingerprint(heldout),
        "model": str(model_args.model_name_or_path),
        "model_revision": model_args.model_revision,
        "max_new_tokens": training_args.max_completion_length,
        "top_p": training_args.top_p,
        "top_k": max(training_args.top_k or 0, 0),
        "seed": training_args.seed,
    }


def _heldout(trainer, script_args, training_args, heldout, label: str):
    from egpo_trl.heldout import heldout_accuracy

    temperature = _eval_temperature(script_args, training_args)
    model = trainer.accelerator.unwrap_model(trainer.model)
    start = time.time()
    result = heldout_accuracy(
        model,
        trainer.processing_class,
        heldout,
        max_new_tokens=training_args.max_completion_length,
        num_samples=script_args.eval_num_samples,
        temperature=temperature,
        top_p=training_args.top_p,
        top_k=max(training_args.top_k or 0, 0),  # -1 is vLLM's "off", 0 transformers'
        batch_size=script_args.eval_batch_size,
        seed=training_args.seed,
    )
    levels = "  ".join(f"L{level} {acc:.0%}" for level, acc in result.by_level.items())
    print(
        f"Held-out accuracy {label}: {result.accuracy:.1%} ({result.num_problems} problems x {result.num_samples} "
        f"samples, T={temperature:g}, {time.time() - start:.0f}s){'   ' + levels if levels else ''}",
        flush=True,
    )
    return result, temperature


def run(script_args: TrainScriptArguments, training_args, model_args) -> dict[str, Any]:
    """Train with resolved arguments; returns ``output_dir``, ``heldout_before``/``heldout_after`` and the files."""
    import torch

    threads = torch.get_num_threads()
    if script_args.torch_num_threads:
        torch.set_num_threads(script_args.torch_num_threads)
    try:
        return _run(script_args, training_args, model_args)
    finally:
        torch.set_num_threads(threads)


def _run(script_args: TrainScriptArguments, training_args, model_args) -> dict[str, Any]:
    wall_start = time.time()
    resume = resume_checkpoint(training_args)
    # Only a checkpoint inside output_dir continues the run there; one of another folder starts a new run in
    # output_dir from its weights and training state, so that folder must hold no other run (as for any new run).
    own_run = resumes_own_run(resume, training_args.output_dir)
    refuse_output_dir_over_model(training_args.output_dir, model_args.model_name_or_path)
    clear_output_dir = prepare_output_dir(
        training_args.output_dir,
        script_args.overwrite_output_dir,
        resuming=own_run,
        start_from=None if own_run else resume,
    )
    nothing_to_do = {"output_dir": str(training_args.output_dir), "heldout_before": None, "heldout_after": None}
    finish_only = False  # the checkpoint is at the last step, but what a run writes after its last step is missing
    if resume is not None and training_args.max_steps > 0:  # a run sized by max_steps: judged before anything loads
        outcome = _resume_outcome(
            script_args,
            training_args,
            resume,
            own_run,
            training_args.max_steps,
            finished_message(training_args, resume),
        )
        if outcome == "done":
            return nothing_to_do  # nothing loads, nothing is written
        finish_only = outcome == "finish"

    check_model_exists(model_args.model_name_or_path, model_args.model_revision, training_args.trust_remote_code)
    train_dataset, heldout = load_datasets(script_args, seed=training_args.seed)
    trainer = build_trainer(script_args, training_args, model_args, train_dataset)
    if resume is not None and training_args.max_steps <= 0:
        # A run sized by num_train_epochs: judged by the step count the trainer will use (this run's data and batch
        # sizes), now that it is built and before anything is written.
        last_step = trainer_last_step(trainer)
        if last_step is not None:
            finished = finished_message(training_args, resume, last_step=last_step)
            outcome = _resume_outcome(script_args, training_args, resume, own_run, last_step, finished)
            if outcome == "done":
                return nothing_to_do
            finish_only = outcome == "finish"
    clear_output_dir()  # with --overwrite_output_dir: only now that the model, data and rewards have loaded
    is_main = trainer.accelerator.is_main_process
    output_dir = Path(training_args.output_dir)
    metrics_path, heldout_path = output_dir / METRICS_FILE, output_dir / HELDOUT_FILE
    correctness_name = _correctness_name(trainer)
    if heldout is not None and _shards_parameters(trainer):
        logger.warning("The held-out check runs on one process and cannot generate with sharded weights: skipped.")
        heldout = None
    settings = _heldout_settings(script_args, training_args, model_args, heldout) if heldout is not None else {}
    time_offset = 0.0
    stored_after = None  # a finished run's evaluation after training, made at its last step with these settings
    if finish_only and own_run:
        stored_after = stored_heldout_after(output_dir, {**settings, "step": checkpoint_step(resume)})
    # The files as this command found them: a resumed run that the trainer finds finished when it loads the checkpoint
    # (a safety net, where the count above could not be made) gets them back unchanged.
    # A resume that fails before its first step gets them back too, with the checkpoints it set aside.
    found = {}
    if resume is not None:
        found = {path: path.read_bytes() if path.is_file() else None for path in (metrics_path, heldout_path)}
        trainer.accelerator.wait_for_everyone()  # every process has read them before the main process writes
    resume_step = checkpoint_step(resume) if resume is not None else None
    if own_run and is_main and not stored_after and metrics_path.is_file():
        time_offset = resumed_time(metrics_path, resume_step)
    metrics = MetricsCallback(
        metrics_path,
        correctness_name,
        accuracy_from_reward=correctness_name in PLUS_MINUS_ONE,
        time_offset=time_offset,
    )
    trainer.add_callback(metrics)
    if not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(
            CompactProgressCallback(correctness_name, accuracy_from_reward=correctness_name in PLUS_MINUS_ONE)
        )

    if is_main:
        length = (
            f"{training_args.max_steps} steps"
            if training_args.max_steps > 0
            else f"{training_args.num_train_epochs:g} epoch(s)"
        )
        print(
            f"{training_args.advantage_estimator.upper()} on {model_args.model_name_or_path}: {len(train_dataset)} "
            f"training prompts from {script_args.dataset_name}, {training_args.num_generations} completions per "
            f"prompt, {length}, {precision_label(trainer)}. Outputs: {output_dir}/",
            flush=True,
        )
        capacity = kv_cache_line(trainer, training_args, script_args.max_prompt_length)
        if capacity:
            print(capacity, flush=True)
    summary: dict[str, Any] = {"output_dir": str(output_dir), "heldout_before": None, "heldout_after": None}
    heldout_records: dict[str, Any] = {}
    if heldout is not None and is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        stored = None
        if own_run:
            stored = stored_heldout_before(output_dir, settings)
        if stored is not None:  # a resumed run: the evaluation before training was made by the run it continues
            print(
                f"Held-out accuracy before training: {stored['accuracy']:.1%} (stored by the run resumed)", flush=True
            )
            summary["heldout_before"] = stored["accuracy"]
            heldout_records["before"] = stored
        else:
            result, temperature = _heldout(trainer, script_args, training_args, heldout, "before training")
            summary["heldout_before"] = result.accuracy
            heldout_records["before"] = {**result.to_dict(), **settings, "temperature": temperature, "step": 0}
            heldout_path.write_text(json.dumps(heldout_records, indent=2) + "\n")  # kept for a resumed run
            # The step-0 record: first in a new run's metrics.jsonl; a resumed run evaluating again (other settings)
            # replaces the one stored, so that the metrics and the curves show what heldout.json holds.
            put_heldout_record(
                metrics_path, {"step": 0, "heldout/accuracy": result.accuracy, "heldout/stage": "before"}
            )
    trainer.accelerator.wait_for_everyone()

    # What the folder held after the checkpoint resumed from goes to replaced/<time>-from-step-N/, just before
    # training. A resume that fails before its first step (a checkpoint that does not load, memory, ...) leaves the
    # folder as this command found it: the files it changed and what it set aside go back (on the main process; with
    # several, a failure elsewhere can end the launch first, and replaced/ then keeps them). Ctrl-C is no failure.
    set_aside = None
    if own_run and is_main and not stored_after:
        set_aside = set_aside_later_history(output_dir, resume_step)
        if set_aside is not None:
            print(
                f"Resuming from step {resume_step}: {_set_aside_summary(set_aside)} moved to {set_aside}.", flush=True
            )
    if own_run:
        trainer.accelerator.wait_for_everyone()  # later checkpoints are set aside before any process looks for one
    undone_on_failure = _UndoneOnFailure(
        lambda: is_main and resume is not None and trainer.state.global_step <= resume_step,
        lambda: _undo_resume(output_dir, found, set_aside),
    )
    if finish_only:
        # Trainer loads the checkpoint (weights, and the DeepSpeed/FSDP wrapping) inside train(); with
        # egpo_load_only, EGPOTrainer.train stops there, before any step (see ExactResumeMixin.train).
        trainer.egpo_load_only = True
        with undone_on_failure:
            trainer.train(resume_from_checkpoint=resume)
            if trainer.state.global_step != resume_step:
                raise RuntimeError(f"{resume} loaded at step {trainer.state.global_step}, not its own step")
        trainer.egpo_load_only = False
    else:
        try:
            with undone_on_failure:
                train_output = trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:
            save_interrupted(trainer)
            raise
        summary["train_runtime_s"] = train_output.metrics.get("train_runtime")
        if getattr(trainer, "egpo_trained_nothing", False):
            # Finished by the trainer's own count, which the checks above could not make: the files go back to what
            # this command found, and are judged as they were.
            written = {}
            if is_main:
                for path in found:
                    written[path] = path.read_bytes() if path.is_file() else None
                _undo_resume(output_dir, found, set_aside, keep_records=True)
            trainer.accelerator.wait_for_everyone()
            if own_run:
                _refuse_to_replace_later_outputs(training_args, resume, last_step=trainer.state.max_steps)
            finished = (
                f"egpo-trl train: nothing to train: {resume} is at this run's last step ({trainer.state.global_step}); "
                f"the outputs in {output_dir} are left as they are."
            )
            if not _outputs_to_write(
                script_args,
                training_args,
                resume,
                finished,
                own_run=own_run,
                last_step=trainer.state.max_steps,
                heldout=heldout is not None,
            ):
                if is_main and set_aside is not None:  # metrics.jsonl holds them again
                    discard_set_aside(set_aside)
                trainer.accelerator.wait_for_everyone()
                return summary
            if is_main:  # writing the missing outputs, as from a finished checkpoint caught before loading (the
                # records cut stay in replaced/)
                for path, content in written.items():
                    _put_back(path, content)
            trainer.accelerator.wait_for_everyone()

    try:
        return _finish(
            trainer, script_args, training_args, summary, heldout, heldout_records, settings, stored_after, wall_start
        )
    except KeyboardInterrupt:
        # Stopped during the evaluation after training or the final save: the trained steps are kept in a checkpoint
        # of the last one (one process; none when it exists), from which a resume writes what is missing.
        if not finish_only:
            save_interrupted(trainer)
        raise


class _UndoneOnFailure:
    """A context that runs ``undo`` when its body raises an ``Exception`` and ``applies()`` says so."""

    def __init__(self, applies, undo):
        self.applies, self.undo = applies, undo

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and issubclass(kind, Exception) and self.applies():
            self.undo()
        return False


def _undo_resume(
    output_dir: Path, found: dict[Path, bytes | None], set_aside: Path | None, keep_records: bool = False
) -> None:
    """Put back the files a resume changed and the checkpoints it set aside."""
    for path, content in found.items():
        _put_back(path, content)
    if set_aside is not None:
        put_back_later_history(output_dir, set_aside, keep_records=keep_records)


def _set_aside_summary(folder: Path) -> str:
    """What :func:`set_aside_later_history` moved into ``folder``, in words."""
    records = len(read_metrics(folder / METRICS_FILE)) if (folder / METRICS_FILE).is_file() else 0
    checkpoints = sorted(c.name for c in folder.glob("checkpoint-*"))
    parts = []
    if records:
        parts.append(f"{records} record{'s' * (records != 1)} of {METRICS_FILE} that this run writes again")
    if checkpoints:
        parts.append(f"the later {', '.join(checkpoints)}")
    return " and ".join(parts)


def _put_back(path: Path, content: bytes | None) -> None:
    """Write ``content`` to ``path`` (remove it when ``None``), unless it already holds it."""
    if content is None:
        path.unlink(missing_ok=True)
    elif not path.is_file() or path.read_bytes() != content:
        path.write_bytes(content)


def _refuse_to_replace_later_outputs(training_args, resume, last_step: int) -> None:
    """Refuse a resume whose final outputs would replace those of a later step in ``output_dir``."""
    end = max(checkpoint_step(resume), last_step)
    later = later_final_outputs(training_args.output_dir, end)
    if later:
        raise SystemExit(
            f"egpo-trl train: resuming {resume}, this run ends at step {end}, but {training_args.output_dir} holds "
            f"{later}, which this run's final outputs would replace. Resume from the last checkpoint "
            "(--resume_from_checkpoint true), or raise --max_steps/--num_train_epochs to train past them; to start "
            f"a new run from {resume}, give another --output_dir."
        )


def _resume_outcome(script_args, training_args, resume, own_run: bool, last_step: int, finished: str | None) -> str:
    """``"train"``, ``"finish"`` (at the last step with final outputs missing: write them) or ``"done"``."""
    if own_run:
        _refuse_to_replace_later_outputs(training_args, resume, last_step=last_step)
    if finished is None:
        return "train"
    return "finish" if _outputs_to_write(script_args, training_args, resume, finished, own_run, last_step) else "done"


def _outputs_to_write(
    script_args,
    training_args,
    resume,
    finished: str,
    own_run: bool,
    last_step: int,
    heldout: bool | None = None,
) -> bool:
    """Whether a resume at the run's last step has final outputs to write (says which, or prints ``finished``)."""
    step = checkpoint_step(resume)
    output_dir = training_args.output_dir
    main_process = os.environ.get("RANK", "0") == "0"
    heldout = script_args.eval_size > 0 if heldout is None else heldout
    if step > last_step:
        if main_process:
            print(finished, flush=True)
        return False
    if own_run:
        missing = missing_final_outputs(output_dir, script_args.save_final_model, heldout=heldout, step=step)
    else:
        missing = ["the trained model"] if script_args.save_final_model else []
        missing += ["the held-out evaluation after training"] if heldout else []
    if not missing:
        if main_process:
            print(finished, flush=True)
        return False
    if main_process:
        print(
            f"egpo-trl train: {resume} is at the run's last step, but {' and '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} missing from {output_dir}: loading the checkpoint to write them, "
            "without training.",
            flush=True,
        )
    return True


def _finish(
    trainer, script_args, training_args, summary, heldout, heldout_records, settings, stored_after, wall_start
):
    """After training: the held-out evaluation, the final model, ``heldout.json``, the plot and the summary."""
    is_main = trainer.accelerator.is_main_process
    output_dir = Path(training_args.output_dir)
    metrics_path, plot_path, heldout_path = (
        output_dir / METRICS_FILE,
        output_dir / PLOT_FILE,
        output_dir / HELDOUT_FILE,
    )
    if heldout is not None and is_main and stored_after:
        print(f"Held-out accuracy after training: {stored_after['accuracy']:.1%} (stored by the run resumed)")
        summary["heldout_after"] = stored_after["accuracy"]
        heldout_records["after"] = stored_after
    elif heldout is not None and is_main:
        result, temperature = _heldout(trainer, script_args, training_args, heldout, "after training")
        summary["heldout_after"] = result.accuracy
        step = trainer.state.global_step
        heldout_records["after"] = {**result.to_dict(), **settings, "temperature": temperature, "step": step}
        put_heldout_record(metrics_path, {"step": step, "heldout/accuracy": result.accuracy, "heldout/stage": "after"})
    if script_args.save_final_model:
        # training_args.bin marks a complete final model (save_model writes it last): removed first, then
        # trainer_state.json (the step the model belongs to, read by a later resume), then the model, so that a save
        # cut short anywhere leaves the final model counted as missing.
        if is_main:
            (output_dir / LAST_SAVED_FILE).unlink(missing_ok=True)
        trainer.accelerator.wait_for_everyone()
        trainer.save_state()
        trainer.save_model(str(output_dir))
    if is_main:
        files = [metrics_path]
        if heldout_records:
            heldout_path.write_text(json.dumps(heldout_records, indent=2) + "\n")
            files.append(heldout_path)
        if script_args.plot and metrics_path.exists():
            title = (
                f"{trainer.args.advantage_estimator.upper()} on {script_args.dataset_name}, seed {training_args.seed}"
            )
            plot_metrics(read_metrics(metrics_path), plot_path, title=title)
            files.append(plot_path)
        summary["files"] = [str(f) for f in files]
        summary["wall_time_s"] = round(time.time() - wall_start, 1)
        before, after = summary["heldout_before"], summary["heldout_after"]
        print("")
        if before is not None and after is not None:
            print(
                f"Held-out accuracy: {before:.1%} before -> {after:.1%} after training "
                f"({100 * (after - before):+.1f} points)."
            )
        print(f"Done in {summary['wall_time_s']:.0f}s. Outputs in {output_dir}/:")
        for path in files:
            print(f"  {path}")
        if script_args.save_final_model:
            print(f"  {output_dir}/ (trained model and tokenizer)")
    trainer.accelerator.wait_for_everyone()
    return summary
