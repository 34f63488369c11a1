"""Turning a judge model's verdict text into a reward in [0, 1], or None when the text holds no verdict.

The text comes from a model: it may be empty, endless, contradictory, full of numbers or of markup. A parser never
raises on it and never returns a non-finite number; None means "no verdict" and the judge counts it (reward 0).
Only the verdict's head is read (`MAX_VERDICT_CHARS`), so a hostile output cannot make a regex run long.
"""
from __future__ import annotations

import math
import re
from typing import Callable

MAX_VERDICT_CHARS = 2000

# a yes/no answer: the first of these words, as a word of its own (not "yesterday", "nothing")
_YES_NO = re.compile(r"\b(yes|no|correct|incorrect|true|false)\b", re.IGNORECASE)
_YES = {"yes", "correct", "true"}
# an ASCII number, optionally "N/M" or "N out of M"; unicode digits are not numbers here (float() would take them);
# not part of a word or of a dotted version ("v2", "1.2.3"), but a sentence's full stop may follow ("It gets 8.")
_SCORE = re.compile(r"(?<![\w.])(-?[0-9]+(?:\.[0-9]+)?)(?:\s*(?:/|out of)\s*([0-9]+(?:\.[0-9]+)?))?(?!\w|\.[0-9])",
                    re.IGNORECASE | re.ASCII)

# what parse_regex's group may hold: an ASCII decimal number (float() would also take "١", "1_0", " 5 ", "infinity")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def _clip01(x: float) -> float | None:
    if not math.isfinite(x):
        return None
    return min(max(x, 0.0), 1.0)


def parse_yes_no(text: str) -> float | None:
    """1.0 for the first yes/correct/true word, 0.0 for the first no/incorrect/false word; None for neither."""
    m = _YES_NO.search(text[:MAX_VERDICT_CHARS])
    if m is None:
        return None
    return 1.0 if m.group(1).lower() in _YES else 0.0


def parse_score(text: str, score_max: float) -> float | None:
    """The first number of the text as a share of `score_max` ("7", "7/10", "7 out of 10": the given denominator
    wins), clipped to [0, 1]; a negative score is 0. None when there is no number or it is not finite."""
    head = text[:MAX_VERDICT_CHARS]
    m = _SCORE.search(head)
    if m is None:
        return None
    before = head[:m.start()].rstrip().lower()
    if before.endswith("/") or re.search(r"\bout of$", before[-7:]):
        return None  # "?/10", "Score: /10", "N/A out of 10": the first number is a denominator; no score was given
    value = float(m.group(1))
    top = float(m.group(2)) if m.group(2) is not None else score_max
    if top <= 0:
        return None
    return _clip01(value / top)


def parse_regex(text: str, pattern: re.Pattern) -> float | None:
    """The pattern's first group, as a number clipped to [0, 1]; None when it does not match or is not a number."""
    m = pattern.search(text[:MAX_VERDICT_CHARS])
    if m is None or m.group(1) is None:
        return None
    raw = m.group(1).strip()
    if _NUMBER.fullmatch(raw) is None:
        return None
    return _clip01(float(raw))


def compile_pattern(pattern: str | None) -> re.Pattern:
    """reward.judge.pattern compiled; a ValueError (one line) when missing, invalid, or not exactly one group."""
    if not pattern:
        raise ValueError("parser=regex needs a pattern with one group, e.g. 'Score: ([0-9.]+)'")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a valid regular expression: {e}") from None
    if compiled.groups != 1:
        raise ValueError(f"{pattern!r} has {compiled.groups} groups; it needs exactly one (the reward)")
    return compiled


def make_parser(kind: str, *, score_max: float = 10.0, pattern: str | None = None) -> Callable[[str], float | None]:
    """The verdict parser reward.judge.parser names."""
    if kind == "yes_no":
        return parse_yes_no
    if kind == "score":
        if not (math.isfinite(score_max) and score_max > 0):
            raise ValueError(f"score_max must be a finite number > 0, got {score_max}")
        return lambda text: parse_score(text, score_max)
    if kind == "regex":
        compiled = compile_pattern(pattern)
        return lambda text: parse_regex(text, compiled)
    raise ValueError(f"unknown verdict parser {kind!r}; one of yes_no, score, regex")
