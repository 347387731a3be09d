"""EDGE-GRPO's Guided Error Correction (``edge_gec``), a mixin of :class:`~egpo_trl.trainer.EGPOTrainer`: incorrect
completions are rewritten before TRL scores them and trained on as if sampled."""

from __future__ import annotations

import logging
import math
import re
from contextlib import contextmanager

import torch
from trl.data_utils import is_conversational
from trl.trainer.utils import is_async_callable

from egpo_trl.rewards import (
    TEMPLATE_PROBE_ANSWER,
    _gold_to_text,
    answer_template_probe,
    answers_match,
    boxed_accuracy_reward,
    extract_last_boxed,
)
from egpo_trl.sampling.dynamic import refuse_unsupported_generation

logger = logging.getLogger(__name__)

_BOXED = "\\boxed{"
_BRACES = re.compile(r"\\boxed\{|[{}]")
# Appended to a reference solution whose last box does not give the reference answer.
SOLUTION_ANSWER_SUFFIX = "\n\nThe final answer is \\boxed{{answer}}."
_SPLIT_CHARACTER_TOKENS = 16  # tokens past the bisection's landing point checked one by one


def _open_boxed_start(text: str) -> int | None:
    """Where ``text`` must be cut to leave no ``\\boxed{`` open; ``None`` when it stops outside one."""
    depth, open_boxes = 0, []  # the open boxes' starts, with the brace depth each opened at
    for match in _BRACES.finditer(text):
        if match.group() == "}":
            depth = max(depth - 1, 0)
            while open_boxes and open_boxes[-1][1] >= depth:
                open_boxes.pop()
        else:
            if match.group() != "{":
                open_boxes.append((match.start(), depth))
            depth += 1
    if open_boxes:
        return open_boxes[0][0]
    for k in range(len(_BOXED) - 1, 0, -1):
        if text.endswith(_BOXED[:k]):
            return len(text) - k
    return None


def _complete_length(text: str) -> int:
    """``text``'s length without trailing replacement characters (of a character split over byte tokens)."""
    return len(text.rstrip("\ufffd"))


def boxed_safe_prefix(ids: list[int], decode) -> list[int]:
    """The longest prefix of ``ids`` whose decoded text does not stop inside a ``\\boxed{}`` (a bisection)."""
    n = len(ids)
    while n > 0:
        start = _open_boxed_start(decode(ids[:n]))
        if start is None:
            return ids[:n]
        low, high = 0, n - 1  # the longest m < n whose text stops before `start`
        while low < high:
            middle = (low + high + 1) // 2
            if _complete_length(decode(ids[:middle])) <= start:
                low = middle
            else:
                high = middle - 1
        for m in range(min(n - 1, low + _SPLIT_CHARACTER_TOKENS), low, -1):
            text = decode(ids[:m])
            if _complete_length(text) <= start and _open_boxed_start(text) is None:
                low = m
                break
        n = low
    return []


def shortened(ids: list[int], limit: int, decode) -> list[int]:
    """``ids`` cut to at most ``limit`` tokens, never inside its own ``\\boxed{}`` when something is cut off."""
    kept = list(ids[: max(0, limit)])
    return boxed_safe_prefix(kept, decode) if len(kept) < len(ids) else kept


def pad_continuation_batch(prompts: list[list[int]], counts: list[int], filler: list[int]) -> list[list[int]]:
    """This process's continuation prompts padded with ``filler`` to the largest of every process's ``counts``."""
    width = max(max(counts, default=0), 1)
    return [list(p) for p in prompts] + [list(filler) for _ in range(width - len(prompts))]


