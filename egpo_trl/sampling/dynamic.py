"""DAPO's dynamic sampling, as a mixin of :class:`~egpo_trl.trainer.EGPOTrainer`.

With ``dynamic_sampling=True`` the trainer generates extra rounds for prompts drawn from the training set until
the generation batch is made of informative groups (``dynamic_sampling_metric``: groups whose completions are
not all correct nor all incorrect, or whose rewards are not all equal), up to ``dynamic_sampling_max_rounds``
rounds. An extra round generates only the shortfall: the missing groups divided by the fraction of informative
groups seen so far in this generation batch (never more than a generation batch). With
``dynamic_sampling_oversample`` > 1 the first round also generates extra groups for prompts drawn from the training
set, so that one round usually suffices: at long lengths a round lasts until its longest completion ends, reading
the weights at each decode step however few its sequences, so a larger first round can cost less than a second
one. The decision is taken on gathered tensors, so every process keeps the same groups and runs the same rounds
with the same number of rows,
and the batch keeps its shape: TRL's dataloader, epochs, buffering, shuffling and ``num_iterations`` see a normal
generation batch.

Why a mixin: the feature needs the trainer's state (the accelerator, the metrics, the completions table, TRL's
generation and scoring of one round), so its methods live on the trainer, but in a class of their own that
overrides nothing of ``GRPOTrainer``. ``EGPOTrainer._generate_and_score_completions`` calls
:meth:`DynamicSamplingMixin._dynamic_sampling` when the feature is on; the mixin calls back into the trainer
for one generation round (``_generate_round``), for correctness (``_egpo_correct``,
``_egpo_correctness_index``) and to agree on a count across processes (``_egpo_same_count_across_processes``).
``tests/test_dynamic_sampling.py`` tests it.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import torch

from egpo_trl.advantages import weighted_reward_sum
from egpo_trl.config import oversampling_layout_error
from egpo_trl.sampling.common import refuse_unsupported_generation

logger = logging.getLogger(__name__)

__all__ = [
    "DynamicSamplingMixin",
    "colocated_engine_sequences",
    "filter_mismatch",
    "first_round_extra_groups",
    "first_round_groups",
    "largest_oversample",
    "oversampled_max_num_seqs",
    "vllm_sequences_for_oversampling",
]

# Batch tensors that are left-padded (the prompt side); every other per-token tensor is right-padded.
_LEFT_PADDED_KEYS = ("prompt_ids", "prompt_mask")
# The informative fraction an extra round is sized with when fewer groups than this were informative so far: a
# batch without (or with almost no) informative groups asks for a whole generation batch, not a division by zero.
MIN_INFORMATIVE_FRACTION = Fraction(1, 10)


def first_round_extra_groups(oversample: float, target: int, processes: int) -> int:
    """The groups dynamic sampling's first round adds to a generation batch of ``target`` groups
    (``dynamic_sampling_oversample``): ``ceil((oversample - 1) * target)``, rounded up to a multiple of ``processes``
    so that each process adds whole groups; 0 without oversampling. ``oversample`` is read as written (1.1 is
    11/10)."""
    extra = math.ceil((Fraction(repr(float(oversample))) - 1) * target)
    return math.ceil(extra / processes) * processes if extra > 0 else 0


def largest_oversample(distinct: int, target: int, processes: int) -> Fraction | None:
    """The largest ``dynamic_sampling_oversample`` of three decimals whose first round adds at least one group and
    needs at most ``distinct`` prompts (``target`` groups plus :func:`first_round_extra_groups`), or ``None``."""
    room = (distinct - target) // processes * processes  # the most groups a first round can add
    if room <= 0:
        return None
    return Fraction(math.floor((1 + Fraction(room, target)) * 1000), 1000)


def filter_mismatch(args: Any) -> str | None:
    """What DAPO's filter, which judges groups as GRPO does, drops that the run's estimator learns from, or keeps that
    it gives no advantage; ``None`` when they agree.

    ``egpo`` gives an entirely correct group no advantage, and an entirely incorrect one an advantage when
    ``egpo_nsr`` is on; ``nsr`` gives an entirely incorrect group an advantage, and an entirely correct one when
    ``nsr_positive_weight`` is not 0. ``dynamic_sampling_metric="correctness"`` drops both kinds;
    ``"reward"`` drops those whose total rewards are all equal and keeps the others.
    """
    estimator, metric = args.advantage_estimator, args.dynamic_sampling_metric
    if estimator == "egpo":
        learns = {"entirely incorrect": bool(args.egpo_nsr), "entirely correct": False}
    elif estimator == "nsr":
        learns = {"entirely incorrect": True, "entirely correct": args.nsr_positive_weight != 0}
    else:
        return None
    dropped = [kind for kind, learned in learns.items() if learned]
    kept = [kind for kind, learned in sorted(learns.items()) if not learned] if metric == "reward" else []
    parts = []
    if dropped:
        which = " whose total rewards are all equal" if metric == "reward" else ""
        parts.append(f"it drops the {' and '.join(dropped)} groups{which}, which {estimator} learns from")
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
    """``(G, extra)``: the groups of a generation batch over ``processes`` processes, and those an oversampled first
    round adds to them (:func:`first_round_extra_groups`)."""
    target = args.per_device_train_batch_size * args.steps_per_generation * processes // args.num_generations
    return target, first_round_extra_groups(args.dynamic_sampling_oversample, target, processes)


def oversampled_max_num_seqs(args: Any, processes: int | None = None) -> int:
    """The sequences one colocated vLLM engine receives in an oversampled first round: this process's share of the
    generation batch plus its share of the added groups, times the tensor-parallel group that gathers its prompts
    (TRL 1.16 starts the engine with ``per_device_train_batch_size x vllm_tensor_parallel_size x
    steps_per_generation``, the same without the added groups). ``processes``: the run's (default
    ``args.world_size``; the dry run parses the config on one process and passes the launch's)."""
    processes = args.world_size if processes is None else processes
    _, extra = first_round_groups(args, processes)
    local_rows = args.per_device_train_batch_size * args.steps_per_generation
    return (local_rows + extra // processes * args.num_generations) * args.vllm_tensor_parallel_size


def colocated_engine_sequences(args: Any, processes: int | None = None) -> tuple[int, bool]:
    """``(max_num_seqs, oversampled)``: the sequences one colocated vLLM engine is started with, the most it
    schedules at once (fewer decode at once where its KV cache holds fewer). A generation batch's share of this
    process times the tensor-parallel group, or an oversampled first round's (:func:`oversampled_max_num_seqs`)."""
    if args.dynamic_sampling and args.dynamic_sampling_oversample > 1.0:
        return oversampled_max_num_seqs(args, processes), True
    return args.per_device_train_batch_size * args.steps_per_generation * args.vllm_tensor_parallel_size, False


def _prompt_key(prompt: Any) -> str:
    """A prompt (text or conversation) as a comparable string."""
    return prompt if isinstance(prompt, str) else repr(prompt)


def _distinct_prompts(dataset: Any, enough: int | None = None) -> int:
    """The number of distinct prompts of ``dataset`` (its ``prompt`` column), counting stops at ``enough``."""
    seen: set[str] = set()
    prompts = dataset.select_columns(["prompt"])["prompt"]  # (TRL takes a datasets.Dataset only)
    for prompt in prompts:
        seen.add(_prompt_key(prompt))
        if enough is not None and len(seen) >= enough:
            break
    return len(seen)


@contextmanager
def vllm_sequences_for_oversampling(args: Any) -> Iterator[None]:
    """Wrap ``GRPOTrainer.__init__`` so that a colocated vLLM engine takes a whole oversampled first round at once.

    TRL 1.16 starts the colocated engine with ``max_num_seqs`` = ``per_device_train_batch_size x
    vllm_tensor_parallel_size x steps_per_generation``, a generation batch's share. With
    ``dynamic_sampling_oversample`` > 1 the first round holds more sequences, which would then decode in two waves,
    each as long as the longest completion: the round would cost about what an extra round costs. Inside this
    context the engine is built with the first round's share instead (:func:`oversampled_max_num_seqs`). A no-op
    otherwise, and in server mode, where the server's engine takes whatever it is sent.
    """
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
    """DAPO's dynamic sampling over whole generation batches (``dynamic_sampling=True``).

    Methods only, for a ``GRPOTrainer`` subclass that provides ``_generate_round(inputs) -> (output,
    rewards_per_func)``, ``_egpo_correct``, ``_egpo_correctness_index`` and ``_egpo_same_count_across_processes``
    (:class:`~egpo_trl.trainer.EGPOTrainer`).
    Logs ``dynamic_sampling/rounds``, ``dynamic_sampling/frac_informative``, ``dynamic_sampling/generated_per_kept``
    and ``dynamic_sampling/cap_hit``.
    """

    def _check_dynamic_sampling(self) -> None:
        """Refuse, at init, what dynamic sampling does not support."""
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
        args = self.args
        processes = self.accelerator.num_processes
        target, extra = first_round_groups(args, processes)
        needed = target + extra
        if extra and _distinct_prompts(self.train_dataset, needed) < needed:
            distinct = _distinct_prompts(self.train_dataset)
            largest = largest_oversample(distinct, target, processes)
            fix = (
                f"Lower dynamic_sampling_oversample (at most {float(largest):g} here), or train on more prompts."
                if largest is not None
                else "Set dynamic_sampling_oversample: 1.0, or train on more prompts."
            )
            raise ValueError(
                f"dynamic_sampling_oversample={args.dynamic_sampling_oversample:g} makes the first round {target} + "
                f"{extra} groups, one prompt each, but train_dataset has {distinct} distinct prompts: the round would "
                f"repeat prompts. {fix}"
            )

    def _informative_groups(self, rewards_per_func: torch.Tensor, num_generations: int) -> torch.Tensor:
        """``bool Tensor[G]``: which groups carry a learning signal under GRPO (``dynamic_sampling_metric``).

        ``"correctness"``: the group's scored completions are neither all correct nor all incorrect according to
        the correctness reward function. ``"reward"``: its scored completions do not all have the same total
        reward. A group with fewer than two scored completions is uninformative.
        """
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

    def _dynamic_sampling(
        self, inputs: list[dict[str, Any]], num_generations: int
    ) -> tuple[dict[str, Any], torch.Tensor, dict[str, Any]]:
        """DAPO's dynamic sampling: the generation batch ``inputs``, then extra rounds for the missing groups.

        Generates ``inputs`` as TRL would (with :meth:`_first_round_extra_groups` more groups for prompts drawn from
        ``train_dataset`` when ``dynamic_sampling_oversample`` > 1), then, while fewer than ``G`` groups (the
        generation batch's number of groups) are informative, another round for prompts drawn from
        ``train_dataset``, up to ``dynamic_sampling_max_rounds`` rounds in all. An extra round is sized by
        :meth:`_extra_round_groups` (the shortfall over the informative fraction seen so far, at most ``G``
        groups). The first ``G`` informative groups, in generation order (in the first round the generation
        batch's own groups first: :meth:`_round_group_order`), make the batch; when the cap stops the search,
        uninformative groups (first round first) fill it and a warning is logged. Decisions use the gathered
        rewards, so every process keeps the same groups and generates the same rounds with the same number of rows;
        rows move between processes as needed, and each keeps its usual number of rows.
        """
        local_rows = len(inputs)
        processes = self.accelerator.num_processes
        global_rows = local_rows * processes
        target = global_rows // num_generations
        max_rounds = self.args.dynamic_sampling_max_rounds
        rounds: list[dict[str, Any]] = []
        found = generated = 0
        round_inputs = inputs
        first_extra = self._first_round_extra_groups(target)
        draw = self._extra_prompts(inputs)
        if first_extra:  # the generation batch's groups, then this process's share of the extra ones
            round_inputs = list(inputs) + self._refill_inputs(first_extra, num_generations, draw)
        marks = []  # the length of each of TRL's metric lists before each round
        for round_index in range(max_rounds):
            marks.append({name: len(values) for name, values in self._metrics["train"].items()})
            groups = len(round_inputs) * processes // num_generations
            with self._logs_for_round(groups * num_generations):  # the round's own completions-table rows
                output, rewards_per_func = self._generate_round(round_inputs)
                logs = self._snapshot_logs(groups * num_generations)
            informative = self._informative_groups(rewards_per_func, num_generations)
            rounds.append(
                {
                    "output": output,
                    "rewards_per_func": rewards_per_func,
                    "informative": informative,
                    "groups": groups,
                    "order": self._round_group_order(groups, first_extra if round_index == 0 else 0),
                    "logs": logs,
                }
            )
            found += int(informative.sum().item())
            generated += groups
            if found >= target or round_index + 1 == max_rounds:
                break
            extra = self._extra_round_groups(target - found, Fraction(found, generated), target, num_generations)
            round_inputs = self._refill_inputs(extra, num_generations, draw)

        selected = [(r, g) for r, record in enumerate(rounds) for g in record["order"] if record["informative"][g]][
            :target
        ]
        cap_hit = len(selected) < target
        if cap_hit:
            fillers = [
                (r, g) for r, record in enumerate(rounds) for g in record["order"] if not record["informative"][g]
            ]
            fillers = fillers[: target - len(selected)]
            if self.accelerator.is_main_process:
                logger.warning(
                    "Dynamic sampling: %d of the %d groups of this generation batch are informative after %d generation "
                    "rounds (dynamic_sampling_max_rounds=%d, step %d); %d uninformative groups fill the batch and "
                    "give no GRPO signal. Raise dynamic_sampling_max_rounds, train on prompts of a better-suited "
                    "difficulty, or set dynamic_sampling=False.",
                    len(selected),
                    target,
                    len(rounds),
                    max_rounds,
                    self.state.global_step,
                    len(fillers),
                )
            selected = selected + fillers

        if rounds[0]["groups"] == target and selected == [(0, g) for g in range(target)]:  # informative throughout
            output, rewards_per_func = rounds[0]["output"], rounds[0]["rewards_per_func"]
        else:
            output, rewards_per_func = self._assemble_groups(rounds, selected, num_generations, local_rows)
        # The rounds logged into deques of their own (_logs_for_round): the kept rows go into TRL's.
        self._restore_logs(rounds, selected, num_generations, global_rows)

        self._keep_batch_metrics(marks, sorted({r for r, _ in selected}), output, rewards_per_func, num_generations)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(float(len(rounds)))
        metrics["dynamic_sampling/frac_informative"].append(found / generated)
        metrics["dynamic_sampling/generated_per_kept"].append(generated / target)
        metrics["dynamic_sampling/cap_hit"].append(float(cap_hit))
        sampling = {
            "rounds": len(rounds),
            "target_groups": target,
            "round_groups": [record["groups"] for record in rounds],
            "first_round_extra_groups": first_extra,
            "informative": [record["informative"] for record in rounds],
            "selected": selected,
            "cap_hit": cap_hit,
        }
        return output, rewards_per_func, sampling

    def _keep_batch_metrics(
        self,
        marks: list[dict[str, int]],
        used: list[int],
        output: dict[str, Any],
        rewards_per_func: torch.Tensor,
        num_generations: int,
    ) -> None:
        """Make the metrics that TRL (and the reward functions, and Guided Error Correction) logged during the rounds
        describe the batch that is trained on.

        The completion-length metrics (``completions/*``) and the reward metrics (``reward``, ``reward_std``,
        ``frac_reward_zero_std``, ``rewards/<name>/mean|std``) are computed again for the assembled batch, once. Any
        other metric logged per round keeps the values of the rounds that contributed a group to the batch and
        drops those of the rounds that were discarded entirely. ``marks`` holds the length of each metric list
        before each round.
        """
        metrics = self._metrics["train"]
        recomputed = self._egpo_reward_metrics(rewards_per_func, num_generations)
        lengths, truncated = output.get("egpo_completion_lengths"), output.get("egpo_completion_truncated")
        if lengths is not None and truncated is not None:
            recomputed.update(self._egpo_length_metrics(lengths, truncated))
        for name in list(metrics):
            values = metrics[name]
            if name == "num_tokens":  # a running total TRL sets (not appends): every generated token counts
                continue
            if name.startswith("egpo/gpu_memory_"):  # the first generation's memory check: of the run, not a round
                continue
            starts = [mark.get(name, 0) for mark in marks] + [len(values)]
            if starts[-1] == starts[0]:
                continue  # nothing logged during the rounds
            before = list(values[: starts[0]])
            if name in recomputed:
                kept = [recomputed[name]]
            else:
                kept = [v for r in used for v in values[starts[r] : starts[r + 1]]]
            values[:] = before + kept

    def _first_round_extra_groups(self, target: int) -> int:
        """:func:`first_round_extra_groups` for this run: the groups its first round adds to the generation batch's
        ``target``."""
        return first_round_extra_groups(self.args.dynamic_sampling_oversample, target, self.accelerator.num_processes)

    def _round_group_order(self, groups: int, extra: int) -> list[int]:
        """The round's gathered group indices in the order groups are kept: in generation order, but in a first round
        with ``extra`` added groups, the generation batch's own groups first (in TRL's order), then the added ones.
        Each process's rows are its share of the batch's groups followed by its share of the added ones."""
        if not extra:
            return list(range(groups))
        processes = self.accelerator.num_processes
        own, added = (groups - extra) // processes, extra // processes
        block = own + added
        return [p * block + k for p in range(processes) for k in range(own)] + [
            p * block + own + k for p in range(processes) for k in range(added)
        ]

    def _extra_round_groups(self, missing: int, fraction: Fraction, target: int, num_generations: int) -> int:
        """The number of groups (prompts) the next round generates, the same on every process.

        ``ceil(missing / max(fraction, MIN_INFORMATIVE_FRACTION))``, where ``fraction`` is the informative
        fraction of the groups generated so far for this generation batch (as verl's DAPO recipe sizes its
        generation batch from the expected informative fraction), rounded up so that the round's rows split evenly
        across processes, and at most ``target`` (a generation batch, whose memory use is known to fit). Computed
        exactly (fractions) from gathered counts, then agreed on across processes (the largest), so every process
        runs the same generation calls with the same number of prompts.
        """
        groups = math.ceil(missing / max(fraction, MIN_INFORMATIVE_FRACTION))
        unit = self.accelerator.num_processes // math.gcd(self.accelerator.num_processes, num_generations)
        groups = min(math.ceil(groups / unit) * unit, target)
        return self._egpo_same_count_across_processes(groups)

    def _extra_prompts(self, inputs: list[dict[str, Any]]) -> Iterator[int]:
        """The ``train_dataset`` indices of the prompts of one generation batch's extra groups, in the order they are
        drawn, the same on every process and again after resuming.

        A seeded random order of the training set (from ``seed``, the global step and the micro-step) that skips the
        prompts of the generation batch itself (on every process) and any prompt already drawn for the batch,
        compared by their text (a prompt stored in several rows is one prompt). Once every distinct prompt has been
        used it starts again, with repeats. TRL's own dataloader is not advanced.
        """
        from accelerate.utils import gather_object

        # A generator: the gather below runs at the first draw, which every process reaches at the same point (the
        # rounds are decided on gathered rewards), and not at all in a batch that needs no extra prompt.
        prompts = self.train_dataset.select_columns(["prompt"])  # other columns (images) are not read
        taken = set(gather_object([_prompt_key(row.get("prompt")) for row in inputs]))
        # Seeded by the micro-step too: with steps_per_generation < gradient_accumulation_steps one optimizer step
        # generates several batches, which must not draw the same extra prompts.
        micro_step = getattr(self, "_step", 0)
        generator = torch.Generator().manual_seed(
            (self.args.seed + 1) * 1_000_003 + self.state.global_step * 1_009 + micro_step * 7_919
        )
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
                taken = set()  # every distinct prompt has been used: draw again from all of them

    def _refill_inputs(self, num_groups: int, num_generations: int, draw: Iterator[int]) -> list[dict[str, Any]]:
        """This process's rows of an extra round of ``num_groups`` prompts taken from ``draw``
        (:meth:`_extra_prompts`).

        Each prompt is repeated ``num_generations`` times and the round's rows are split across processes exactly
        as TRL's sampler splits a generation batch (``num_groups * num_generations`` must be a multiple of the
        number of processes).
        """
        dataset = self.train_dataset
        local_rows = num_groups * num_generations // self.accelerator.num_processes
        prompts = [next(draw) for _ in range(num_groups)]
        start = self.accelerator.process_index * local_rows
        return [dict(dataset[prompts[row // num_generations]]) for row in range(start, start + local_rows)]

    def _gather_rows(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this process's rows) gathered over processes, per-token tensors padded to a common width."""
        if tensor.dim() >= 2:
            pad_value = self._pad_value(key)
            tensor = self.accelerator.pad_across_processes(
                tensor, dim=1, pad_index=pad_value, pad_first=key in _LEFT_PADDED_KEYS
            )
        return self.accelerator.gather(tensor)

    def _pad_value(self, key: str) -> int | float:
        if key in ("prompt_ids", "completion_ids"):
            return self._tokenizer.pad_token_id
        if key == "tool_mask":
            return 1
        return 0

    def _assemble_groups(
        self, rounds: list[dict[str, Any]], selected: list[tuple[int, int]], num_generations: int, local_rows: int
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """The batch made of the ``selected`` (round, group) pairs: this process's rows and the gathered rewards."""
        first = rounds[0]["output"]
        # The first round's rows on this process (more than local_rows when it was oversampled).
        first_rows = rounds[0]["groups"] * num_generations // self.accelerator.num_processes
        keys = [
            k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.size(0) == first_rows
        ]
        others = [k for k, v in first.items() if k not in keys and k != "num_items_in_batch"]
        if others:
            raise ValueError(f"dynamic_sampling cannot regroup the batch entries {others} (multimodal inputs?).")
        used = sorted({r for r, _ in selected})  # rounds that contribute a group; the others are never gathered
        offset, start_row = {}, 0  # where each used round's rows start in the concatenation of the used rounds
        for r in used:
            offset[r], start_row = start_row, start_row + rounds[r]["groups"] * num_generations
        rows = torch.tensor(
            [offset[r] + g * num_generations + j for r, g in selected for j in range(num_generations)],
            dtype=torch.long,
        )
        start = self.accelerator.process_index * local_rows
        output = {}
        for key in keys:
            gathered = [self._gather_rows(key, rounds[r]["output"][key]) for r in used]
            if gathered[0].dim() >= 2:
                width = max(t.size(1) for t in gathered)
                padded = []
                for t in gathered:
                    missing = width - t.size(1)
                    if missing:
                        fill = torch.full(
                            (t.size(0), missing, *t.shape[2:]), self._pad_value(key), dtype=t.dtype, device=t.device
                        )
                        t = torch.cat([fill, t] if key in _LEFT_PADDED_KEYS else [t, fill], dim=1)
                    padded.append(t)
                gathered = padded
            merged = torch.cat(gathered, dim=0)
            output[key] = merged[rows.to(merged.device)][start : start + local_rows]
        loss_mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            loss_mask = loss_mask * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        rewards = torch.cat([rounds[r]["rewards_per_func"] for r in used], dim=0)
        return output, rewards[rows.to(rewards.device)]

    @contextmanager
    def _logs_for_round(self, global_rows: int) -> Iterator[None]:
        """Give TRL's completions-table logs empty deques of the round's ``global_rows`` rows while it generates.

        Inside the block TRL's scoring writes exactly what this round logged, so :meth:`_snapshot_logs` (taken inside
        the block) holds the round's rows in full (an oversampled first round is longer than TRL's deques, a
        generation batch) and knows which columns the round did not log (a reward's ``log_extra`` in some calls
        only), rather than reading an earlier step's or round's entries. Afterwards, whether or not the round raised,
        TRL's own deques come back, unchanged; after a successful round they also hold every reward and column name
        the round logged, and :meth:`_restore_logs` writes the kept batch's rows into them."""
        logs = self._logs

        def fresh(values):
            return (
                defaultdict(lambda: deque(maxlen=global_rows))
                if isinstance(values, dict)
                else deque(maxlen=global_rows)
            )

        self._logs = {name: fresh(values) for name, values in logs.items()}
        try:
            yield
            for part in ("rewards", "extra"):
                for name in self._logs[part]:
                    logs[part][name]  # noqa: B018 (a defaultdict: creates the name's deque)
        finally:
            self._logs = logs

    def _snapshot_logs(self, global_rows: int) -> dict[str, Any]:
        """The completions-table entries TRL logged for the last generation round (its ``global_rows`` rows)."""

        def tail(values) -> list | None:  # None: the round did not log this column
            return list(values)[-global_rows:] if len(values) >= global_rows else None

        logs = self._logs
        return {
            "prompt": tail(logs["prompt"]),
            "completion": tail(logs["completion"]),
            "advantages": tail(logs["advantages"]),
            "rewards": {name: tail(values) for name, values in logs["rewards"].items()},
            "extra": {name: tail(values) for name, values in logs["extra"].items()},
        }

    def _restore_logs(
        self, rounds: list[dict[str, Any]], selected: list[tuple[int, int]], num_generations: int, global_rows: int
    ) -> None:
        """Make the completions table show the rows of the assembled batch, not those of the rounds.

        ``global_rows`` is the generation batch's size, the table's length: its entries are all this batch's.
        """
        rows = [(r, g * num_generations + j) for r, g in selected for j in range(num_generations)]

        def replace(target, name_path: tuple[str, ...]) -> None:
            snapshots = []
            for record in rounds:
                snapshot = record["logs"]
                for part in name_path:
                    snapshot = snapshot.get(part) if isinstance(snapshot, dict) else None
                snapshots.append(snapshot)
            for _ in range(min(len(target), global_rows)):
                target.pop()
            # A column some round did not log (a reward's log_extra in some calls only) gets None on that round's
            # rows: every column keeps the table's length.
            target.extend(snapshots[r][i] if snapshots[r] is not None else None for r, i in rows)

        replace(self._logs["prompt"], ("prompt",))
        replace(self._logs["completion"], ("completion",))
        replace(self._logs["advantages"], ("advantages",))
        for name, values in self._logs["rewards"].items():
            replace(values, ("rewards", name))
        for name, values in self._logs["extra"].items():
            replace(values, ("extra", name))
