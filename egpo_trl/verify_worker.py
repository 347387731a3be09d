"""The math-verify worker process of :func:`egpo_trl.rewards.answers_match`: one JSON line ``[predicted, gold,
cpu_seconds]`` per request on stdin, ``1`` or ``0`` per answer on stdout (``0`` past ``cpu_seconds`` of CPU time)."""

from __future__ import annotations

import json
import logging
import signal
import sys
from functools import lru_cache


@lru_cache(maxsize=65536)
def _parse(expression: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(  # in \boxed{}, so that the whole expression is read as one answer
        "\\boxed{" + expression + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=None,  # the CPU-time limit and the caller's deadline bound the time
    )


def symbolic_match(predicted: str, gold: str) -> bool:
    """math-verify's decision, in this process; any failure is ``False``."""
    from math_verify import verify

    try:
        gold_parsed, pred_parsed = _parse(gold), _parse(predicted)
        return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an unparsable answer is a wrong answer
        return False


class _OutOfCpuTime(BaseException):
    """Raised by the CPU-time timer; a BaseException, so that math-verify's ``except Exception`` lets it through."""


def _out_of_cpu_time(signum, frame):
    raise _OutOfCpuTime


def main() -> int:
    logging.disable(logging.CRITICAL)  # math-verify logs every timeout and parse failure
    requests, replies = sys.stdin, sys.stdout
    sys.stdout = sys.stderr  # nothing a library prints may reach the protocol stream
    import math_verify  # noqa: F401  (import once, before the first request: a missing install fails the start)

    signal.signal(signal.SIGPROF, _out_of_cpu_time)
    symbolic_match("1/2", "0.5")  # the parser's first use is slow: here, not within the first request's deadline

    replies.write("ready\n")
    replies.flush()
    for line in requests:
        try:
            predicted, gold, cpu_seconds = json.loads(line)
            signal.setitimer(signal.ITIMER_PROF, float(cpu_seconds))
            try:
                equal = symbolic_match(str(predicted), str(gold))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except (Exception, _OutOfCpuTime):  # noqa: BLE001 - also a timer that fires as the comparison returns
            equal = False
        replies.write("1\n" if equal else "0\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
