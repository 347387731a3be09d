"""The old policy's log-probs from the loss's own forward (``egpo_entropy_logps="loss_forward"``).

With one optimizer step per generation batch and no importance-sampling correction, TRL computes no old-policy
log-probs: the loss's forward runs with the weights that sampled the batch, and TRL takes its log-probs, detached,
as pi_old's. EGPO's weights need pi_old's log-probs of every completion of a group before any of them is trained
on, so by default (``"policy"``) the trainer runs one no-grad pass over the generation batch first: a forward of
every row, about a quarter of the training's FLOPs with gradient checkpointing.

``"loss_forward"`` takes them from the loss's own forwards instead:

* the rows of the generation batch are grouped so that a *block* of consecutive micro-batches holds whole groups
  (``lcm(per_device_train_batch_size, num_generations) / per_device_train_batch_size`` micro-batches; TRL shuffles
  the rows first, as usual, and the groups keep the order in which they first appear);
* the micro-batches of a block run their forwards only; the last one's step then computes EGPO's weights from their
  log-probs and TRL's loss of each micro-batch with the weighted advantages, and runs each loss's backward as soon
  as it is computed (every scaling is linear, so the gradient is the one of a backward per micro-batch). The
  accumulation boundary stays at the generation batch's last micro-batch: the earlier micro-batches' backwards run
  as accumulation steps, the last one's in the trainer's own step. One backward of the losses' sum would give the
  same gradient, but it holds every parameter's partial gradient, a whole unsharded gradient, until the block's
  first micro-batch reaches it, and DeepSpeed reduces nothing before then (enough to run out of memory at the 7B
  shapes under ZeRO-2). Under DDP (not DeepSpeed), whose gradient synchronisation is armed by the forward, the
  block still runs one backward of the sum, and so holds that extra gradient. A step stopped by an exception inside a
  block may leave the block's earlier micro-batches' gradients accumulated (``Trainer.train`` zeroes them when it
  starts again);
* a block holds the forwards of all its micro-batches at once: with gradient checkpointing, each layer's input of
  each row (``rows x tokens x hidden_size x 2`` bytes per layer in bf16);
* with ``egpo_length_sorted_micro_batches`` and ``egpo_loss_forward_block_tokens``, a block may hold several of those
  smallest blocks (:func:`merged_blocks`: one joins the block before it where that cuts the padding the block's
  forwards compute, within the token budget, decided from every process's lengths so that all processes run the
  same blocks), and its rows are sorted by length across its groups; the estimator then takes each group's rows
  together and its weights go back to the block's order.

Mixed-group base advantages (which ``scale_rewards="batch"`` computes from the whole batch) are computed when the
batch is scored; only the weights, which depend on a group's own rows, wait for the loss's forwards.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from egpo_trl.old_logps import FORWARD_KEYS

logger = logging.getLogger(__name__)

__all__ = [
    "block_memory_note",
    "block_size",
    "group_first_order",
    "length_sorted_order",
    "merged_block_memory_note",
    "merged_blocks",
    "padded_tokens",
    "reorder_rows",
    "row_lengths",
    "shuffle_then",
]

#: Global group index of each row (0, 0, ..., 1, 1, ... in the generation batch's order before TRL shuffles it).
GROUP_KEY = "egpo_fused_group"
#: The weighted reward sum (NaN where no reward function scored the row).
REWARD_KEY = "egpo_fused_reward"
#: 1.0 correct, 0.0 incorrect, NaN without a correctness verdict.
CORRECT_KEY = "egpo_fused_correct"
#: The tokens EGPO's entropy proxy averages over (the completion, or its thinking/answer segment).
MASK_KEY = "egpo_fused_mask"
#: Each row's index among this process's rows of the generation batch.
ROW_KEY = "egpo_fused_row"
#: What the loss's forward must not see: the keys above.
FUSED_KEYS = (GROUP_KEY, REWARD_KEY, CORRECT_KEY, MASK_KEY, ROW_KEY)


#: The DeepSpeed release line ``loss_forward`` was checked with (benchmarks/loss_forward_check.py, ZeRO-2 and ZeRO-3,
#: 0.19.8, on the CPU and on GPUs). Its ZeRO optimizers close a gradient-accumulation micro-step at the next forward
#: (``clear_backward_seen_flag``), which the block calls itself after each of its backwards. Earlier releases were not
#: checked: on the CPU 0.17.6 and 0.18.9 did not even run the no-grad pass's training correctly (with torch 2.13).
DEEPSPEED_CHECKED = "0.19"


def deepspeed_problem() -> str | None:
    """Why the installed DeepSpeed cannot serve ``loss_forward`` (a release older than :data:`DEEPSPEED_CHECKED`), or
    ``None`` (a checked release, or none installed: a DeepSpeed launch then fails on its own)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import InvalidVersion, Version

    try:
        installed = version("deepspeed")
    except PackageNotFoundError:
        return None
    try:
        old = Version(installed) < Version(DEEPSPEED_CHECKED)
    except InvalidVersion:  # pragma: no cover - a local build's odd version string
        return None
    if not old:
        return None
    return (
        f"it was checked under DeepSpeed {DEEPSPEED_CHECKED}, and DeepSpeed {installed} is installed (how ZeRO "
        "closes a gradient-accumulation micro-step, which the loss's forward blocks rely on, has changed between "
        f"releases); pip install 'deepspeed>={DEEPSPEED_CHECKED}'"
    )


