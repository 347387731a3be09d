"""Trainer callbacks of ``egpo-trl train``: every log as a line of ``metrics.jsonl``, and a compact progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

# Reward functions whose values are +1 (correct) / -1 (incorrect): accuracy = (mean + 1) / 2.
PLUS_MINUS_ONE = ("boxed_accuracy_reward",)


def _train_accuracy(logs: dict[str, float], correctness_name: str | None) -> float | None:
    """Fraction of correct completions from a ``+1/-1`` reward's mean: ``(mean + 1) / 2``."""
    mean = logs.get(f"rewards/{correctness_name}/mean") if correctness_name else None
    return None if mean is None else (mean + 1.0) / 2.0


class MetricsCallback(TrainerCallback):
    """Appends every log as a JSON line to ``path``; ``time_s`` counts on from ``time_offset`` (a resumed run's)."""

    def __init__(self, path, correctness_name=None, accuracy_from_reward: bool = True, time_offset: float = 0.0):
        self.path, self.correctness_name = Path(path), correctness_name
        self.accuracy_from_reward, self.time_offset = accuracy_from_reward, time_offset
        self.start = time.time() - time_offset
        self._last_log = None  # (time, global step) of the previous training log, or of the training's start

    def on_train_begin(self, args, state, control, **kwargs):
        now = time.time()
        self.start, self._last_log = now - self.time_offset, (now, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.time()
        record = {"step": state.global_step, "epoch": state.epoch, "time_s": round(now - self.start, 2)}
        record.update({k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        if "loss" in logs and "train_runtime" not in logs:  # a training log: not an evaluation, not the summary
            if self._last_log is not None and state.global_step > self._last_log[1]:
                record["clock_s"] = round((now - self._last_log[0]) / (state.global_step - self._last_log[1]), 3)
            self._last_log = (now, state.global_step)
        accuracy = _train_accuracy(logs, self.correctness_name) if self.accuracy_from_reward else None
        if accuracy is not None:
            record["accuracy"] = accuracy
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, default=float) + "\n")


class CompactProgressCallback(ProgressCallback):
    """The Trainer's progress bar, with the key metrics as its postfix instead of a printed dict per log."""

    def __init__(self, correctness_name: str | None = None, accuracy_from_reward: bool = True):
        super().__init__()
        self.correctness_name = correctness_name
        self.accuracy_from_reward = accuracy_from_reward  # as MetricsCallback's: `acc` only from a +1/-1 reward

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and control.should_log:
            self.training_bar.set_postfix({}, refresh=False)
        super().on_step_end(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        accuracy = _train_accuracy(logs, self.correctness_name) if self.accuracy_from_reward else None
        postfix = {
            "reward": f"{logs['reward']:.2f}" if "reward" in logs else None,
            "acc": f"{accuracy:.2f}" if accuracy is not None else None,
            "mixed": f"{logs['egpo/frac_mixed']:.2f}" if "egpo/frac_mixed" in logs else None,
            "H gap": f"{logs['egpo/entropy_gap']:+.3f}" if "egpo/entropy_gap" in logs else None,
        }
        postfix = {key: value for key, value in postfix.items() if value is not None}
        if postfix:  # a step's metrics (the end-of-training summary has none, unless steps went unlogged)
            self.training_bar.set_postfix(postfix, refresh=True)
