"""DAPO's dynamic sampling (``dynamic_sampling``), a mixin of :class:`~egpo_trl.trainer.EGPOTrainer`: extra rounds
of prompts until the generation batch holds only informative groups, the same on every process."""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import torch
from trl.trainer.utils import nanstd

from egpo_trl.advantages import normalize_then_sum_rewards, weighted_reward_sum
from egpo_trl.config import oversampling_layout_error

logger = logging.getLogger(__name__)

_LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")
MIN_INFORMATIVE_FRACTION = Fraction(1, 10)  # the least informative fraction an extra round is sized for


def refuse_unsupported_generation(trainer: Any, feature: str) -> None:
    """Refuse ``feature`` (dynamic sampling or Guided Error Correction, which regroup or rewrite a round's completions)
    for anything but single-turn text generation."""
    unsupported = {
        "vision-language models": bool(getattr(trainer, "_is_vlm", False)),
        "tools": bool(trainer.tools),
        "rollout_func": trainer.rollout_func is not None,
        "environment_factory": trainer.environment_factories is not None,
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"{feature} does not support {used[0]}; turn one of them off.")


def first_round_extra_groups(oversample: float, target: int, processes: int) -> int:
    """The groups an oversampled first round adds to ``target``, rounded up to a multiple of ``processes``."""
    extra = math.ceil((Fraction(repr(float(oversample))) - 1) * target)
    return math.ceil(extra / processes) * processes if extra > 0 else 0


def largest_oversample(distinct: int, target: int, processes: int) -> Fraction | None:
    """The largest ``dynamic_sampling_oversample`` (three decimals) whose first round fits ``distinct`` prompts."""
    room = (distinct - target) // processes * processes
    return Fraction(math.floor((1 + Fraction(room, target)) * 1000), 1000) if room > 0 else None


def filter_mismatch(args: Any) -> str | None:
    """What DAPO's filter drops that the estimator learns from, or keeps that it ignores; ``None`` if neither."""
    estimator, metric = args.advantage_estimator, args.dynamic_sampling_metric
    if estimator == "egpo":
        learns = {"entirely incorrect": bool(args.egpo_nsr), "entirely correct": False}
    elif estimator == "nsr":
        learns = {"entirely incorrect": True, "entirely correct": args.nsr_positive_weight != 0}
    else:
        return None
    dropped = [kind for kind, learned in learns.items() if learned]
    kept = [kind for kind, learned in sorted(learns.items()) if not learned] if metric == "reward" else []
    which = " whose total rewards are all equal" if metric == "reward" else ""
    parts = [f"it drops the {' and '.join(dropped)} groups{which}, which {estimator} learns from"] if dropped else []
    if kept:
        parts.append(f"it keeps the {' and '.join(kept)} groups whose other rewards differ, which {estimator} gives no "
                     "advantage")  # fmt: skip
    if not parts:
        return None
    return (
        f"dynamic_sampling keeps the groups that are informative under GRPO (dynamic_sampling_metric={metric!r}), "
        f"whatever the estimator: with advantage_estimator={estimator!r} {'; '.join(parts)}."
    )


def first_round_groups(args: Any, processes: int) -> tuple[int, int]:
    """``(G, extra)``: a generation batch's groups over ``processes`` processes, and those its first round adds."""
    target = args.per_device_train_batch_size * args.steps_per_generation * processes // args.num_generations
    return target, first_round_extra_groups(args.dynamic_sampling_oversample, target, processes)


def colocated_engine_sequences(args: Any, processes: int | None = None) -> tuple[int, bool]:
    """``(max_num_seqs, oversampled)``: the sequences one colocated vLLM engine is started with (with room for an
    oversampled first round)."""
    processes = args.world_size if processes is None else processes
    local_rows = args.per_device_train_batch_size * args.steps_per_generation
    oversampled = args.dynamic_sampling and args.dynamic_sampling_oversample > 1.0
    extra = first_round_groups(args, processes)[1] // processes * args.num_generations if oversampled else 0
    return (local_rows + extra) * args.vllm_tensor_parallel_size, oversampled