class GuidedErrorCorrectionMixin:
    """EDGE-GRPO's Guided Error Correction; logs ``gec/frac_{eligible,reflect,answer,solution,solution_as_answer,
    solution_boxed,answer_too_long}``."""

    def _check_guided_error_correction(self) -> None:
        args = self.args
        refuse_unsupported_generation(self, "edge_gec")
        if getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError(
                "edge_gec continues incorrect completions with vLLM or the plain transformers generation, not "
                "with transformers' continuous batching; turn one of them off."
            )
        if any(isinstance(f, torch.nn.Module) or is_async_callable(f) for f in self.reward_funcs):
            raise ValueError(
                "edge_gec re-scores the rewritten completions with plain reward functions only, not reward models "
                "or async functions; use plain functions, or turn edge_gec off."
            )
        columns = getattr(self.train_dataset, "column_names", None) or []
        if "answer" not in columns:
            raise ValueError(
                f"edge_gec needs the reference answers in an `answer` column of train_dataset; it has {columns}."
            )
        # Some rows get the answer template: the answer share, or the solution share without a `solution` column.
        injects = args.edge_gec_answer_prob > 0 or (args.edge_gec_solution_prob > 0 and "solution" not in columns)
        if injects and self.reward_funcs[self._egpo_correctness_index] is boxed_accuracy_reward:
            rendered, readable = answer_template_probe(args.edge_gec_answer_template)
            if not readable:
                raise ValueError(
                    f"edge_gec_answer_template {args.edge_gec_answer_template!r} gives {rendered!r} for the answer "
                    f"{TEMPLATE_PROBE_ANSWER!r}, which boxed_accuracy_reward (the correctness reward) cannot read: "
                    "every injected answer would be scored as wrong. Put the answer in a box, e.g. ' The answer is "
                    "\\boxed{{answer}}.' (the default template does)."
                )

        def length(text: str) -> int:
            return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

        cue, template = args.edge_gec_reflection_cue, args.edge_gec_answer_template
        texts = []  # the cue needs one continued token and the EOS; the template a one-character answer and the EOS
        if args.edge_gec_reflect_prob > 0:
            texts.append(("edge_gec_reflection_cue", cue, length(cue) + 2))
        if injects:
            texts.append(("edge_gec_answer_template", template, length(template.replace("{answer}", "0")) + 1))
        for name, text, needed in texts:
            if needed > args.max_completion_length:
                raise ValueError(
                    f"max_completion_length={args.max_completion_length} is too short for Guided Error Correction: "
                    f"{name} ({text!r}) needs {needed} tokens with the EOS (the cue: and one continued token; the "
                    f"template: with a one-character answer). Raise max_completion_length to at least {needed}, or "
                    "shorten the text."
                )
        if args.edge_gec_solution_prob > 0 and "solution" not in columns and self.accelerator.is_main_process:
            logger.warning(
                "edge_gec_solution_prob=%g but train_dataset has no `solution` column: that share of the incorrect "
                "completions gets the reference answer injected (as edge_gec_answer_prob does) instead of being "
                "replaced by a reference solution; gec/frac_solution_as_answer logs it. Add a `solution` column, "
                "or set edge_gec_solution_prob=0 (and give its probability to edge_gec_answer_prob) to say so.",
                args.edge_gec_solution_prob,
            )

    def _guided_error_correction(self, prompts: list, result: tuple) -> tuple:
        """GEC on one round of TRL's ``_generate`` output: rewrite each eligible incorrect completion at random."""
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = result
        args = self.args
        inputs = self._egpo_round_inputs
        device = self.accelerator.device
        local_rows = len(completion_ids)
        num_generations = self.num_generations

        # Every reward function scores every sampled completion here, once; TRL's scoring re-scores the rewritten ones.
        scores = self._gec_score_sampled(inputs, prompts, completions, completion_ids)
        rewards_per_func, pending_extra, pending_metrics = scores
        values = rewards_per_func[:, self._egpo_correctness_index]
        scored = ~torch.isnan(values)
        is_correct = self._egpo_correct(rewards_per_func)[0]
        eligible = scored & ~is_correct
        if args.edge_gec_scope == "all_incorrect_groups":
            grouped = is_correct.view(-1, num_generations).any(dim=1, keepdim=True)
            eligible = eligible & ~grouped.expand(-1, num_generations).reshape(-1)
        start = self.accelerator.process_index * local_rows
        eligible = eligible[start : start + local_rows].cpu()

        self._gec_calls = getattr(self, "_gec_calls", 0) + 1  # a fresh draw for every round of every step
        seed = (args.seed + 7) * 1_000_003 + self._gec_calls * 1_009 + self.accelerator.process_index
        draws = torch.rand(local_rows, generator=torch.Generator().manual_seed(seed))
        reflect_below = args.edge_gec_reflect_prob
        answer_below = reflect_below + args.edge_gec_answer_prob
        solution_below = answer_below + args.edge_gec_solution_prob
        eos = self.eos_token_ids[0]
        max_length = self.max_completion_length
        tokenizer = self._tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        def body(ids: list[int]) -> list[int]:
            return ids[:-1] if ids and ids[-1] in self.eos_token_ids else list(ids)

        new_ids = [list(ids) for ids in completion_ids]
        strategy = [None] * local_rows
        solution_as_answer = [False] * local_rows  # the solution share, for a row without a solution
        solution_boxed = [False] * local_rows  # a solution that got the answer's box appended
        kept_tokens = [0] * local_rows  # leading tokens of the sampled completion that a rewrite keeps
        cue = encode(args.edge_gec_reflection_cue)
        # Room kept for a continuation: up to edge_gec_max_new_tokens, at least half of what the cue leaves free;
        # a long original is shortened to make that room, a short one is kept whole.
        room = min(args.edge_gec_max_new_tokens, (max_length - len(cue)) // 2)
        reflect_rows, reflect_prompts, budget = [], [], 0
        too_long = 0  # rows whose reference answer cannot fit max_completion_length: left as sampled
        for i in range(local_rows):
            if not eligible[i]:
                continue
            u = float(draws[i])
            gold = inputs[i].get("answer")
            # The text the reward compares against: of a list of answers the first, not the list's Python spelling.
            answer = "" if gold is None else _gold_to_text(gold)
            solution = inputs[i].get("solution")
            choice = None
            if u < reflect_below and room >= 1:
                choice = "reflect"
            elif u < reflect_below or u < answer_below:
                choice = "answer"
            elif u < solution_below:
                choice = "solution" if solution else "answer"
                solution_as_answer[i] = not solution
            if choice in ("answer", "solution") and not answer:
                choice = None
                solution_as_answer[i] = False
            injected = suffix = body_ids = None
            if choice == "answer":
                injected = encode(args.edge_gec_answer_template.replace("{answer}", answer))
                if len(injected) > max_length - 1:  # this answer cannot fit: the row stays as it was sampled
                    choice, solution_as_answer[i] = None, False
                    too_long += 1
            elif choice == "solution":
                text = str(solution)
                body_ids = encode(text)
                suffix = []
                if not answers_match(extract_last_boxed(text), answer) or len(body_ids) > max_length - 1:
                    suffix = encode(SOLUTION_ANSWER_SUFFIX.replace("{answer}", answer))
                    if len(suffix) > max_length - 1:  # an answer that cannot fit, as above
                        choice = None
                        too_long += 1
            if choice == "reflect":
                kept = shortened(body(completion_ids[i]), max_length - len(cue) - room, tokenizer.decode)
                new_ids[i] = kept + cue
                kept_tokens[i] = len(kept)
                budget = max(budget, min(args.edge_gec_max_new_tokens, max_length - len(new_ids[i])))
                reflect_rows.append(i)
                reflect_prompts.append(list(prompt_ids[i]) + new_ids[i])
            elif choice == "answer":
                kept = shortened(body(completion_ids[i]), max_length - 1 - len(injected), tokenizer.decode)
                new_ids[i] = kept + injected + [eos]
                kept_tokens[i] = len(kept)
            elif choice == "solution":
                solution_boxed[i] = bool(suffix)
                body_ids = shortened(body_ids, max_length - 1 - len(suffix), tokenizer.decode)
                new_ids[i] = body_ids + suffix + [eos]
            strategy[i] = choice

        # Continuations: every process generates together when any needs to (generation may be collective), with
        # the same number of prompts and the same token budget on every process (see pad_continuation_batch).
        stats = self.accelerator.gather(torch.tensor([[len(reflect_rows), budget]], device=device)).view(-1, 2)
        counts = [int(n) for n in stats[:, 0].tolist()]
        continued: dict[int, tuple[list[int], list[float] | None]] = {}  # row -> continuation ids and log-probs
        if self._egpo_timings is not None:  # logged for every round GEC runs on (0 without continuations)
            self._egpo_timings.setdefault("gec_continuation_s", 0.0)
        if sum(counts):
            batch = pad_continuation_batch(reflect_prompts, counts, filler=list(prompt_ids[0]))
            with self._egpo_timed("gec_continuation_s"):  # the continuations alone, also counted in gec_s
                continuations, continuation_logps = self._continue_generation(batch, max(int(stats[:, 1].max()), 1))
            continuations = continuations[: len(reflect_rows)]  # the padding's continuations are dropped
            for k, (i, continuation) in enumerate(zip(reflect_rows, continuations, strict=True)):
                room_left = min(args.edge_gec_max_new_tokens, max_length - len(new_ids[i]))
                tail_logps = None if continuation_logps is None else list(continuation_logps[k])[:room_left]
                continued[i] = (list(continuation)[:room_left], tail_logps)
                new_ids[i] = new_ids[i] + continued[i][0]

        changed = [i for i in range(local_rows) if strategy[i] is not None]
        if changed and logprobs is not None:
            # vLLM's sampling log-probs: kept for the sampled tokens that stay, and for a continuation; NaN for the
            # injected tokens, which TRL's importance-sampling correction then leaves uncorrected (ratio 1).
            logprobs = [list(row) for row in logprobs]
            for i in changed:
                rewritten = list(logprobs[i][: kept_tokens[i]])
                if strategy[i] == "reflect":
                    tail_ids, tail_logps = continued.get(i, ([], None))
                    rewritten += [float("nan")] * (len(new_ids[i]) - len(rewritten) - len(tail_ids))
                    rewritten += list(tail_logps) if tail_logps is not None else [float("nan")] * len(tail_ids)
                rewritten += [float("nan")] * (len(new_ids[i]) - len(rewritten))
                logprobs[i] = rewritten
        if changed:
            completion_ids = new_ids
            completions = list(completions)
            conversational = is_conversational({"prompt": prompts[0]})
            texts = self.processing_class.batch_decode([new_ids[i] for i in changed], skip_special_tokens=True)
            for i, text in zip(changed, texts):
                completions[i] = [{"role": "assistant", "content": text}] if conversational else text

        self._gec_scored = {
            "rewards": rewards_per_func[start : start + local_rows],
            "changed": changed,
            "extra": pending_extra,
            "metrics": pending_metrics,
        }
        counts = torch.tensor(
            [float(eligible.sum())]
            + [float(sum(s == name for s in strategy)) for name in ("reflect", "answer", "solution")]
            + [float(sum(solution_as_answer)), float(sum(solution_boxed)), float(too_long)],
            device=device,
        )
        totals = self.accelerator.gather(counts.unsqueeze(0)).sum(dim=0) / (
            local_rows * self.accelerator.num_processes
        )
        names = "eligible reflect answer solution solution_as_answer solution_boxed answer_too_long".split()
        for name, value in zip(names, totals.tolist()):
            self._metrics["train"][f"gec/frac_{name}"].append(value)
        if too_long and not getattr(self, "_gec_warned_too_long", False):
            self._gec_warned_too_long = True
            logger.warning(
                "Guided Error Correction left %d incorrect completion(s) as sampled: their reference answer, with "
                "edge_gec_answer_template (or the suffix that boxes a solution's answer), does not fit "
                "max_completion_length=%d. gec/frac_answer_too_long counts them; raise max_completion_length or "
                "shorten the template.",
                *(too_long, max_length),
            )
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images

    @contextmanager
    def _gec_vllm_awake(self):
        """Keep a sleeping colocated vLLM engine awake over a round's generation and its continuations."""
        generation = getattr(self, "vllm_generation", None) if self.use_vllm else None
        awake = generation is not None and generation.mode == "colocate" and generation.enable_sleep_mode
        if not awake or self.args.edge_gec_reflect_prob <= 0:  # nothing sleeps, or no continuations
            yield
            return
        with self._egpo_timed("generation_s"):
            if generation._llm_weights_sleeping:  # level-2 sleep discarded the weights: push them (this wakes them)
                generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            generation.llm.wake_up(tags=["kv_cache"])
        generation.enable_sleep_mode = False  # TRL's generate neither wakes nor sleeps the engine inside the block
        try:
            yield
        finally:
            generation.enable_sleep_mode = True
            with self._egpo_timed("generation_s"):
                generation.llm.sleep(level=2)
            generation._llm_weights_sleeping = True

    def _gec_score_sampled(self, inputs, prompts, completions, completion_ids):
        """TRL's rewards of the sampled completions, their reward logs kept for :meth:`_gec_rescore` to log once."""
        before = {id(p): {k: len(v) for k, v in p.items()} for p in (self._pending_extra_logs, self._pending_metrics)}
        rewards_per_func = self._calculate_rewards(inputs, prompts, completions, completion_ids)
        taken = []
        for pending in (self._pending_extra_logs, self._pending_metrics):
            out = {}
            for key in list(pending):
                kept = before[id(pending)].get(key, 0)
                if len(pending[key]) > kept:
                    out[key] = list(pending[key][kept:])
                    del pending[key][kept:]
                if not pending[key]:
                    del pending[key]
            taken.append(out)
        return rewards_per_func, taken[0], taken[1]

    def _gec_rescore(self, calculate, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """TRL's scoring of a rewritten round, calling each reward function on the rewritten rows only."""
        state, self._gec_scored = self._gec_scored, None
        cached, rows, n = state["rewards"], state["changed"], len(prompts)
        extra: dict[str, list] = {}

        def subset(value):
            return [value[j] for j in rows] if isinstance(value, list) and len(value) == n else value

        def log_extra(column: str, values: list) -> None:
            extra.setdefault(column, []).extend(values)

        def arguments(prompts, completions, completion_ids, kwargs):
            kwargs = {key: subset(value) for key, value in kwargs.items()}
            if "log_extra" in kwargs:
                kwargs["log_extra"] = log_extra
            if "log_metric" in kwargs:
                kwargs["log_metric"] = lambda name, value: None
            return dict(
                prompts=subset(prompts),
                completions=subset(completions),
                completion_ids=subset(completion_ids),
                **kwargs,
            )

        def merged(i: int, outputs) -> list:
            values = [None if math.isnan(v) else v for v in cached[:, i].tolist()]
            for j, value in zip(rows, list(outputs), strict=True):
                values[j] = value
            return values

        def wrap(i: int, func):
            def wrapped(prompts, completions, completion_ids, **kwargs):
                return merged(i, func(**arguments(prompts, completions, completion_ids, kwargs)) if rows else [])

            return wrapped

        originals = list(self.reward_funcs)
        self.reward_funcs[:] = [wrap(i, func) for i, func in enumerate(originals)]
        try:
            rewards_per_func = calculate(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs[:] = originals
        for column in sorted(set(state["extra"]) | set(extra)):
            values = list(state["extra"].get(column, [None] * n))
            values += [None] * (n - len(values))
            for j, value in zip(rows, extra.get(column, [])):
                values[j] = value
            self._pending_extra_logs[column].extend(values[:n])
        for name, values in state["metrics"].items():
            self._pending_metrics[name].extend(values)
        return rewards_per_func

    def _continue_generation(
        self, prompt_ids: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One continuation of at most ``max_new_tokens`` per prompt, with its log-probs (vLLM) or ``None``."""
        if self.use_vllm:
            generation = self.vllm_generation
            previous = generation.max_completion_length
            generation.max_completion_length = max_new_tokens
            try:
                return self._generate_single_turn(prompt_ids, None, {}, 1)
            finally:
                generation.max_completion_length = previous
        previous = self.generation_config.max_new_tokens, self.generation_kwargs.get("max_new_tokens")
        self.generation_config.max_new_tokens = max_new_tokens
        self.generation_kwargs["max_new_tokens"] = max_new_tokens
        try:
            continuations, _ = self._generate_single_turn(prompt_ids, None, {}, 1)
        finally:
            self.generation_config.max_new_tokens, self.generation_kwargs["max_new_tokens"] = previous
        return continuations, None