def _is_zero_optimizer(optimizer) -> bool:
    try:
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
    except ImportError:  # pragma: no cover - DeepSpeed moved it
        return True
    return isinstance(optimizer, ZeROOptimizer)


def block_size(per_device_batch: int, num_generations: int) -> int:
    """Micro-batches per block: the fewest consecutive micro-batches of ``per_device_batch`` rows that hold whole
    groups of ``num_generations`` rows."""
    return math.lcm(per_device_batch, num_generations) // per_device_batch


def block_memory_note(per_device_batch: int, blocks: int) -> str:
    """The warning for ``loss_forward`` with gradient checkpointing off, where a block's activations add up."""
    return (
        f"egpo_entropy_logps='loss_forward' holds {blocks} micro-batches ({blocks * per_device_batch} rows) of "
        "forwards until their backwards; with gradient_checkpointing off that is all their activations at once, "
        f"{blocks} times one micro-batch's, which runs out of GPU memory at long completions. Turn "
        "gradient_checkpointing on, or use egpo_entropy_logps='policy'."
    )


def merged_block_memory_note(tokens: int) -> str:
    """The warning for ``egpo_loss_forward_block_tokens`` with gradient checkpointing off."""
    return (
        f"egpo_loss_forward_block_tokens={tokens} with gradient_checkpointing off: a block of merged groups holds all "
        "the activations of its forwards (up to that many padded tokens) until their backwards, which runs out of GPU "
        "memory at long completions. Turn gradient_checkpointing on, or unset egpo_loss_forward_block_tokens."
    )


def group_first_order(groups: torch.Tensor) -> torch.Tensor:
    """A permutation that puts the rows of each group together: groups in the order of their first row, the rows of
    a group in their order."""
    groups = groups.cpu()
    first = {}
    for position, group in enumerate(groups.tolist()):
        first.setdefault(group, position)
    rank = torch.tensor([first[group] for group in groups.tolist()])
    # sort by the position of the group's first row; stable, so rows of a group keep their order
    return torch.sort(rank, stable=True).indices


def row_lengths(batch: dict[str, Any]) -> torch.Tensor:
    """Each row's length on the CPU: its prompt tokens plus its completion up to its last scored token, the width the
    loss's forward is cut to under ``egpo_shift_prompt_padding``."""
    from egpo_trl.old_logps import completion_widths

    lengths = completion_widths(batch["completion_mask"]).cpu()
    prompt_mask = batch.get("prompt_mask")
    if prompt_mask is not None:
        lengths = lengths + prompt_mask.sum(dim=1).cpu()
    return lengths


