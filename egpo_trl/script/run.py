"""One training run: held-out accuracy before, training, held-out accuracy after, metrics, plot, model."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from transformers.trainer_callback import ProgressCallback, TrainerCallback

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
    checkpoint_step,
    finished_message,
    heldout_fingerprint,
    later_final_outputs,
    resume_checkpoint,
    resumed_time,
    resumes_own_run,
    save_interrupted,
    set_aside_later_history,
    stored_heldout_before,
    trainer_last_step,
)

logger = logging.getLogger(__name__)


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


def _heldout_settings(script_args, training_args, model_args, heldout) -> dict[str, Any]:
    """What a held-out evaluation depends on; a resume reuses a stored one only when all are equal."""
    temperature = script_args.eval_temperature
    return {
        "num_problems": len(heldout),
        "num_samples": script_args.eval_num_samples,
        "temperature": training_args.temperature if temperature is None else temperature,
        "heldout_sha256": heldout_fingerprint(heldout),
        "model": str(model_args.model_name_or_path),
        "model_revision": model_args.model_revision,
        "max_new_tokens": training_args.max_completion_length,
        "top_p": training_args.top_p,
        "top_k": max(training_args.top_k or 0, 0),  # -1 is vLLM's "off", 0 transformers'
        "seed": training_args.seed,
    }


def _heldout(trainer, heldout, settings: dict[str, Any], batch_size: int, stage: str) -> dict[str, Any]:
    """Evaluate the model on the held-out problems, print the result and return the record kept in
    ``heldout.json``."""
    from egpo_trl.heldout import heldout_accuracy

    start, step = time.time(), trainer.state.global_step
    options = ("max_new_tokens", "num_samples", "temperature", "top_p", "top_k", "seed")
    result = heldout_accuracy(
        trainer.accelerator.unwrap_model(trainer.model),
        trainer.processing_class,
        heldout,
        batch_size=batch_size,
        **{key: settings[key] for key in options},
    )
    levels = "  ".join(f"L{level} {acc:.0%}" for level, acc in result.by_level.items())
    print(
        f"Held-out accuracy {stage} training: {result.accuracy:.1%} ({result.num_problems} problems x "
        f"{result.num_samples} samples, T={settings['temperature']:g}, {time.time() - start:.0f}s)"
        f"{'   ' + levels if levels else ''}",
        flush=True,
    )
    return {**result.to_dict(), **settings, "step": step}


def _put_record(output_dir: Path, record: dict[str, Any], stage: str) -> None:
    """Write a held-out evaluation's record of ``stage`` into ``metrics.jsonl``."""
    put_heldout_record(
        output_dir / METRICS_FILE,
        {"step": record["step"], "heldout/accuracy": record["accuracy"], "heldout/stage": stage},
    )


def _write_before(output_dir: Path, records: dict[str, Any]) -> None:
    """Write the evaluation before training into ``metrics.jsonl`` and ``heldout.json`` (kept for a resumed run)."""
    _put_record(output_dir, records["before"], "before")
    (output_dir / HELDOUT_FILE).write_text(json.dumps(records, indent=2) + "\n")


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
    output_dir = Path(training_args.output_dir)
    summary: dict[str, Any] = {"output_dir": str(output_dir), "heldout_before": None, "heldout_after": None}
    resume = resume_checkpoint(training_args)
    # Only a checkpoint inside output_dir continues the run there; one of another folder starts a new run there.
    own_run = resumes_own_run(resume, output_dir)
    refuse_output_dir_over_model(training_args.output_dir, model_args.model_name_or_path)
    clear_output_dir = prepare_output_dir(
        training_args.output_dir,
        script_args.overwrite_output_dir,
        resuming=own_run,
        start_from=None if own_run else resume,
    )
    if resume is not None and training_args.max_steps > 0 and _nothing_to_train(training_args, resume, own_run):
        return summary  # judged before anything loads
    check_model_exists(model_args.model_name_or_path, model_args.model_revision, training_args.trust_remote_code)
    train_dataset, heldout = load_datasets(script_args, seed=training_args.seed)
    trainer = build_trainer(script_args, training_args, model_args, train_dataset)
    if (
        resume is not None
        and training_args.max_steps <= 0
        and _nothing_to_train(training_args, resume, own_run, trainer)
    ):
        return summary
    clear_output_dir()  # with --overwrite_output_dir: only now that the model, data and rewards have loaded
    is_main = trainer.accelerator.is_main_process
    metrics_path = output_dir / METRICS_FILE
    resume_step = checkpoint_step(resume) if resume is not None else 0
    correctness_name = _correctness_name(trainer)
    from_reward = correctness_name in PLUS_MINUS_ONE
    if heldout is not None and _shards_parameters(trainer):
        logger.warning("The held-out check runs on one process and cannot generate with sharded weights: skipped.")
        heldout = None
    settings = _heldout_settings(script_args, training_args, model_args, heldout) if heldout is not None else {}
    time_offset = resumed_time(metrics_path, resume_step) if own_run and is_main else 0.0
    trainer.add_callback(MetricsCallback(metrics_path, correctness_name, from_reward, time_offset=time_offset))
    if not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(CompactProgressCallback(correctness_name, accuracy_from_reward=from_reward))

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
    records: dict[str, Any] = {}  # what heldout.json holds
    recomputed = None  # a resumed run's new evaluation before training, written once the checkpoint has loaded
    if heldout is not None and is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        stored = stored_heldout_before(output_dir, settings) if own_run else None
        if stored is not None:  # a resumed run: the evaluation before training was made by the run it continues
            print(f"Held-out accuracy before training: {stored['accuracy']:.1%} (stored by the run resumed)")
            records["before"] = stored
        else:
            records["before"] = _heldout(trainer, heldout, settings, script_args.eval_batch_size, "before")
            if own_run:  # written once the checkpoint has loaded: a failed load leaves the earlier run's files
                recomputed = dict(records)
            else:
                _write_before(output_dir, records)
        summary["heldout_before"] = records["before"]["accuracy"]
    trainer.accelerator.wait_for_everyone()
    if own_run:
        trainer.add_callback(_SetAsideLaterHistory(trainer.accelerator, output_dir, resume_step, recomputed))
    try:
        train_output = trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        save_interrupted(trainer)
        raise
    summary["train_runtime_s"] = train_output.metrics.get("train_runtime")
    try:
        return _finish(trainer, script_args, summary, heldout, records, settings, wall_start)
    except KeyboardInterrupt:
        # Stopped during the evaluation after training or the final save: the last step is kept in a checkpoint.
        save_interrupted(trainer)
        raise


