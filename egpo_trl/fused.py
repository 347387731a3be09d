"""The old policy's log-probs from the loss's own forward (``egpo_entropy_logps="loss_forward"``): rows are grouped
so that a block of micro-batches holds whole groups; the block runs its forwards, computes EGPO's weights from their
log-probs, then backpropagates TRL's loss of each micro-batch with the weighted advantages."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from egpo_trl.input_checks import config_makes_forward_random

logger = logging.getLogger(__name__)

# Keys the scoring adds to each row for the block's weights: its global group, weighted reward sum (NaN: unscored),
# correctness (1/0, NaN: no verdict), the tokens the entropy proxy averages over, and its index on this process.
GROUP_KEY = "egpo_fused_group"
REWARD_KEY = "egpo_fused_reward"
CORRECT_KEY = "egpo_fused_correct"
MASK_KEY = "egpo_fused_mask"
ROW_KEY = "egpo_fused_row"

DEEPSPEED_CHECKED = "0.19"  # the release loss_forward was checked with (ZeRO's clear_backward_seen_flag)


def deepspeed_problem() -> str | None:
    """Why the installed DeepSpeed (older than :data:`DEEPSPEED_CHECKED`) cannot serve ``loss_forward``, or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("deepspeed")
    except PackageNotFoundError:
        return None
    if Version(installed) >= Version(DEEPSPEED_CHECKED):
        return None
    return (
        f"it was checked under DeepSpeed {DEEPSPEED_CHECKED}, and DeepSpeed {installed} is installed (how ZeRO "
        "closes a gradient-accumulation micro-step, which the loss's forward blocks rely on, has changed between "
        f"releases); pip install 'deepspeed>={DEEPSPEED_CHECKED}'"
    )


def block_size(per_device_batch: int, num_generations: int) -> int:
    """Micro-batches per block: the fewest that hold whole groups."""
    return math.lcm(per_device_batch, num_generations) // per_device_batch


def block_memory_note(per_device_batch: int, blocks: int) -> str:
    return (
        f"egpo_entropy_logps='loss_forward' holds {blocks} micro-batches ({blocks * per_device_batch} rows) of "
        "forwards until their backwards; with gradient_checkpointing off that is all their activations at once, "
        f"{blocks} times one micro-batch's, which runs out of GPU memory at long completions. Turn "
        "gradient_checkpointing on, or use egpo_entropy_logps='policy'."
    )


def group_first_order(groups: torch.Tensor) -> torch.Tensor:
    """A stable permutation that puts each group's rows together, groups in the order of their first row."""
    groups = groups.cpu()
    first = {}
    for position, group in enumerate(groups.tolist()):
        first.setdefault(group, position)
    rank = torch.tensor([first[group] for group in groups.tolist()])
    # sort by the position of the group's first row; stable, so rows of a group keep their order
    return torch.sort(rank, stable=True).indices


def reorder_rows(batch: dict[str, Any], permutation: torch.Tensor) -> dict[str, Any]:
    """``batch`` with every row-indexed value taken in ``permutation``'s order (as ``shuffle_sequence_dict``)."""

    def take(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: take(value) for key, value in batch.items()}


def reentrant_checkpointing(kwargs: dict | None) -> bool:
    """Whether checkpointing with these ``gradient_checkpointing_kwargs`` is reentrant."""
    if not kwargs:
        return False
    value = kwargs.get("use_reentrant")
    return True if value is None else bool(value)


def loss_forward_problems(
    random_forward: bool, engine: str | None = None, multimodal: bool = False, router_loss: bool = False
) -> list[str]:
    """Why ``loss_forward`` cannot serve a run, from what only the trainer knows (``engine``: "FSDP" when used)."""
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


