"""Outcome rewards for verifiable math (paper Eq. 1) as TRL reward functions: ``+1`` when the last ``\\boxed{...}``
equals the ground truth by math-verify, ``-1`` otherwise, ``None`` (unscored) without a verdict."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from typing import Any

logger = logging.getLogger(__name__)

CORRECT_REWARD = 1.0
INCORRECT_REWARD = -1.0

# Answers longer, nested deeper, or with a power tower or a longer exponent than these get the string match only.
MAX_ANSWER_CHARS = 1000
MAX_NESTING = 12
MAX_EXPONENT_DIGITS = 4
VERIFY_CPU_LIMIT_S = 3.0  # CPU time of one comparison in the worker; past it, no match (cached)
VERIFY_TIMEOUT_S = 8.0  # wall clock of one comparison; past it the worker is replaced and asked once more
WORKER_START_TIMEOUT_S = 120.0  # importing sympy and math-verify

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")


def completion_text(completion: Any) -> str:
    """The text of a completion given as a string or as chat messages (the assistant turns joined)."""
    if completion is None or isinstance(completion, str):
        return completion or ""
    if isinstance(completion, dict):
        content = completion.get("content", "")
        if isinstance(content, list):  # multimodal content blocks
            return "".join(block.get("text", "") for block in content if isinstance(block, dict))
        return str(content or "")
    if isinstance(completion, Sequence):
        return "".join(completion_text(message) for message in completion)
    return str(completion)


TEMPLATE_PROBE_ANSWER = "17/3"


def answer_template_probe(template: str) -> tuple[str, bool]:
    """``template`` rendered with :data:`TEMPLATE_PROBE_ANSWER`, and whether its last box holds exactly that answer."""
    rendered = template.replace("{answer}", TEMPLATE_PROBE_ANSWER)
    return rendered, extract_last_boxed(rendered) == TEMPLATE_PROBE_ANSWER


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``, with balanced
    braces; ``None`` without a box or when the last one is not closed."""
    if not text:
        return None
    for match in reversed(list(_BOX_RE.finditer(text))):
        start = match.end()
        rest = text[start:]
        stripped = rest.lstrip()
        if stripped.startswith("{"):
            open_at = start + (len(rest) - len(stripped))
            depth = 0
            for pos in range(open_at, len(text)):
                char = text[pos]
                if char == "{" and text[pos - 1] != "\\":
                    depth += 1
                elif char == "}" and text[pos - 1] != "\\":
                    depth -= 1
                    if depth == 0:
                        return text[open_at + 1 : pos].strip()
            return None  # the last box is not closed: no answer
        token = re.match(r" \s*([^\s$]+)", rest)  # \boxed 5
        if token:
            return token.group(1)
    return None


