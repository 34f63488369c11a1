"""Verdict parsers (mtrain/rollout/judge_verdict.py) on what a judge model may write: a reward in [0, 1], or None
(counted, rewarded 0), never an exception and never a non-finite number."""
from __future__ import annotations

import math
import time

import pytest

from mtrain.rollout.judge import render
from mtrain.rollout.judge_verdict import make_parser, parse_score, parse_yes_no

HOSTILE = ["", " ", "\x00\x00", "🙂" * 500, "{response}", "NaN", "nan/10", "inf", "-inf", "1e999", "٣", "٣/١٠",
           "<|im_end|>", "\\boxed{", "(" * 5000, "9" * 5000, "yes" * 3000, "Score: " + "1" * 400, "-0", "0/0",
           "x" * 200_000]


@pytest.mark.parametrize("kind, kw", [("yes_no", {}), ("score", {"score_max": 10}),
                                      ("regex", {"pattern": r"Score:\s*([0-9.eE+-]+)"}),
                                      ("regex", {"pattern": "(.*)"})])
@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_outputs_give_a_reward_in_range_or_none(kind, kw, text):
    value = make_parser(kind, **kw)(text)
    assert value is None or (type(value) is float and math.isfinite(value) and 0.0 <= value <= 1.0)


@pytest.mark.parametrize("text, expected", [
    ("Yes, it is correct.", 1.0), ("no.", 0.0), ("NO! Not correct", 0.0), ("The answer is correct", 1.0),
    ("incorrect", 0.0), ("yesterday nothing", None), ("yes-no", 1.0), ("I cannot tell", None), ("", None),
    ("False", 0.0)])
def test_yes_no(text, expected):
    assert parse_yes_no(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("7", 0.7), ("Score: 7/10", 0.7), ("8 out of 10", 0.8), ("3/4", 0.75), ("-3", 0.0), ("42", 1.0),
    ("10.0", 1.0), ("score 5/0", None), ("v2.5 model says 5", 0.5), ("1e999", None), ("٣", None),
    ("1.2.3", None), ("abc", None), ("NaN", None), ("0/0", None),
    # a sentence's full stop ends a score; a denominator with no score before it is no verdict (not a full score)
    ("I give it 8.", 0.8), ("Score: 7/10.", 0.7), ("1.2.3.", None), ("?/10", None), ("Score: /10", None),
    ("Score: N/A out of 10", None), ("\u2176/10", None), ("out of 10", None)])
def test_score(text, expected):
    got = parse_score(text, 10.0)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_regex_reads_its_group_and_clips():
    p = make_parser("regex", pattern=r"reward=([^ ]+)")
    assert p("reward=0.25 done") == 0.25 and p("reward=7") == 1.0 and p("reward=-1") == 0.0
    assert p("reward=nan") is None and p("reward=inf") is None and p("reward=abc") is None and p("none") is None
    # only ASCII decimal numbers: float() would also read unicode digits and underscores
    assert p("reward=\u0663") is None and p("reward=\uff11") is None and p("reward=1_0") is None
    assert p("reward=.5") == 0.5 and p("reward=1e-3") == 0.001 and p("reward=+1.") == 1.0


def test_a_long_hostile_output_is_read_quickly():
    t0 = time.perf_counter()  # only the head is read: a megabyte of digits or words costs no more than 2000 chars
    assert make_parser("score")("1" * 10**6) is None  # 2000 digits: a number too large to be finite
    assert make_parser("yes_no")("x " * 10**6 + "yes") is None  # a verdict past the head is not read
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("kind, kw, message", [("regex", {}, "needs a pattern"),
                                               ("regex", {"pattern": "("}, "not a valid"),
                                               ("score", {"score_max": 0}, "score_max"), ("stars", {}, "unknown")])
def test_bad_parser_settings_are_one_line(kind, kw, message):
    with pytest.raises(ValueError, match=message):
        make_parser(kind, **kw)


def test_template_fills_once_and_keeps_other_braces():
    out = render("{prompt}|{answer}|{response}|{other}|{{x}}", "p {response}", "r {prompt}", ["4", "four"])
    assert out == "p {response}|4 or four|r {prompt}|{other}|{{x}}"
