"""Reference answers and scoring: the last ``\\boxed{}`` compared with :func:`egpo_trl.rewards.answers_match` after
each answer format's normalisation."""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from typing import Any

from egpo_trl.rewards import _gold_to_text, answers_match, extract_last_boxed

ANSWER_FORMATS = ("math", "gsm8k", "minerva", "choice")
CHOICE_LETTERS = string.ascii_uppercase


_SCIENTIFIC_RE = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)\s*[eE]\s*([+-]?\d+)(?![\w.])")
_UNIT_RE = re.compile(r"(?:\\[,;:! ]|~|\s)*\\(?:mathrm|text|textrm|mbox|operatorname)\s*\{[^{}]*\}\s*$")
_TRAILING_SYMBOLS = (r"^\circ", r"^{\circ}", r"\circ", r"^{\prime \prime}", r"^{\prime\prime}", r"^{\prime}")
_TRAILING_SYMBOLS += (r"\%", "%", r"\AA", r"\mathring{A}", r"\;", r"\,", r"\!", "~", ".")


def normalize_minerva(answer: str) -> str:
    """A Minerva Math answer without trailing units, degrees, primes and ``$``, in ``a \\times 10^{b}`` notation."""
    text = answer.replace("$", "").strip()
    text = re.sub(r"^[a-zA-Z_]\w*\s*=\s*", "", text) if text.count("=") == 1 else text
    previous = None
    while previous != text:
        previous = text
        text = _UNIT_RE.sub("", text).strip()
        for symbol in _TRAILING_SYMBOLS:
            if text.endswith(symbol) and len(text) > len(symbol):
                text = text[: -len(symbol)].rstrip()
    return _SCIENTIFIC_RE.sub(lambda m: f"{m.group(1)} \\times 10^{{{int(m.group(2))}}}", text)


def gold_answers(row: dict[str, Any], answer_format: str, answer_field: str) -> list[str]:
    """The accepted reference answers of a row, as strings (first = canonical; for ``choice``, the 0-based index)."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"Unknown answer format {answer_format!r}; choose one of {ANSWER_FORMATS}.")
    if answer_field not in row:
        raise KeyError(
            f"The row has no answer field {answer_field!r} (fields: {sorted(row)}); pass --answer-field NAME."
        )
    value = row[answer_field]
    if answer_format == "choice":  # a 0-based index or a letter (2 or "C")
        text = str(value).strip().strip("()").upper()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return [str(int(value))]
        if text.isdigit() or (len(text) == 1 and text in CHOICE_LETTERS):
            return [str(int(text)) if text.isdigit() else str(CHOICE_LETTERS.index(text))]
        raise ValueError(f"Cannot read a choice index from {value!r}; give a 0-based index or a letter.")
    values = value if isinstance(value, (list, tuple)) else [value]
    answers: list[str] = []
    for item in values:
        text = _gold_to_text(item)
        if answer_format == "gsm8k":  # the final number of a worked solution, after its last ####
            text = text.rsplit("####", 1)[-1].strip().replace(",", "")
        elif answer_format == "minerva" and "\\boxed" in text:
            text = extract_last_boxed(text) or text
        text = text.strip()
        if text and text not in answers:
            answers.append(text)
    if not answers:
        raise ValueError(f"The row has an empty reference answer in field {answer_field!r}.")
    return answers


_LETTER_ONLY_RE = re.compile(r"^\(?\s*([A-Z])\s*\)?\s*[.:)]?$")
_LETTER_PREFIX_RE = re.compile(r"^\(?\s*([A-Z])\s*[).:]\s+\S")


def _strip_latex_text(text: str) -> str:
    text = text.strip().strip("$").strip()
    previous = None
    while previous != text:
        previous = text
        text = re.sub(r"\\(?:text|textbf|mathrm|mathbf|textit|mbox)\s*\{([^{}]*)\}", r"\1", text).strip()
    return text


def _loose_text(text: str) -> str:
    text = _strip_latex_text(text).lower()
    return re.sub(r"[\s.,;:!?'\"`()\[\]{}$\\]+", "", text)


def choice_index(prediction: str | None, choices: Sequence[str]) -> int | None:
    """The choice a boxed prediction names, by letter (``B``, ``(B)``, ``\\text{B}``, ``B. text``) or by text; ``None`` if not one."""
    if prediction is None:
        return None
    text = _strip_latex_text(prediction)
    letters = CHOICE_LETTERS[: len(choices)]
    for pattern in (_LETTER_ONLY_RE, _LETTER_PREFIX_RE):
        match = pattern.match(text)
        if match and match.group(1) in letters:
            return letters.index(match.group(1))
    wanted = _loose_text(text)
    if not wanted:
        return None
    exact = [index for index, choice in enumerate(choices) if _loose_text(str(choice)) == wanted]
    if len(exact) == 1:
        return exact[0]
    if exact:
        return None
    equal = [index for index, choice in enumerate(choices) if answers_match(text, str(choice))]
    return equal[0] if len(equal) == 1 else None


def _any_match(verdicts: Iterable[bool | None]) -> bool | None:
    """``True`` at a match; else ``None`` when a comparison gave no verdict."""
    unscored = False
    for verdict in verdicts:
        if verdict:
            return True
        unscored |= verdict is None
    return None if unscored else False


def score_completion(
    completion: str, gold: Sequence[str], answer_format: str, choices: Sequence[str] | None = None
) -> tuple[str | None, bool | None]:
    """``(extracted, correct)``: the content of the last ``\\boxed{}`` (for ``choice``, the letter it names, when
    it names one) and whether it matches one of ``gold``; ``None`` (unscored) when math-verify gave no verdict."""
    boxed = extract_last_boxed(completion)
    if answer_format == "choice":
        if choices is None:
            raise ValueError("The 'choice' answer format needs the choices of the question.")
        index = choice_index(boxed, choices)
        if index is None:
            return boxed, False
        return CHOICE_LETTERS[index], index == int(gold[0])
    if boxed is None:
        return None, False
    if answer_format == "gsm8k":
        prediction = boxed.replace(",", "").replace("\\!", "")
        return boxed, _any_match(answers_match(prediction, reference) for reference in gold)
    if answer_format == "minerva":
        prediction = normalize_minerva(boxed)
        return boxed, _any_match(
            answers_match(predicted, reference)
            for given in gold
            for predicted, reference in ((prediction, normalize_minerva(given)), (boxed, given))
        )
    return boxed, _any_match(answers_match(boxed, reference) for reference in gold)