def _prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else repr(prompt)


@contextmanager
def vllm_sequences_for_oversampling(args: Any) -> Iterator[None]:
    """Around ``GRPOTrainer.__init__``: start a colocated vLLM engine with room for a whole oversampled first round."""
    sequences, oversampled = colocated_engine_sequences(args)
    if not (oversampled and args.use_vllm and args.vllm_mode == "colocate"):
        yield
        return
    from trl.trainer import grpo_trainer

    original = grpo_trainer.VLLMGeneration

    def build(*pos_args: Any, **kwargs: Any):
        if kwargs.get("max_num_seqs") is not None:
            kwargs["max_num_seqs"] = max(kwargs["max_num_seqs"], sequences)
        return original(*pos_args, **kwargs)

    grpo_trainer.VLLMGeneration = build
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


class DynamicSamplingMixin:
    """DAPO's dynamic sampling over whole generation batches; logs ``dynamic_sampling/*``."""

    def _check_dynamic_sampling(self) -> None:
        refuse_unsupported_generation(self, "dynamic_sampling")
        from datasets import IterableDataset

        if self.train_dataset is None or isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "dynamic_sampling draws extra prompts from train_dataset by index, so it needs a map-style "
                "datasets.Dataset (not an IterableDataset); load the data without streaming, or turn it off."
            )
        error = oversampling_layout_error(self.args)
        if error:
            raise ValueError(error)
        mismatch = filter_mismatch(self.args)
        if mismatch and self.accelerator.is_main_process:
            logger.warning(mismatch)
        args, processes = self.args, self.accelerator.num_processes
        target, extra = first_round_groups(args, processes)
        prompts = self.train_dataset.select_columns(["prompt"])["prompt"] if extra else []
        distinct = len({_prompt_key(prompt) for prompt in prompts})
        if extra and distinct < target + extra:
            largest = largest_oversample(distinct, target, processes)
            fix = (
                f"Lower dynamic_sampling_oversample (at most {float(largest):g} here)" if largest else "Set it to 1.0"
            )
            raise ValueError(
                f"dynamic_sampling_oversample={args.dynamic_sampling_oversample:g} makes the first round {target} + "
                f"{extra} groups, one prompt each, but train_dataset has {distinct} distinct prompts: the round would "
                f"repeat prompts. {fix}, or train on more prompts."
            )

    def _informative_groups(self, rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
        """``bool[G]``: groups that are informative by ``dynamic_sampling_metric``."""
        if self.args.dynamic_sampling_metric == "correctness":
            values = rewards_per_func[:, self._egpo_correctness_index].view(-1, num_generations)
            scored = ~torch.isnan(values)
            n_correct = (self._egpo_correct(rewards_per_func)[0].view(-1, num_generations) & scored).sum(dim=1)
            return (n_correct > 0) & (n_correct < scored.sum(dim=1))
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights).view(-1, num_generations)
        scored = ~torch.isnan(rewards)
        highest = torch.where(scored, rewards, torch.full_like(rewards, -float("inf"))).max(dim=1).values
        lowest = torch.where(scored, rewards, torch.full_like(rewards, float("inf"))).min(dim=1).values
        return (scored.sum(dim=1) >= 2) & (highest > lowest)

    def _dynamic_sampling(self, inputs: list[dict[str, Any]], num_generations: int) -> tuple:
        """Generate rounds until ``G`` groups are informative or the round cap is hit, the batch's own kept first."""
        local_rows = len(inputs)
        processes = self.accelerator.num_processes
        global_rows = local_rows * processes
        target = global_rows // num_generations
        max_rounds = self.args.dynamic_sampling_max_rounds
        rounds: list[dict[str, Any]] = []
        found = generated = 0
        round_inputs = inputs
        first_extra = first_round_extra_groups(self.args.dynamic_sampling_oversample, target, processes)
        draw = self._extra_prompts(inputs)
        if first_extra:
            round_inputs = list(inputs) + self._refill_inputs(first_extra, num_generations, draw)
        marks = []  # the length of each metric list before each round
        for round_index in range(max_rounds):
            marks.append({name: len(values) for name, values in self._metrics["train"].items()})
            groups = len(round_inputs) * processes // num_generations
            output, rewards_per_func, logs = self._round_with_own_logs(round_inputs, groups * num_generations)
            informative = self._informative_groups(rewards_per_func, num_generations)
            record = dict(output=output, rewards_per_func=rewards_per_func, informative=informative, logs=logs)
            order = self._round_group_order(groups, first_extra if round_index == 0 else 0)
            rounds.append({**record, "groups": groups, "order": order})
            found += int(informative.sum().item())
            generated += groups
            if found >= target or round_index + 1 == max_rounds:
                break
            # verl's DAPO sizing: the shortfall over the informative fraction, at most a generation batch.
            extra = math.ceil((target - found) / max(Fraction(found, generated), MIN_INFORMATIVE_FRACTION))
            unit = processes // math.gcd(processes, num_generations)
            extra = min(math.ceil(extra / unit) * unit, target)  # the largest of every process's
            extra = int(self.accelerator.gather(torch.tensor([extra], device=self.accelerator.device)).max())
            round_inputs = self._refill_inputs(extra, num_generations, draw)

        def pick(wanted: bool) -> list[tuple[int, int]]:
            return [
                (r, g) for r, rec in enumerate(rounds) for g in rec["order"] if bool(rec["informative"][g]) == wanted
            ]

        selected = pick(True)[:target]
        cap_hit = len(selected) < target
        if cap_hit:
            fillers = pick(False)[: target - len(selected)]
            if self.accelerator.is_main_process:
                logger.warning(
                    "Dynamic sampling: %d of the %d groups of this generation batch are informative after %d generation "
                    "rounds (dynamic_sampling_max_rounds=%d, step %d); %d uninformative groups fill the batch and "
                    "give no GRPO signal. Raise dynamic_sampling_max_rounds, train on prompts of a better-suited "
                    "difficulty, or set dynamic_sampling=False.",
                    *(len(selected), target, len(rounds), max_rounds, self.state.global_step, len(fillers)),
                )
            selected = selected + fillers

        if rounds[0]["groups"] == target and selected == [(0, g) for g in range(target)]:
            output, rewards_per_func = rounds[0]["output"], rounds[0]["rewards_per_func"]
        else:
            output, rewards_per_func = self._assemble_groups(rounds, selected, num_generations, local_rows)
        self._restore_logs(rounds, selected, num_generations, global_rows)
        self._keep_batch_metrics(marks, sorted({r for r, _ in selected}), output, rewards_per_func, num_generations)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(float(len(rounds)))
        metrics["dynamic_sampling/frac_informative"].append(found / generated)
        metrics["dynamic_sampling/generated_per_kept"].append(generated / target)
        metrics["dynamic_sampling/cap_hit"].append(float(cap_hit))
        sampling = dict(rounds=len(rounds), target_groups=target, round_groups=[r["groups"] for r in rounds])
        sampling.update(first_round_extra_groups=first_extra, informative=[r["informative"] for r in rounds])
        return output, rewards_per_func, {**sampling, "selected": selected, "cap_hit": cap_hit}

    def _keep_batch_metrics(self, marks, used, output, rewards_per_func, num_generations) -> None:
        """Reward and length metrics recomputed for the kept batch; other metrics keep the ``used`` rounds' values."""
        metrics = self._metrics["train"]
        recomputed = self._egpo_reward_metrics(rewards_per_func, num_generations)
        lengths, truncated = output.get("egpo_completion_lengths"), output.get("egpo_completion_truncated")
        if lengths is not None and truncated is not None:
            recomputed.update(self._egpo_length_metrics(lengths, truncated))
        for name in list(metrics):
            # num_tokens is a running total; the memory check is of the run, not of a round
            if name == "num_tokens" or name.startswith("egpo/gpu_memory_"):
                continue
            values = metrics[name]
            starts = [mark.get(name, 0) for mark in marks] + [len(values)]
            if starts[-1] == starts[0]:
                continue
            before = list(values[: starts[0]])
            if name in recomputed:
                kept = [recomputed[name]]
            else:
                kept = [v for r in used for v in values[starts[r] : starts[r + 1]]]
            values[:] = before + kept

    def _egpo_length_metrics(self, lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
        """TRL's ``completions/*`` length metrics of this process's rows ``lengths``/``truncated``, gathered."""
        lengths = self.accelerator.gather(lengths).float()
        truncated = self.accelerator.gather(truncated).bool()
        terminated = lengths[~truncated]
        if terminated.numel() == 0:
            terminated = torch.zeros(1, device=lengths.device)
        values = {"completions/clipped_ratio": truncated.float().mean().item()}
        for kind, rows in (("", lengths), ("terminated_", terminated)):
            values.update(
                {f"completions/{stat}_{kind}length": getattr(rows, stat)().item() for stat in ("mean", "min", "max")}
            )
        return values

    def _egpo_reward_metrics(self, rewards_per_func: torch.Tensor, num_generations: int) -> dict[str, float]:
        """TRL's reward metrics of the global ``rewards_per_func``, as ``GRPOTrainer`` computes them."""
        values: dict[str, float] = {}
        for i, name in enumerate(self.reward_func_names):
            values[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
            values[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights)
        normalized = self.multi_objective_aggregation == "normalize_then_sum"
        if normalized or self.scale_rewards == "batch":
            spread = rewards
            if normalized:
                spread = normalize_then_sum_rewards(rewards_per_func, self.reward_weights, num_generations)
            std = nanstd(spread).expand_as(spread) if spread.numel() > 1 else torch.zeros_like(rewards)
        elif num_generations > 1:
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        else:
            std = torch.zeros_like(rewards)
        values["reward"] = torch.nanmean(rewards).item()
        values["reward_std"] = nanstd(rewards).item()
        values["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
        return values

    def _round_group_order(self, groups: int, extra: int) -> list[int]:
        """The round's gathered group indices in keeping order: the batch's own groups before the ``extra`` added."""
        if not extra:
            return list(range(groups))
        processes = self.accelerator.num_processes
        own, added = (groups - extra) // processes, extra // processes
        block = own + added
        return [p * block + k for p in range(processes) for k in range(own)] + [
            p * block + own + k for p in range(processes) for k in range(added)
        ]

    def _extra_prompts(self, inputs: list[dict[str, Any]]) -> Iterator[int]:
        """``train_dataset`` indices for extra groups in a seeded order, skipping prompts already in the batch."""
        from accelerate.utils import gather_object

        prompts = self.train_dataset.select_columns(["prompt"])
        taken = set(gather_object([_prompt_key(row.get("prompt")) for row in inputs]))
        seed = (self.args.seed + 1) * 1_000_003 + self.state.global_step * 1_009 + getattr(self, "_step", 0) * 7_919
        generator = torch.Generator().manual_seed(seed)
        while True:
            drawn = False
            for index in torch.randperm(len(prompts), generator=generator).tolist():
                key = _prompt_key(prompts[index]["prompt"])
                if key in taken:
                    continue
                taken.add(key)
                drawn = True
                yield index
            if not drawn:
                if not taken:
                    raise ValueError("dynamic_sampling cannot draw extra prompts: train_dataset is empty.")
                taken = set()

    def _refill_inputs(self, num_groups: int, num_generations: int, draw: Iterator[int]) -> list[dict[str, Any]]:
        """This process's rows of ``num_groups`` prompts from ``draw``, split as TRL's sampler splits a batch."""
        local_rows = num_groups * num_generations // self.accelerator.num_processes
        prompts = [next(draw) for _ in range(num_groups)]
        start = self.accelerator.process_index * local_rows
        return [dict(self.train_dataset[prompts[row // num_generations]]) for row in range(start, start + local_rows)]

    def _pad_value(self, key: str) -> int | float:
        if key in ("prompt_ids", "completion_ids"):
            return self._tokenizer.pad_token_id
        return 1 if key == "tool_mask" else 0

    def _assemble_groups(self, rounds, selected, num_generations: int, local_rows: int):
        """``(this process's rows, gathered rewards)`` of the batch made of the ``selected`` (round, group) pairs."""
        first = rounds[0]["output"]
        first_rows = rounds[0]["groups"] * num_generations // self.accelerator.num_processes
        keys = [
            k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.size(0) == first_rows
        ]
        used = sorted({r for r, _ in selected})
        offset, start_row = {}, 0
        for r in used:
            offset[r], start_row = start_row, start_row + rounds[r]["groups"] * num_generations
        rows = torch.tensor([offset[r] + g * num_generations + j for r, g in selected for j in range(num_generations)])
        start = self.accelerator.process_index * local_rows
        output = {}
        for key in keys:
            gathered = []
            for r in used:
                t = rounds[r]["output"][key]
                if t.dim() >= 2:
                    t = self.accelerator.pad_across_processes(
                        t, dim=1, pad_index=self._pad_value(key), pad_first=key in _LEFT_PADDED_KEYS
                    )
                gathered.append(self.accelerator.gather(t))
            if gathered[0].dim() >= 2:  # per-token tensors: one width across the rounds
                width = max(t.size(1) for t in gathered)
                gathered = [self._pad_width(key, t, width) for t in gathered]
            merged = torch.cat(gathered, dim=0)
            output[key] = merged[rows.to(merged.device)][start : start + local_rows]
        tool_mask = output.get("tool_mask")
        loss_mask = output["completion_mask"] * (tool_mask if tool_mask is not None else 1)
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        rewards = torch.cat([rounds[r]["rewards_per_func"] for r in used], dim=0)
        return output, rewards[rows.to(rewards.device)]

    def _pad_width(self, key: str, t: torch.Tensor, width: int) -> torch.Tensor:
        missing = width - t.size(1)
        if not missing:
            return t
        fill = torch.full((t.size(0), missing, *t.shape[2:]), self._pad_value(key), dtype=t.dtype, device=t.device)
        return torch.cat([fill, t] if key in _LEFT_PADDED_KEYS else [t, fill], dim=1)

    def _round_with_own_logs(self, inputs: list[dict[str, Any]], global_rows: int) -> tuple:
        """One generation round with TRL's completions-table logs emptied for it: ``(output, rewards_per_func, logs)``,
        ``logs`` the round's entries (``None``: a column it did not log)."""
        logs = self._logs

        def column():
            return deque(maxlen=global_rows)

        def tail(values) -> list | None:
            return list(values) if len(values) >= global_rows else None

        self._logs = own = {name: defaultdict(column) if isinstance(v, dict) else column() for name, v in logs.items()}
        try:
            output, rewards_per_func = self._generate_round(inputs)
        finally:
            self._logs = logs
        snapshot = {part: tail(own[part]) for part in ("prompt", "completion", "advantages")}
        for part in ("rewards", "extra"):
            snapshot[part] = {name: tail(values) for name, values in own[part].items()}
            for name in own[part]:
                logs[part][name]  # noqa: B018 (a defaultdict: creates the name's deque)
        return output, rewards_per_func, snapshot

    def _restore_logs(self, rounds, selected, num_generations: int, global_rows: int) -> None:
        """Make the completions table (a generation batch's ``global_rows`` rows) show the kept rows."""
        rows = [(r, g * num_generations + j) for r, g in selected for j in range(num_generations)]

        def replace(target, snapshots: list) -> None:
            for _ in range(min(len(target), global_rows)):
                target.pop()
            target.extend(snapshots[r][i] if snapshots[r] is not None else None for r, i in rows)

        for part in ("prompt", "completion", "advantages"):
            replace(self._logs[part], [record["logs"][part] for record in rounds])
        for part in ("rewards", "extra"):
            for name, values in self._logs[part].items():
                replace(values, [record["logs"][part].get(name) for record in rounds])