def random_training_forward(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of ``model`` is random: active dropout, or a random setting in its configs."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        adapters = getattr(module, "peft_config", None)
        configs = [getattr(module, "config", None), *(adapters.values() if isinstance(adapters, dict) else ())]
        if any(hasattr(config, "to_dict") and config_makes_forward_random(config.to_dict()) for config in configs):
            return True
    return False


class LossForwardEntropyMixin:
    """``egpo_entropy_logps="loss_forward"`` for :class:`~egpo_trl.trainer.EGPOTrainer`."""

    def _check_loss_forward_entropy(self) -> None:
        args = self.args
        self._fused = False
        if args.egpo_entropy_logps != "loss_forward":
            return
        engine = "FSDP" if self.is_fsdp_enabled else None
        multimodal, router_loss = bool(getattr(self, "_is_vlm", False)), bool(getattr(self, "aux_loss_enabled", False))
        # NEFTune is among the arguments' problems
        problems = loss_forward_problems(random_training_forward(self.model), engine, multimodal, router_loss)
        # The arguments' checks again (they may have changed), with the trainer's: one error.
        args._validate_loss_forward(problems)
        self._fused = True
        self._fused_block = block_size(args.per_device_train_batch_size, self.num_generations)
        if self._fused_block > 1 and not args.gradient_checkpointing:
            logger.warning(block_memory_note(args.per_device_train_batch_size, self._fused_block))
        self._fused_pending: list[dict[str, Any]] = []
        self._fused_cache: list[tuple] = []
        self._fused_batch: dict[str, Any] | None = None

    def _fused_finish(self, output: dict[str, Any], rewards_per_func: torch.Tensor, num_generations: int):
        """Base advantages of the generation batch now; the rows carry what the block's weights need."""
        from egpo_trl.advantages import weighted_reward_sum

        # A new generation batch: nothing of an earlier one (a run stopped inside a block) carries over.
        self._fused_pending, self._fused_cache, self._fused_batch = [], [], None
        mask, fallback = self._egpo_loss_mask(output)
        total = rewards_per_func.size(0)
        # Any finite entropies give the same base advantages: the weights are computed per block.
        result = self._egpo_compute(rewards_per_func, torch.zeros(total), num_generations)
        local = output["advantages"].shape[0]
        start = self.accelerator.process_index * local
        rows = slice(start, start + local)
        device = output["advantages"].device
        rewards_per_func, correct, _ = self._egpo_verdicts(rewards_per_func)
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights)
        output["advantages"] = result.base_advantages[rows].to(device, output["advantages"].dtype)
        output[GROUP_KEY] = (torch.arange(total, device=device) // num_generations)[rows]
        output[REWARD_KEY] = rewards[rows].to(device)
        output[CORRECT_KEY] = correct.float()[rows].to(device)
        output[MASK_KEY] = mask
        output[ROW_KEY] = torch.arange(local, device=device)
        scored = ~torch.isnan(rewards_per_func[:, self._egpo_correctness_index])
        state = dict(result=result, rows=rows, num_generations=num_generations, fallback=fallback, scored=scored)
        state.update(
            weights=torch.ones(local), raw_weights=torch.ones(local), seen=torch.zeros(local, dtype=torch.bool)
        )
        state.update(nll=torch.full((local,), float("nan")), shannon=torch.full((local,), float("nan")))
        self._fused_batch = state
        return result

    def _fused_prepare_inputs(self, prepare, generation_batch):
        """TRL's ``_prepare_inputs`` with a new batch's shuffled rows grouped, so that a block holds whole groups."""
        from trl.trainer import grpo_trainer

        shuffle = grpo_trainer.shuffle_sequence_dict

        def shuffle_then_group(batch):
            batch = shuffle(batch)
            return reorder_rows(batch, group_first_order(batch[GROUP_KEY])) if GROUP_KEY in batch else batch

        grpo_trainer.shuffle_sequence_dict = shuffle_then_group
        try:
            return prepare(generation_batch)
        finally:
            grpo_trainer.shuffle_sequence_dict = shuffle

    def _fused_training_step(self, model, inputs, step):
        """Keep a micro-batch that does not end its block; the block's last one runs ``step``."""
        if (self._step % self.args.steps_per_generation + 1) % self._fused_block == 0:
            return step()
        start = time.perf_counter()
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # as Trainer.training_step: a schedule-free optimizer
            self.optimizer.train()
        prepared = self._prepare_inputs(inputs)  # a new generation batch resets the kept micro-batches first
        self._current_train_step_time += time.perf_counter() - start
        self._fused_pending.append(prepared)
        self._step += 1
        return torch.zeros((), device=self.accelerator.device)

    def _fused_block_loss(self, model, inputs, loss_of):
        """Every micro-batch's forward, EGPO's weights from their log-probs, then ``loss_of(model, micro_batch)`` with
        the weighted advantages. Losses but the last are backpropagated here where possible; the returned loss goes
        to the trainer's own backward and log."""
        from egpo_trl.advantages import sequence_entropy, sequence_mean

        block, self._fused_pending = self._fused_pending + [inputs], []
        forwards = []
        for batch in block:
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
        n = self._fused_batch["num_generations"]
        pairs = list(zip(forwards, block))
        nll = torch.cat([sequence_entropy(logps.detach().float(), batch[MASK_KEY]) for (logps, _, _), batch in pairs])
        shannon = None
        if self._egpo_entropy_input == "shannon":  # EDGE-GRPO: the mean full-distribution entropy of each row
            shannon = torch.cat([sequence_mean(ent.detach().float(), batch[MASK_KEY]) for (_, ent, _), batch in pairs])
        rewards = torch.cat([batch[REWARD_KEY] for batch in block])
        correct = torch.cat([batch[CORRECT_KEY] for batch in block])
        # The weights of a group depend on its own rows only: the estimator over the block's groups gives them.
        entropy_input = shannon if shannon is not None else nll
        weights = self._egpo_estimator(rewards, entropy_input, n, correct=correct, **self._estimator_kwargs())
        self._fused_record(block, weights, nll, shannon)
        self._fused_cache = list(forwards)
        del forwards, pairs  # each kept forward is freed with its micro-batch's backward
        # Each micro-batch's backward can run as its loss is computed under DeepSpeed or alone, not under DDP.
        alone = (
            not isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.accelerator.num_processes == 1
        )
        early = self.is_deepspeed_enabled or alone
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
            self._fused_cache = []
        # The trainer's step backpropagates what is left (the last micro-batch's loss) and logs the block's sum.
        return total if done is None else total + done

    def _fused_backward_now(self, loss: torch.Tensor) -> None:
        """One earlier micro-batch's backward as an accumulation step (TRL's loss is already scaled for it)."""
        kwargs = {"scale_wrt_gas": False} if self.is_deepspeed_enabled else {}
        state = self.accelerator.gradient_state
        sync = state.sync_gradients
        state._set_sync_gradients(False)
        try:
            self.accelerator.backward(loss, **kwargs)
        finally:
            state._set_sync_gradients(sync)
        if self.is_deepspeed_enabled:  # close the micro-step, as DeepSpeed's next forward would
            optimizer = self.accelerator.deepspeed_engine_wrapped.engine.optimizer
            if callable(getattr(optimizer, "clear_backward_seen_flag", None)):
                optimizer.clear_backward_seen_flag()

    def _fused_record(self, block, weights, nll, shannon=None) -> None:
        """Keep the block's weights; once every row is trained on, log the batch's egpo/* metrics and advantages."""
        state = self._fused_batch
        rows = torch.cat([batch[ROW_KEY] for batch in block]).cpu()
        values = {"weights": weights.weights, "raw_weights": weights.raw_weights, "nll": nll, "shannon": shannon}
        for key, value in values.items():
            if value is not None:
                state[key][rows] = value.detach().float().cpu()
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
        advantages = gathered["weights"] * result.base_advantages.cpu()
        result = result._replace(
            weights=gathered["weights"], raw_weights=gathered["raw_weights"], advantages=advantages
        )
        logged = self._logs["advantages"]
        for _ in range(min(len(logged), result.advantages.numel())):
            logged.pop()
        logged.extend(result.advantages.tolist())
        # The proxy's metrics as the pass logs them: when the estimator reads it or egpo_entropy_metrics asks.
        logs_nll = self._egpo_entropy_input == "nll" or self.args.egpo_entropy_metrics
        entropies = dict(nll=gathered["nll"] if logs_nll else None, shannon=shannon, source="loss_forward")
        entropies.update(extra_pass=False, scope_fallback=state["fallback"])
        self._egpo_log_metrics("train", result, entropies, state["num_generations"], scored=state["scored"].cpu())
        self.egpo_last_batch.update(
            entropies=gathered["nll"], token_entropies=shannon, result=result, entropy_source="loss_forward"
        )
