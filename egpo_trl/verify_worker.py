"""The math-verify worker process of :func:`egpo_trl.rewards.answers_match`.

Symbolic comparison can take unbounded time in C code no signal interrupts (``9^{9^{9^{9}}}``), so it runs here,
in an interpreter the caller kills past its deadline. That deadline is the only limit: math-verify's own timeout
answers "no match" when it fires, which would turn a correct answer wrong on a busy machine. Protocol: one JSON line
``[predicted, gold]`` per request on stdin, ``1`` or ``0`` per answer on stdout; it ends when stdin closes. It runs
by its path, without the package (whose import pulls in torch and TRL).
"""

from __future__ import annotations

import json
import logging
import sys
from functools import lru_cache


@lru_cache(maxsize=65536)
def _parse(expression: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    # Wrapping in \boxed{} makes math-verify read the whole expression as one answer.
    return parse(
        "\\boxed{" + expression + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=None,  # the caller's deadline bounds the time (see the module docstring)
    )


def symbolic_match(predicted: str, gold: str) -> bool:
    """math-verify's decision, in this process; any failure is ``False``."""
    from math_verify import verify

    try:
        gold_parsed = _parse(gold)
        pred_parsed = _parse(predicted)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
        return False


def main() -> int:
    logging.disable(logging.CRITICAL)  # math-verify logs every timeout and parse failure
    requests, replies = sys.stdin, sys.stdout
    sys.stdout = sys.stderr  # nothing a library prints may reach the protocol stream
    import math_verify  # noqa: F401  (import once, before the first request: a missing install fails the start)

    symbolic_match("1/2", "0.5")  # the parser's first use is slow: here, not within the first request's deadline

    replies.write("ready\n")
    replies.flush()
    for line in requests:
        try:
            predicted, gold = json.loads(line)
            equal = symbolic_match(str(predicted), str(gold))
        except Exception:  # noqa: BLE001
            equal = False
        replies.write("1\n" if equal else "0\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
