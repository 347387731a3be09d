"""One training run: held-out accuracy before, training, held-out accuracy after, metrics, plot, model."""

from __future__ import annotations

import hashlib
import json
import logging
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
    read_metrics,
    refuse_output_dir_over_model,
    write_metrics,
)
from egpo_trl.script.plots import plot_metrics
from egpo_trl.script.resolve import check_model_exists, resolve_reward_funcs
from egpo_trl.script.resume import (
    checkpoint_step,
    nothing_to_train,
    resume_checkpoint,
    resumes_own_run,
    save_interrupted,
    set_aside_later_history,
)

logger = logging.getLogger(__name__)


def build_trainer(script_args: TrainScriptArguments, training_args, model_args, model_path: str, train_dataset):
    """An :class:`~egpo_trl.EGPOTrainer` for the resolved arguments and model path (the model is loaded here)."""
    from trl import get_peft_config, get_quantization_config

    from egpo_trl.trainer import EGPOTrainer

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}  # the recipe's own win
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    return EGPOTrainer(
        model=model_path,
        reward_funcs=resolve_reward_funcs(script_args.reward_funcs),
        args=training_args,
        train_dataset=train_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )


def precision_label(trainer) -> str:
    """How the trainer computes, e.g. ``float32 on cpu`` or ``bf16 autocast on cuda``."""
    mixed, device = trainer.accelerator.mixed_precision, trainer.accelerator.device.type
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


def _heldout(trainer, heldout, settings: dict[str, Any], batch_size: int, stage: str) -> dict[str, Any]:
    """Evaluate the model on the held-out problems, print the result and return the record kept in ``heldout.json``."""
    from egpo_trl.heldout import heldout_accuracy

    start, step = time.time(), trainer.state.global_step
    options = ("max_new_tokens", "num_samples", "temperature", "top_p", "top_k", "seed")
    model = trainer.accelerator.unwrap_model(trainer.model)
    result = heldout_accuracy(
        model, trainer.processing_class, heldout, batch_size=batch_size, **{key: settings[key] for key in options}
    )
    levels = "  ".join(f"L{level} {acc:.0%}" for level, acc in result.by_level.items())
    print(
        f"Held-out accuracy {stage} training: {result.accuracy:.1%} ({result.num_problems} problems x "
        f"{result.num_samples} samples, T={settings['temperature']:g}, {time.time() - start:.0f}s)"
        f"{'   ' + levels if levels else ''}",
        flush=True,
    )
    return {**result.to_dict(), **settings, "step": step}