def _sorted_segments(lengths: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """A permutation that sorts each segment of ``sizes`` consecutive rows by length, longest first (ties keep their
    order)."""
    order, start = [], 0
    for size in sizes:
        segment = lengths[start : start + size]
        order.append(start + torch.sort(segment, descending=True, stable=True).indices)
        start += size
    return torch.cat(order) if order else torch.arange(0)


def length_sorted_order(batch: dict[str, Any], window: int) -> torch.Tensor:
    """A permutation that sorts the rows of each ``window`` consecutive rows by their length (:func:`row_lengths`),
    longest first (ties keep their order). Rows never leave their window, so a window that is a generation batch (or,
    under ``loss_forward``, a group) keeps exactly its rows."""
    if window < 1:
        raise ValueError(f"window must be at least one row, got {window}")
    lengths = row_lengths(batch)
    rows = lengths.numel()
    return _sorted_segments(lengths, [min(window, rows - start) for start in range(0, rows, window)])


def padded_tokens(lengths: torch.Tensor, per_device: int) -> int:
    """The tokens the forwards of these rows compute once sorted by length, longest first, and cut into
    micro-batches of ``per_device`` rows, each as wide as its longest row."""
    ordered = torch.sort(lengths, descending=True).values
    return int(
        sum(
            int(ordered[start]) * int(ordered[start : start + per_device].numel())
            for start in range(0, ordered.numel(), per_device)
        )
    )


def merged_blocks(lengths: torch.Tensor, unit_rows: int, per_device: int, budget: int) -> list[int]:
    """The rows of each block of ``loss_forward``'s generation batch when blocks may hold several units of
    ``unit_rows`` rows (the fewest micro-batches that hold whole groups; the rows in group order).

    ``lengths`` is ``[processes, rows]`` (:func:`row_lengths` of every process's batch), so that every process gets
    the same blocks. Blocks are filled in order: the next unit joins the block before it where that lowers the
    padded tokens (:func:`padded_tokens`, summed over the processes) and no process's block then computes more than
    ``budget`` of them; otherwise it starts a block of its own. Where every row has the same length, merging saves
    nothing and each unit is a block."""
    if lengths.ndim == 1:
        lengths = lengths.unsqueeze(0)
    rows = lengths.size(1)
    if unit_rows < 1 or rows % unit_rows:
        raise ValueError(f"a generation batch of {rows} rows is not made of units of {unit_rows} rows")

    def cost(start: int, stop: int) -> list[int]:
        return [padded_tokens(process[start:stop], per_device) for process in lengths]

    sizes: list[int] = []
    start = 0
    for unit in range(unit_rows, rows + 1, unit_rows):
        if not sizes:
            sizes.append(unit_rows)
            continue
        stop = unit
        end = start + sizes[-1]
        apart = sum(cost(start, end)) + sum(cost(end, stop))
        together = cost(start, stop)
        if sum(together) < apart and max(together) <= budget:
            sizes[-1] += unit_rows
        else:
            start = end
            sizes.append(unit_rows)
    return sizes


def shuffle_then(prepare, generation_batch, reorders):
    """``prepare(generation_batch)`` (TRL's ``_prepare_inputs``) with each of ``reorders`` (functions of the batch
    returning a row permutation) applied, in turn, to a new generation batch right after TRL shuffles its rows and
    before it splits them into micro-batches."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.shuffle_sequence_dict

    def shuffle_and_reorder(batch):
        batch = original(batch)
        for reorder in reorders:
            permutation = reorder(batch)
            if permutation is not None:
                batch = reorder_rows(batch, permutation)
        return batch

    grpo_trainer.shuffle_sequence_dict = shuffle_and_reorder
    try:
        return prepare(generation_batch)
    finally:
        grpo_trainer.shuffle_sequence_dict = original


def reorder_rows(batch: dict[str, Any], permutation: torch.Tensor) -> dict[str, Any]:
    """``batch`` with every row-indexed value (tensors with a first dimension, lists) taken in ``permutation``'s
    order, as TRL's ``shuffle_sequence_dict`` permutes them."""

    def take(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: take(value) for key, value in batch.items()}


def reentrant_checkpointing(kwargs: dict | None) -> bool:
    """Whether gradient checkpointing with these ``gradient_checkpointing_kwargs`` is reentrant: transformers'
    Trainer passes no kwargs when they are empty (then non-reentrant), and PyTorch's checkpoint is reentrant when
    ``use_reentrant`` is not given."""
    if not kwargs:
        return False
    value = kwargs.get("use_reentrant")
    return True if value is None else bool(value)


def loss_forward_problems(
    random_forward: bool, engine: str | None = None, multimodal: bool = False, router_loss: bool = False
) -> list[str]:
    """Why ``egpo_entropy_logps="loss_forward"`` cannot serve a run, from what only the trainer knows (the arguments'
    problems are ``EGPOConfig._validate_loss_forward``'s). ``engine``: "FSDP" when the run uses it
    (DeepSpeed ZeRO-2 and ZeRO-3 are served: benchmarks/loss_forward_check.py)."""
    problems = []
    if random_forward:
        problems.append(
            "the policy's training forward is random (active dropout, in a module, the model's config or a PEFT "
            "adapter's), so the loss's forward is not pi_old's"
        )
    if engine is not None:
        problems.append(f"it has not been checked under {engine} yet")
    if multimodal:
        problems.append("the kept forwards do not carry image inputs")
    if router_loss:
        problems.append(
            "the MoE router's auxiliary loss is averaged over each micro-batch, whose rows the blocks change"
        )
    return problems


class LossForwardEntropyMixin:
    """``egpo_entropy_logps="loss_forward"`` on :class:`~egpo_trl.trainer.EGPOTrainer` (see the module's docstring).

    Methods only; ``EGPOTrainer`` calls :meth:`_check_loss_forward_entropy` at init, :meth:`_fused_finish` from its
    ``_egpo_finish``, :meth:`_fused_block_loss` from ``compute_loss`` and :meth:`_fused_cached_forward` from
    ``_get_per_token_logps_and_entropies``, and overrides ``_prepare_inputs`` and ``training_step`` through
    :meth:`_fused_prepare_inputs` and :meth:`_fused_training_step`.
    """

    def _check_loss_forward_entropy(self) -> None:
        """Refuse, at init, the settings where the loss's forward cannot give pi_old's log-probs to EGPO."""
        args = self.args
        self._fused = False
        if args.egpo_entropy_logps != "loss_forward":
            return
        engine = "FSDP" if self.is_fsdp_enabled else None
        problems = loss_forward_problems(
            self._egpo_training_forward_is_random(arguments=False),  # NEFTune: among the arguments' problems
            engine=engine,
            multimodal=bool(getattr(self, "_is_vlm", False)),
            router_loss=bool(getattr(self, "aux_loss_enabled", False)),
        )
        # The arguments' checks again (they may have changed since they were built), with the trainer's: one error.
        args._validate_loss_forward(problems)
        self._fused = True
        self._fused_block = block_size(args.per_device_train_batch_size, self.num_generations)
        if self._fused_block > 1 and not args.gradient_checkpointing:
            logger.warning(block_memory_note(args.per_device_train_batch_size, self._fused_block))
        self._fused_pending: list[dict[str, Any]] = []
        self._fused_cache: list[tuple] = []
        self._fused_batch: dict[str, Any] | None = None
        #: Micro-batches (1-based, within the generation batch) that end a block, where blocks may merge groups
        #: (``egpo_loss_forward_block_tokens``); ``None``: every ``_fused_block`` micro-batches.
        self._fused_block_ends: set[int] | None = None
        #: The padded tokens a merged block may hold; set by _check_length_sorting where sorting can use it.
        self._fused_block_tokens: int | None = None

    def _fused_active(self, mode: str) -> bool:
        return getattr(self, "_fused", False) and mode == "train"

    # ------------------------------------------------------------------ scoring: base advantages only
    def _fused_finish(self, output: dict[str, Any], rewards_per_func: torch.Tensor, num_generations: int):
        """Base advantages of the generation batch now; the rows carry what the block's weights need."""
        from egpo_trl.advantages import weighted_reward_sum

        # A new generation batch: nothing of an earlier one (a run stopped inside a block) carries over.
        self._fused_pending, self._fused_cache, self._fused_batch = [], [], None
        mask, fallback = self._egpo_loss_mask(output)
        if fallback is not None:
            fallback = self.accelerator.gather(fallback)
            self._egpo_warn_scope_fallback(fallback)
        total = rewards_per_func.size(0)
        # Any finite entropies give the same base advantages: the weights are computed per block.
        result = self._egpo_compute(rewards_per_func, torch.zeros(total), num_generations)
        local = output["advantages"].shape[0]
        start = self.accelerator.process_index * local
        rows = slice(start, start + local)
        device = output["advantages"].device
        correct = self._egpo_correct(rewards_per_func)[0].float()
        correct = correct.masked_fill(torch.isnan(rewards_per_func[:, self._egpo_correctness_index]), float("nan"))
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights)
        output["advantages"] = result.base_advantages[rows].to(device, output["advantages"].dtype)
        output[GROUP_KEY] = (torch.arange(total, device=device) // num_generations)[rows]
        output[REWARD_KEY] = rewards[rows].to(device)
        output[CORRECT_KEY] = correct[rows].to(device)
        output[MASK_KEY] = mask
        output[ROW_KEY] = torch.arange(local, device=device)
        self._fused_batch = {
            "result": result,
            "rows": rows,
            "weights": torch.ones(local),
            "raw_weights": torch.ones(local),
            "nll": torch.full((local,), float("nan")),
            "shannon": torch.full((local,), float("nan")),
            "seen": torch.zeros(local, dtype=torch.bool),
            "num_generations": num_generations,
            "fallback": fallback,
            "scored": ~torch.isnan(rewards_per_func[:, self._egpo_correctness_index]),
        }
        return result

    # ------------------------------------------------------------------ micro-batches grouped in blocks
    def _fused_prepare_inputs(self, prepare, generation_batch):
        """TRL's ``_prepare_inputs`` (``prepare``) with the shuffled rows of a new generation batch grouped so that each
        block of micro-batches holds whole groups; with ``egpo_length_sorted_micro_batches``, each group's rows then
        sorted by length (a group stays in place, so each block keeps its whole groups, each group's rows together,
        as the block's loss needs them), or, with ``egpo_loss_forward_block_tokens``, the groups merged into blocks
        (:func:`merged_blocks`) and each block's rows sorted by length together."""

        def group(batch):
            return group_first_order(batch[GROUP_KEY]) if GROUP_KEY in batch else None

        reorders = [group]
        if getattr(self, "_fused_block_tokens", None):
            reorders.append(self._fused_merge_blocks)
        else:
            window = getattr(self, "_egpo_sort_window", None)
            if window:
                reorders.append(lambda batch: length_sorted_order(batch, window) if GROUP_KEY in batch else None)
        return shuffle_then(prepare, generation_batch, reorders)

    def _fused_merge_blocks(self, batch):
        """The blocks of a new generation batch (rows in group order) under ``egpo_loss_forward_block_tokens``: sets
        :attr:`_fused_block_ends` and returns the permutation that sorts each block's rows by length."""
        self._fused_block_ends = None  # nothing of an earlier generation batch's blocks carries over
        if GROUP_KEY not in batch:
            return None
        lengths = row_lengths(batch)
        every = lengths
        if self.accelerator.num_processes > 1:  # the same blocks on every process
            every = self.accelerator.gather(lengths.to(self.accelerator.device)).cpu()
        every = every.view(self.accelerator.num_processes, -1)
        per_device = self.args.per_device_train_batch_size
        sizes = merged_blocks(every, self._fused_block * per_device, per_device, self._fused_block_tokens)
        ends, total = set(), 0
        for size in sizes:
            total += size
            ends.add(total // per_device)
        self._fused_block_ends = ends
        # how many blocks the generation batch was cut into (each block holds its forwards until its last one)
        self._metrics["train"]["egpo/loss_forward_blocks"].append(float(len(sizes)))
        return _sorted_segments(lengths, sizes)

    def _fused_ends_block(self, position: int) -> bool:
        """Whether the micro-batch at ``position`` (0-based, within its generation batch) ends its block."""
        ends = getattr(self, "_fused_block_ends", None)
        if ends is None:
            return (position + 1) % self._fused_block == 0
        return position + 1 in ends

    def _fused_training_step(self, model, inputs, step):
        """A micro-batch that does not end its block: prepared and kept, with GRPOTrainer's step bookkeeping, and
        no forward or backward; the block's last micro-batch runs them all (``step``: ``training_step`` of the
        parent classes). Where blocks merge groups (``egpo_loss_forward_block_tokens``), a generation batch's first
        micro-batch is prepared first, as preparing it generates the batch and decides its blocks; should it end a
        block, ``step`` then takes it as prepared."""
        position = self._step % self.args.steps_per_generation
        decided = position > 0 or not getattr(self, "_fused_block_tokens", None)
        if decided and self._fused_ends_block(position):
            return step()
        start = time.perf_counter()
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # as Trainer.training_step: a schedule-free optimizer
            self.optimizer.train()  # back to its training weights (evaluation leaves it in eval mode) before sampling
        prepared = self._prepare_inputs(inputs)  # a new generation batch resets the kept micro-batches: first
        self._current_train_step_time += time.perf_counter() - start
        if not decided and self._fused_ends_block(position):
            # Trainer.training_step prepares its inputs again: this once, they are the prepared ones (an attribute
            # of the instance, so that a subclass's _prepare_inputs does not run twice on one micro-batch)
            missing = object()
            before = self.__dict__.get("_prepare_inputs", missing)  # a wrapper set on the instance, if any
            self.__dict__["_prepare_inputs"] = lambda _inputs: prepared
            try:
                return step()
            finally:
                if before is missing:
                    self.__dict__.pop("_prepare_inputs", None)
                else:
                    self.__dict__["_prepare_inputs"] = before
        self._fused_pending.append(prepared)
        self._step += 1
        return torch.zeros((), device=self.accelerator.device)

    def _fused_cached_forward(self):
        """The next kept forward of the block being trained on (``None`` outside one)."""
        return self._fused_cache.pop(0) if self._fused_cache else None

    def _fused_block_loss(self, model, inputs, loss_of):
        """The block's loss: every micro-batch's forward, EGPO's weights from their log-probs, then TRL's loss of each
        micro-batch (``loss_of(model, micro_batch)``, which reads the kept forwards) with the weighted advantages.
        Each loss but the last is backpropagated here (see :meth:`_fused_backward_each`); the returned loss, the last
        micro-batch's plus the others' detached, goes to the trainer's own backward and log."""
        from egpo_trl.advantages import sequence_entropy, sequence_mean

        block, self._fused_pending = self._fused_pending + [inputs], []
        forwards = []
        for batch in block:
            unsupported = [key for key in FORWARD_KEYS if batch.get(key) is not None]
            if unsupported:
                raise ValueError(
                    f"egpo_entropy_logps='loss_forward' does not support multimodal inputs ({unsupported}); use "
                    "egpo_entropy_logps='policy'."
                )
            input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            forwards.append(
                self._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    batch["completion_ids"].size(1),
                    compute_entropy=True,
                    compute_aux_loss=self.aux_loss_enabled,
                )
            )
        groups = torch.cat([batch[GROUP_KEY] for batch in block])
        n = self._fused_batch["num_generations"]
        # A merged block's rows are sorted by length across its groups: the estimator takes each group's rows
        # together, and its weights go back to the block's order.
        order = group_first_order(groups).to(groups.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        grouped = groups[order]
        if grouped.numel() % n or not bool((grouped.view(-1, n) == grouped.view(-1, n)[:, :1]).all()):
            raise RuntimeError(  # pragma: no cover - _fused_prepare_inputs groups the rows
                "egpo_entropy_logps='loss_forward': a block of micro-batches does not hold whole groups; is the TRL "
                "version 1.16.0?"
            )
        nll = torch.cat(
            [
                sequence_entropy(logps.detach().float(), batch[MASK_KEY])
                for (logps, _, _), batch in zip(forwards, block)
            ]
        )
        shannon = None
        if self._egpo_entropy_input == "shannon":  # EDGE-GRPO: the mean full-distribution entropy of each row
            shannon = torch.cat(
                [
                    sequence_mean(entropies.detach().float(), batch[MASK_KEY])
                    for (_, entropies, _), batch in zip(forwards, block)
                ]
            )
        rewards = torch.cat([batch[REWARD_KEY] for batch in block])
        correct = torch.cat([batch[CORRECT_KEY] for batch in block])
        # The weights of a group depend on its own rows only: the estimator over the block's groups gives them.
        entropy_input = shannon if shannon is not None else nll
        weights = self._egpo_estimator(
            rewards[order], entropy_input[order], n, correct=correct[order], **self._estimator_kwargs()
        )
        weights = type(weights)(*[field[inverse] for field in weights])  # every per-row field in the block's order
        self._fused_record(block, weights, nll, shannon)
        self._fused_cache = list(forwards)
        del forwards  # each kept forward is freed with its micro-batch's backward
        early = self._fused_backward_each(model)
        total = None
        done = None  # the losses already backpropagated, for the logged loss
        start = 0
        try:
            for index, batch in enumerate(block):
                rows = batch["advantages"].shape[0]
                weighted = dict(batch)
                weighted["advantages"] = (
                    weights.weights[start : start + rows].to(batch["advantages"].device) * batch["advantages"]
                ).to(batch["advantages"].dtype)
                start += rows
                loss = loss_of(model, weighted)
                if early and index < len(block) - 1:
                    self._fused_backward_now(loss)
                    loss = loss.detach()
                    done = loss if done is None else done + loss
                else:
                    total = loss if total is None else total + loss
        finally:
            leftover, self._fused_cache = self._fused_cache, []
        if leftover:  # pragma: no cover - TRL 1.16's loss runs one forward per micro-batch
            raise RuntimeError("The loss did not use every kept forward of its block; is the TRL version 1.16.0?")
        # The trainer's step backpropagates what is left (the last micro-batch's loss) and logs the block's sum.
        return total if done is None else total + done

    def _fused_backward_each(self, model) -> bool:
        """Whether the block's micro-batches can each run their backward as their loss is computed: under DeepSpeed
        and in a process that trains alone. DDP arms its gradient synchronisation in the forward (every kept forward
        ran in the block's last step, synchronised when that step ends the generation batch), so under DDP the
        block runs one backward of the losses' sum."""
        if self.is_deepspeed_enabled:
            return True
        return not isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.accelerator.num_processes == 1

    def _fused_backward_now(self, loss: torch.Tensor) -> None:
        """The backward of one of the block's micro-batches before the last, as ``Trainer.training_step`` runs it
        (TRL's loss is already scaled for gradient accumulation; DeepSpeed told not to scale it again), as an
        accumulation step: no optimizer step, whatever the block's last micro-batch is."""
        if getattr(self.args, "n_gpu", 1) > 1:  # pragma: no cover - GRPOTrainer refuses DataParallel
            loss = loss.mean()
        if getattr(self, "loss_is_scaled_for_ga", None) is False:  # pragma: no cover - TRL 1.16 sets it True
            loss = loss / self.current_gradient_accumulation_steps
        kwargs = {"scale_wrt_gas": False} if self.is_deepspeed_enabled else {}
        state = self.accelerator.gradient_state
        sync = state.sync_gradients
        state._set_sync_gradients(False)
        try:
            self.accelerator.backward(loss, **kwargs)
        finally:
            state._set_sync_gradients(sync)
        if self.is_deepspeed_enabled:
            # DeepSpeed's ZeRO optimizers close a micro-step at the next forward (ZeRO-3 counts it there, so that the
            # next backward adds its gradients instead of copying over them; ZeRO-1 clears its gradient
            # accumulators): the block's forwards all ran before, so close it here, as DeepSpeed's forward does.
            optimizer = self.accelerator.deepspeed_engine_wrapped.engine.optimizer
            close = getattr(optimizer, "clear_backward_seen_flag", None)
            if callable(close):
                close()
            elif _is_zero_optimizer(optimizer):  # pragma: no cover - DeepSpeed 0.19 has it (deepspeed_problem)
                raise RuntimeError(
                    f"egpo_entropy_logps='loss_forward': {type(optimizer).__name__} of this DeepSpeed release has no "
                    "clear_backward_seen_flag, so a micro-batch's gradients might overwrite the previous one's; it was "
                    f"checked with DeepSpeed {DEEPSPEED_CHECKED} and later. Use egpo_entropy_logps='policy'."
                )

    def _fused_record(self, block, weights, nll, shannon=None) -> None:
        """Keep the block's weights and entropies; once every row of the batch has been trained on, log the batch's
        egpo/* metrics and write its final advantages where the completions table reads them."""
        state = self._fused_batch
        rows = torch.cat([batch[ROW_KEY] for batch in block]).cpu()
        state["weights"][rows] = weights.weights.detach().float().cpu()
        state["raw_weights"][rows] = weights.raw_weights.detach().float().cpu()
        state["nll"][rows] = nll.detach().float().cpu()
        if shannon is not None:
            state["shannon"][rows] = shannon.detach().float().cpu()
        state["seen"][rows] = True
        if not bool(state["seen"].all()):
            return
        self._fused_batch = None
        device = self.accelerator.device
        keys = ("weights", "raw_weights", "nll") + (("shannon",) if self._egpo_entropy_input == "shannon" else ())
        gathered = {key: self.accelerator.gather(state[key].to(device)).cpu() for key in keys}
        shannon = gathered.get("shannon")
        result = state["result"]
        result = type(result)(*[value.cpu() if torch.is_tensor(value) else value for value in result])
        result = result._replace(
            weights=gathered["weights"],
            raw_weights=gathered["raw_weights"],
            advantages=gathered["weights"] * result.base_advantages.cpu(),
        )
        logged = self._logs["advantages"]
        for _ in range(min(len(logged), result.advantages.numel())):
            logged.pop()
        logged.extend(result.advantages.tolist())
        # The proxy's metrics as the pass logs them: when the estimator reads it or egpo_entropy_metrics asks.
        logs_nll = self._egpo_entropy_input == "nll" or self.args.egpo_entropy_metrics
        entropies = {
            "nll": gathered["nll"] if logs_nll else None,
            "shannon": shannon,
            "source": "loss_forward",
            "extra_pass": False,
            "scope_fallback": state["fallback"],
        }
        self._egpo_log_metrics("train", result, entropies, state["num_generations"], scored=state["scored"].cpu())
        self.egpo_last_batch.update(
            entropies=gathered["nll"], token_entropies=shannon, result=result, entropy_source="loss_forward"
        )