class _SetAsideLaterHistory(TrainerCallback):
    """Once the checkpoint has loaded, moves the records and checkpoints of the steps after it to ``replaced/`` and
    writes a new evaluation before training (``recomputed``)."""

    def __init__(self, accelerator, output_dir: Path, step: int, recomputed: dict[str, Any] | None = None):
        self.accelerator, self.output_dir, self.step, self.recomputed = accelerator, output_dir, step, recomputed

    def on_train_begin(self, args, state, control, **kwargs):
        if self.accelerator.is_main_process:
            folder = set_aside_later_history(self.output_dir, self.step)
            if folder is not None:
                print(f"Resuming from step {self.step}: the later steps' records and checkpoints moved to {folder}.")
            if self.recomputed is not None:
                _write_before(self.output_dir, self.recomputed)
        self.accelerator.wait_for_everyone()  # set aside before any process looks for a checkpoint


def _nothing_to_train(training_args, resume, own_run: bool, trainer=None) -> bool:
    """Says so and returns ``True`` when the run resumed from ``resume`` has already reached its last step; refuses a
    resume whose final outputs would replace those of a later step in ``output_dir``."""
    last_step = training_args.max_steps if trainer is None else trainer_last_step(trainer)
    step = checkpoint_step(resume)
    if step >= last_step:
        if os.environ.get("RANK", "0") == "0":
            print(finished_message(training_args, resume, step, last_step), flush=True)
        return True
    later = later_final_outputs(training_args.output_dir, last_step) if own_run else None
    if later:
        raise SystemExit(
            f"egpo-trl train: resuming {resume}, this run ends at step {last_step}, but {training_args.output_dir} "
            f"holds {later}, which this run's final outputs would replace. Raise --max_steps/--num_train_epochs to "
            f"train past them, or give another --output_dir to start a new run from {resume}."
        )
    return False


def _finish(trainer, script_args, summary, heldout, records, settings, wall_start):
    """After training: the held-out evaluation, the final model, ``heldout.json``, the plot and the summary."""
    is_main = trainer.accelerator.is_main_process
    args = trainer.args
    output_dir = Path(args.output_dir)
    metrics_path, plot_path, heldout_path = (
        output_dir / METRICS_FILE,
        output_dir / PLOT_FILE,
        output_dir / HELDOUT_FILE,
    )
    if heldout is not None and is_main:
        records["after"] = _heldout(trainer, heldout, settings, script_args.eval_batch_size, "after")
        _put_record(output_dir, records["after"], "after")
        summary["heldout_after"] = records["after"]["accuracy"]
    if script_args.save_final_model:
        trainer.save_model(str(output_dir))
        trainer.save_state()  # trainer_state.json, written last, dates a complete final model (a resume reads it)
    if is_main:
        files = [metrics_path]
        if records:
            heldout_path.write_text(json.dumps(records, indent=2) + "\n")
            files.append(heldout_path)
        if script_args.plot and metrics_path.exists():
            title = f"{args.advantage_estimator.upper()} on {script_args.dataset_name}, seed {args.seed}"
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