def _write_heldout(output_dir: Path, records: dict[str, Any], stage: str) -> None:
    """Write the evaluation of ``stage`` into ``metrics.jsonl``; before training, ``records`` into ``heldout.json``."""
    record = {"step": records[stage]["step"], "heldout/accuracy": records[stage]["accuracy"], "heldout/stage": stage}
    rows = read_metrics(output_dir / METRICS_FILE) if (output_dir / METRICS_FILE).is_file() else []
    places = [i for i, r in enumerate(rows) if r.get("heldout/stage") == stage]  # in place of its stage's record
    if places:
        rows = [record if i == places[0] else r for i, r in enumerate(rows) if i not in places[1:]]
    else:  # else first (before) or last (after)
        rows.insert(0 if stage == "before" else len(rows), record)
    write_metrics(output_dir / METRICS_FILE, rows)
    if stage == "before":  # after training, written once the final model is saved
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
        training_args.output_dir, script_args.overwrite_output_dir, own_run, None if own_run else resume
    )
    if resume is not None and training_args.max_steps > 0 and nothing_to_train(training_args, resume, own_run):
        return summary  # judged before anything loads
    model_path = check_model_exists(
        model_args.model_name_or_path, model_args.model_revision, training_args.trust_remote_code
    )
    train_dataset, heldout = load_datasets(script_args, seed=training_args.seed)
    trainer = build_trainer(script_args, training_args, model_args, model_path, train_dataset)
    if resume is not None and training_args.max_steps <= 0:  # sized in epochs: judged by the trainer's step count
        if nothing_to_train(training_args, resume, own_run, trainer):
            return summary
    clear_output_dir()  # with --overwrite_output_dir: only now that the model, data and rewards have loaded
    is_main = trainer.accelerator.is_main_process
    metrics_path = output_dir / METRICS_FILE
    resume_step = checkpoint_step(resume) if resume is not None else 0
    names = trainer.reward_func_names
    correctness_name = names[getattr(trainer, "_egpo_correctness_index", 0)] if names else None
    from_reward = correctness_name in PLUS_MINUS_ONE
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if heldout is not None and (trainer.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3)):
        logger.warning("The held-out check runs on one process and cannot generate with sharded weights: skipped.")
        heldout = None
    time_offset = 0.0  # a resumed run's clock continues from the last training record at or before its step
    if own_run and is_main and metrics_path.is_file():
        times = [r["time_s"] for r in read_metrics(metrics_path) if "time_s" in r and r.get("step", 0) <= resume_step]
        time_offset = float(times[-1]) if times else 0.0
    trainer.add_callback(MetricsCallback(metrics_path, correctness_name, from_reward, time_offset=time_offset))
    if not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(CompactProgressCallback(correctness_name, accuracy_from_reward=from_reward))

    if is_main:
        by_steps = training_args.max_steps > 0
        length = f"{training_args.max_steps} steps" if by_steps else f"{training_args.num_train_epochs:g} epoch(s)"
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
    settings: dict[str, Any] = {}  # what a held-out evaluation depends on: a resume reuses one only when all are equal
    if heldout is not None:
        digest = hashlib.sha256()
        for prompt, answer in zip(heldout["prompt"], heldout["answer"], strict=True):
            digest.update(json.dumps([prompt, answer], sort_keys=True, default=str).encode() + b"\n")
        temperature = script_args.eval_temperature
        settings = {
            "num_problems": len(heldout),
            "num_samples": script_args.eval_num_samples,
            "temperature": training_args.temperature if temperature is None else temperature,
            "heldout_sha256": digest.hexdigest(),
            "model": str(model_args.model_name_or_path),
            "model_revision": model_args.model_revision,
            "max_new_tokens": training_args.max_completion_length,
            "top_p": training_args.top_p,
            "top_k": max(training_args.top_k or 0, 0),  # -1 is vLLM's "off", 0 transformers'
            "seed": training_args.seed,
        }
    if heldout is not None and is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        stored_file = output_dir / HELDOUT_FILE
        stored = json.loads(stored_file.read_text()).get("before") if own_run and stored_file.is_file() else None
        if stored and all(stored.get(k) == v for k, v in settings.items()):
            print(f"Held-out accuracy before training: {stored['accuracy']:.1%} (stored by the run resumed)")
            records["before"] = stored  # made by the run this one continues
        else:
            records["before"] = _heldout(trainer, heldout, settings, script_args.eval_batch_size, "before")
            if own_run:  # written once the checkpoint has loaded: a failed load leaves the earlier run's files
                recomputed = dict(records)
            else:
                _write_heldout(output_dir, records, "before")
        summary["heldout_before"] = records["before"]["accuracy"]
    trainer.accelerator.wait_for_everyone()
    if own_run:
        trainer.add_callback(_SetAsideLaterHistory(trainer.accelerator, output_dir, resume_step, recomputed))
    try:  # stopped in a step, the evaluation after training or the final save: the last finished step is kept
        summary["train_runtime_s"] = trainer.train(resume_from_checkpoint=resume).metrics.get("train_runtime")
        if heldout is not None and is_main:
            records["after"] = _heldout(trainer, heldout, settings, script_args.eval_batch_size, "after")
            _write_heldout(output_dir, records, "after")
            summary["heldout_after"] = records["after"]["accuracy"]
        if script_args.save_final_model:
            trainer.save_model(str(output_dir))
            trainer.save_state()  # trainer_state.json, written last, dates a complete final model (a resume reads it)
        if is_main:
            files = [metrics_path]
            if records:
                (output_dir / HELDOUT_FILE).write_text(json.dumps(records, indent=2) + "\n")
                files.append(output_dir / HELDOUT_FILE)
            if script_args.plot and metrics_path.exists():
                title = f"{training_args.advantage_estimator.upper()} on {script_args.dataset_name}, "
                title += f"seed {training_args.seed}"
                plot_metrics(read_metrics(metrics_path), output_dir / PLOT_FILE, title=title)
                files.append(output_dir / PLOT_FILE)
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
    except KeyboardInterrupt:
        save_interrupted(trainer)
        raise
    trainer.accelerator.wait_for_everyone()
    return summary


class _SetAsideLaterHistory(TrainerCallback):
    """Once the checkpoint has loaded: sets the later steps aside and writes a ``recomputed`` evaluation before."""

    def __init__(self, accelerator, output_dir: Path, step: int, recomputed: dict[str, Any] | None = None):
        self.accelerator, self.output_dir, self.step, self.recomputed = accelerator, output_dir, step, recomputed

    def on_train_begin(self, args, state, control, **kwargs):
        if self.accelerator.is_main_process:
            folder = set_aside_later_history(self.output_dir, self.step)
            if folder is not None:
                print(f"Resuming from step {self.step}: the later steps' records and checkpoints moved to {folder}.")
            if self.recomputed is not None:
                _write_heldout(self.output_dir, self.recomputed, "before")
        self.accelerator.wait_for_everyone()  # set aside before any process looks for a checkpoint
