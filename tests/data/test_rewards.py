"""Reward functions: answer extraction/normalisation, loading by name, and the safe_reward guard."""
import math
import time

import numpy as np
import pytest
import torch

from mtrain.data import (PromptSample, RewardError, exact_match_reward, extract_answer, load_reward_fn,
                         normalize_answer, safe_reward, score_responses)


@pytest.mark.parametrize("text, expected", [
    ("17 + 25 = 42", "42"),
    ("I think 40, no wait: 42.", "42"),
    ("so \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),  # boxed wins over a later number, braces nested
    ("first \\boxed{3} then \\boxed{5}", "5"),
    ("steps...\n#### 1,234", "1,234"),
    ("-7 is the result", "-7"),
    ("no digits here", None),
    ("\\boxed{unclosed", None),  # unbalanced braces: no boxed answer, and no number to fall back to
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("raw, canonical", [
    ("42", "42"), (" 42. ", "42"), ("42.0", "42"), ("1,000", "1000"), ("$5$", "5"), ("-0", "0"),
    (".5", "0.5"), ("2.50", "2.5"), ("\\text{Paris}", "paris"), ("  New   York ", "new york"),
])
def test_normalize_answer(raw, canonical):
    assert normalize_answer(raw) == canonical


def test_exact_match_reward():
    assert exact_match_reward("The answer is 42", "42") == 1.0
    assert exact_match_reward("The answer is 42.0", 42) == 1.0
    assert exact_match_reward("\\boxed{1,000}", "1000") == 1.0
    assert exact_match_reward("The answer is 32", "42") == 0.0
    assert exact_match_reward("I don't know", "42") == 0.0
    assert exact_match_reward("It is 7", ["6", "7"]) == 1.0  # any of several accepted answers
    assert exact_match_reward("x = 18", "Natalia sold 48/2 = 24 ... #### 18") == 1.0  # raw GSM8K answer


def test_load_reward_fn_by_module_and_file(tmp_path):
    assert load_reward_fn("mtrain.data.rewards:exact_match_reward") is exact_match_reward
    (tmp_path / "my_reward.py").write_text("def length_reward(response, answer):\n    return len(response)\n")
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:length_reward")
    assert fn("abc", "x") == 3


def test_load_reward_fn_errors(tmp_path):
    (tmp_path / "bad.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "two.py").write_text("VALUE = 3\ndef three(a, b, c):\n    return 1\n")
    cases = [
        ("no_colon", "must look like 'package.module:function'"),
        ("mtrain.data.no_such_module:f", "cannot import module 'mtrain.data.no_such_module'"),
        ("mtrain.data.rewards:exact_match_rewrd", "did you mean 'mtrain.data.rewards:exact_match_reward'?"),
        (f"{tmp_path / 'missing.py'}:f", "file not found"),
        (f"{tmp_path / 'bad.py'}:f", "RuntimeError: boom at import"),
        (f"{tmp_path / 'two.py'}:VALUE", "is a int, not a function"),
        (f"{tmp_path / 'two.py'}:three", "must accept (response, answer) positionally"),
    ]
    for spec, message in cases:
        with pytest.raises(RewardError) as e:
            load_reward_fn(spec)
        assert message in str(e.value), spec


def raises(response, answer):
    raise KeyError("label")


@pytest.mark.parametrize("fn, message", [
    (raises, "reward function 'raises' on sample 12 raised KeyError: 'label'"),
    (lambda r, a: None, "returned None (NoneType); expected a finite number"),
    (lambda r, a: "1.0", "returned '1.0' (str); expected a finite number"),
    (lambda r, a: float("nan"), "returned nan; expected a finite number"),
    (lambda r, a: float("inf"), "returned inf; expected a finite number"),
    (lambda r, a: [1.0], "returned [1.0] (list)"),
    (lambda r, a: torch.ones(2), "returned Tensor that is not one number"),
])
def test_safe_reward_turns_bad_results_into_one_error(fn, message):
    with pytest.raises(RewardError) as e:
        safe_reward(fn, "resp", "42", sample_id=12)
    assert message in str(e.value) and "sample 12" in str(e.value)


def test_safe_reward_accepts_numbers_and_passes_declared_keywords():
    assert safe_reward(lambda r, a: True, "x", "y") == 1.0
    assert safe_reward(lambda r, a: np.float32(0.5), "x", "y") == 0.5
    assert safe_reward(lambda r, a: torch.tensor(2), "x", "y") == 2.0
    seen = {}

    def with_prompt(response, answer, prompt):
        seen["prompt"] = prompt
        return 1

    def with_kwargs(response, answer, **kw):
        seen["kw"] = kw
        return 0
    safe_reward(with_prompt, "x", "y", prompt="P", metadata={"m": 1})
    safe_reward(with_kwargs, "x", "y", prompt="P", metadata={"m": 1})
    assert seen == {"prompt": "P", "kw": {"prompt": "P", "metadata": {"m": 1}}}


def test_safe_reward_timeout():
    def slow(response, answer):
        time.sleep(2)
        return 1.0
    t0 = time.monotonic()
    with pytest.raises(RewardError, match="on sample 3 timed out after 0.05 s"):
        safe_reward(slow, "x", "y", sample_id=3, timeout_s=0.05)
    assert time.monotonic() - t0 < 1.0
    assert safe_reward(exact_match_reward, "42", "42", timeout_s=5) == 1.0
    with pytest.raises(RewardError, match="raised KeyError"):
        safe_reward(raises, "x", "y", timeout_s=5)


def test_score_responses_names_sample_and_response():
    samples = [PromptSample(index=7, prompt="What is 1 + 1?", answer="2")] * 3
    assert score_responses(exact_match_reward, samples, ["2", "3", "two"]) == [1.0, 0.0, 0.0]

    def picky(response, answer):
        return math.nan if response == "bad" else 1.0
    with pytest.raises(RewardError, match=r"on sample 7 \(response 1\) returned nan"):
        score_responses(picky, samples, ["ok", "bad", "ok"])
    with pytest.raises(RewardError, match="3 samples but 2 responses"):
        score_responses(picky, samples, ["ok", "ok"])