def _normalize(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    answer = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", answer)
    for old, new in (("\\!", ""), ("\\,", ""), ("\\ ", ""), (" ", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac")):
        answer = answer.replace(old, new)
    return answer.replace("\\left", "").replace("\\right", "").rstrip(".")


def _too_costly(answer: str) -> bool:
    """Whether ``answer`` is refused before symbolic parsing (size, nesting, power towers, huge exponents)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return True
    if max(accumulate(1 if char in "{([" else -1 if char in "})]" else 0 for char in answer), default=0) > MAX_NESTING:
        return True
    compact = answer.replace(" ", "")
    for match in re.finditer(r"(\^|\*\*)", compact):
        exponent = compact[match.end() :]
        if exponent.startswith("{"):
            depths = accumulate(1 if char == "{" else -1 if char == "}" else 0 for char in exponent)
            end = next((pos for pos, depth in enumerate(depths) if depth == 0), len(exponent))
            exponent_text, rest = exponent[1:end], exponent[end + 1 :]
        else:
            token = re.match(r"[^\^*+\-=/(){}\[\],]*", exponent)
            exponent_text, rest = token.group(0), exponent[token.end() :]
        if "^" in exponent_text or "**" in exponent_text or rest.startswith(("^", "**")):
            return True  # a tower: a^{b^c}, a^b^c
        digits = re.sub(r"[^0-9]", "", exponent_text)
        if len(digits) > MAX_EXPONENT_DIGITS or "!" in exponent_text:
            return True
    return bool(re.search(r"\d{5,}\s*!", compact))  # the factorial of a large number


_WORKER_BOOT = (
    "import runpy, sys; sys.path[:] = [p for p in sys.path if p]; runpy.run_path(sys.argv[1], run_name='__main__')"
)


_NEXT = {1: "asking a fresh worker again."}
_NEXT[2] = "no verdict, so the completion is left unscored (reward None, not -1) and nothing is cached."


class _NoVerdict(Exception):
    """The worker timed out or died, and so did the fresh one asked again."""


class _VerifyWorker:
    """One math-verify worker process per process, shared by its threads, replaced when it overruns or dies."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = None
        self._buffer = b""
        atexit.register(self.close)

    def _start(self) -> None:
        # The worker file alone, not the package (whose import pulls in torch and TRL), nor the current folder.
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, worker],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        self._owner = os.getpid()
        self._buffer = b""
        try:
            ready = self._read_line(WORKER_START_TIMEOUT_S)
        except EOFError:
            ready = None
        if ready != b"ready":
            self.close()
            raise RuntimeError(
                f"The math-verify worker process (egpo_trl/verify_worker.py, run by {sys.executable}) did not start; check "
                "that math-verify is installed in this environment (pip install 'math-verify[antlr4_13_2]')."
            )

    def _read_line(self, timeout: float) -> bytes | None:
        """The worker's next line, ``None`` past ``timeout``; ``EOFError`` when it ended (selectors take fds >= 1024)."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    return None
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and self._owner == os.getpid():
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):  # a request still buffered for a worker that died
                    stream.close()

    def _ask(self, request: bytes, timeout: float) -> bool | str:
        """The worker's verdict on ``request``, or why there is none: it timed out, or it died (and how)."""
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.flush()
            reply = self._read_line(timeout)
        except (EOFError, OSError):  # its output closed, or its input (BrokenPipeError): it ended
            self._proc.kill()  # changes nothing if it has ended; bounds the wait below if it has not
            code = self._proc.wait()
            if code >= 0:
                return f"worker died (exit code {code})"
            name = next((s.name for s in signal.Signals if s == -code), f"signal {-code}")
            return f"worker died (killed by {name})"
        if reply is None:
            return f"timed out after {timeout:g} s"
        return reply == b"1"

    def match(self, predicted: str, gold: str, timeout: float) -> bool:
        """math-verify's verdict; a worker that overruns ``timeout`` or dies is replaced and the fresh one asked once
        more, else :class:`_NoVerdict`."""
        request = (json.dumps([predicted, gold, VERIFY_CPU_LIMIT_S]) + "\n").encode()
        with self._lock:
            for attempt in (1, 2):
                if self._proc is None or self._owner != os.getpid() or self._proc.poll() is not None:
                    if self._owner != os.getpid():
                        self._proc = None  # a forked child: the parent's worker is not ours to use
                    self.close()
                    self._start()
                verdict = self._ask(request, timeout)
                if isinstance(verdict, bool):
                    return verdict
                self.close()  # kill what is left of it: the next comparison starts a fresh one
                logger.warning(
                    "math-verify %s comparing %.80r with %.80r; %s", verdict, predicted, gold, _NEXT[attempt]
                )
            raise _NoVerdict(verdict)


_WORKER = _VerifyWorker()


@lru_cache(maxsize=65536)  # verdicts only: _NoVerdict is raised, so not cached
def _symbolic_match(predicted: str, gold: str) -> bool:
    return _WORKER.match(predicted, gold, VERIFY_TIMEOUT_S)


def answers_match(predicted: str | None, gold: Any) -> bool | None:
    """Whether an extracted answer equals the ground truth (string match, then math-verify in the worker process);
    ``None`` when the worker gave no verdict. Never raises."""
    if predicted is None or gold is None:
        return False
    gold_text = _gold_to_text(gold)
    if not gold_text or not predicted.strip():
        return False
    if _normalize(predicted) == _normalize(gold_text):
        return True
    if _too_costly(predicted) or _too_costly(gold_text):
        return False
    try:
        return _symbolic_match(predicted, gold_text)
    except _NoVerdict:
        return None


def _gold_to_text(gold: Any) -> str:
    if isinstance(gold, (list, tuple)):
        return str(gold[0]) if gold else ""
    return str(int(gold)) if isinstance(gold, float) and gold.is_integer() else str(gold).strip()


def boxed_accuracy_reward(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float | None]:
    """Paper Eq. 1: ``+1.0`` when the last ``\\boxed{}`` of a completion verifies against ``answer``, ``-1.0``
    otherwise, ``None`` (unscored) without a verdict."""
    if len(answer) != len(completions):
        raise ValueError(
            f"boxed_accuracy_reward got {len(completions)} completions but {len(answer)} answers; the dataset needs "
            "an `answer` column with one ground truth per prompt."
        )
    rewards = []
    for completion, gold in zip(completions, answer):
        equal = answers_match(extract_last_boxed(completion_text(completion)), gold)
        rewards.append(None if equal is None else CORRECT_REWARD if equal else INCORRECT_REWARD)
    return rewards


_THINK_RE = re.compile(r"^\s*<think>.*?</think>.*\\(?:boxed|fbox)\s*\{", re.DOTALL)


def think_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """``1.0`` when a completion reasons inside ``<think>...</think>`` and then gives a ``\\boxed{}`` answer, else
    ``0.0`` (a shaping bonus)."""
    return [1.0 if _THINK_RE.match(completion_text(c)) else 0.0 for c in completions]


def make_overlong_penalty_reward(max_length: int, buffer_length: int, penalty_factor: float = 1.0):
    """DAPO's soft overlong punishment (Eq. 13), TRL's ``get_soft_overlong_punishment`` times ``penalty_factor``, as
    a reward function named ``overlong_penalty``."""
    from trl.rewards import get_soft_overlong_punishment

    if not 1 <= buffer_length <= max_length:
        raise ValueError(
            f"buffer_length must be in [1, max_length={max_length}], got {buffer_length}; DAPO uses a buffer of a "
            "quarter of the maximum length."
        )
    punishment = get_soft_overlong_punishment(max_length, buffer_length)

    def overlong_penalty(completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any):
        if completion_ids is None:
            raise ValueError("overlong_penalty needs the completions' token ids (`completion_ids`, which TRL passes).")
        return [penalty_factor * value for value in punishment(completion_ids)]

    return overlong_penalty


def with_overlong_reward(reward_funcs: Any, args: Any) -> Any:
    """The reward functions, with DAPO's overlong penalty appended when ``overlong_buffer_length`` is set."""
    if args.overlong_buffer_length is None:
        return reward_funcs
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if any(getattr(func, "__name__", None) == "overlong_penalty" for func in funcs):
        raise ValueError("overlong_buffer_length adds overlong_penalty itself: remove it from reward_funcs.")
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs) + 1:
        raise ValueError(f"overlong_buffer_length adds a reward: reward_weights needs {len(funcs) + 1} entries.")
    length, factor = args.overlong_buffer_length, args.overlong_penalty_factor
    return [*funcs, make_overlong_penalty_reward(args.max_completion_length, length, factor)]
