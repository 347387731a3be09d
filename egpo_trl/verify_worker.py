"""The math-verify worker process of :func:`egpo_trl.rewards.answers_match`.

Symbolic comparison of model output can take unbounded time (``9^{9^{9^{9}}}`` asks sympy for an integer with
hundreds of millions of digits, in C code that no signal interrupts), and math-verify's own timeout is a signal alarm
that works only in the main thread. So the comparison runs here, in a separate interpreter that the caller kills
when it overruns its deadline. That deadline is the only time limit: math-verify's own timeout is off, because it
answers "no match" when it fires (and a parse cut short would be cached here as unparsable), so a worker held up by
a busy machine would turn a correct answer into a wrong one.

Protocol: one JSON line per request on stdin, ``[predicted, gold]``; one line per answer on stdout, ``1`` (equal) or
``0``. The process ends when stdin closes. :mod:`egpo_trl.rewards` runs this file by its path (not as part of the
package, whose import would pull in torch and TRL).
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
