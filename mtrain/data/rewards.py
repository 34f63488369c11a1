"""Reward functions and the guard every reward call goes through.

A reward function takes `(response: str, answer)` positionally and may also declare the keywords `prompt`,
`metadata` and `trajectory` (or **kwargs) to receive them (multi-turn rollouts pass the whole `Trajectory`,
mtrain/rollout/trajectory.py); it returns a finite number. Point `reward.fn` at one with
"package.module:function" or "path/to/file.py:function".

`safe_reward` turns a function that raises, hangs past its timeout, or returns a non-number (None, a
string, NaN) into one RewardError naming the sample: a broken reward must never train as 0.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import re
import threading
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable, Sequence

from mtrain.data.boxed import last_boxed
from mtrain.data.datasets import PromptSample

RewardFn = Callable[..., float]


class RewardError(RuntimeError):
    """A reward function that cannot be loaded or did not produce a finite number for a sample."""


def finite_reward(value: Any, who: str) -> float:
    """`value` as a finite float, or one RewardError naming `who` (the sample, session or tool it came from).
    Every reward that enters a batch passes here: a NaN or infinite reward would poison the whole group's
    advantages; an int too large for a float (10**400) is refused rather than overflowing."""
    if isinstance(value, (str, bytes)) or value is None or not hasattr(value, "__float__"):
        raise RewardError(f"{who} returned {value!r} ({type(value).__name__}); expected a finite number")
    try:
        score = float(value)
    except (TypeError, ValueError, OverflowError) as e:  # a tensor with several elements, an int beyond float
        raise RewardError(f"{who} returned {type(value).__name__} that is not one number (or not finite): {e}") from None
    if not math.isfinite(score):
        raise RewardError(f"{who} returned {score}; expected a finite number")
    return score


# ---- answer extraction ------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last \\boxed{} content, else what follows the last GSM8K-style
    '####', else the last number in the text. None when there is nothing that looks like an answer."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(text: str) -> str:
    """Canonical form for comparison: numbers as plain decimals ("1,000.0" -> "1000", "-0" -> "0",
    ".5" -> "0.5"), otherwise lower-case with collapsed whitespace and outer $/. stripped."""
    s = text.strip().strip("$").strip()
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    s = s.rstrip(".").strip()
    num = s.replace(",", "").replace(" ", "")
    try:
        d = Decimal(num)
    except InvalidOperation:
        return " ".join(s.lower().split())
    if not d.is_finite():
        return " ".join(s.lower().split())
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def _expected_answers(answer: Any) -> list[str]:
    items = answer if isinstance(answer, (list, tuple)) else [answer]
    out = []
    for a in items:
        a = str(a)
        if "####" in a or "\\boxed{" in a:  # raw GSM8K/MATH solutions: compare against their final answer
            a = extract_answer(a) or a
        out.append(normalize_answer(a))
    return out


def digit_share_reward(response: str, answer: Any = None, **_: Any) -> float:
    """A shaping reward for smoke runs of random tiny models: the share of digits in the response. Exact match
    is ~never hit by a random model, so every advantage would be zero and nothing would train."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def exact_match_reward(response: str, answer: Any, **_: Any) -> float:
    """1.0 when the response's final answer equals the expected one (or any of a list), else 0.0."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    return 1.0 if normalize_answer(got) in _expected_answers(answer) else 0.0


# ---- loading a reward function ------------------------------------------------------------------------

def load_object(spec: str, what: str = "reward function", error: type[Exception] = RewardError) -> Any:
    """Resolve "package.module:name" or "path/to/file.py:name" (reward functions, rollout functions, tools)."""
    if ":" not in spec:
        example = f"{spec}:FUNCTION" if spec.endswith(".py") else "path/to/file.py:function"
        raise error(f"{what} {spec!r} must look like 'package.module:function' or 'path/to/file.py:function' "
                    f"(here: '{example}')")
    module_name, attr = spec.rsplit(":", 1)
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise error(f"{what} {spec!r}: file not found: {path}")
        mod_spec = importlib.util.spec_from_file_location(f"mtrain_user_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise error(f"{what} {spec!r}: importing {path} failed: "
                        f"{type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            as_file = Path(*module_name.split(".")).with_suffix(".py")
            hint = (f"; a file is named by its path: '{as_file}:{attr}'" if as_file.is_file() else
                    "; a file of your own is named by its path: 'path/to/file.py:function'")
            raise error(f"{what} {spec!r}: cannot import module '{module_name}': {e}{hint}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean '{module_name}:{close[0]}'?" if close else ""
        raise error(f"{what} {spec!r}: module '{module_name}' has no attribute '{attr}'{hint}")
    return fn


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve "package.module:function" or "path/to/file.py:function" to a callable."""
    fn = load_object(spec)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("response", "answer")
    except TypeError as e:
        raise RewardError(f"reward function {spec!r} must accept (response, answer) positionally: {e}") from None
    except ValueError:  # builtins without a signature: let the call decide
        pass
    return fn


_KEYWORDS = ("prompt", "metadata", "trajectory")  # trajectory: multi-turn rollouts pass the whole Trajectory


def _accepted_keywords(fn: RewardFn) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(_KEYWORDS)
    return frozenset(p.name for p in params if p.name in _KEYWORDS
                     and p.kind is not inspect.Parameter.POSITIONAL_ONLY)


def _call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any, BaseException | None]:
    # A daemon thread: a hung reward function cannot be killed, but it must not block the run or its exit.
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the caller with the sample's name
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="mtrain-reward")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return False, None, None
    return True, box.get("value"), box.get("error")


def safe_reward(fn: RewardFn, response: str, answer: Any, *, prompt: Any = None,
                metadata: dict | None = None, sample_id: Any = None, timeout_s: float | None = None,
                trajectory: Any = None) -> float:
    """fn(response, answer[, prompt=, metadata=]) as a finite float, or one RewardError naming the sample."""
    name = getattr(fn, "__qualname__", repr(fn))
    who = f"reward function '{name}' on sample {sample_id}"
    given = (("prompt", prompt), ("metadata", metadata or {})) + ((("trajectory", trajectory),) if trajectory else ())
    kwargs = {k: v for k, v in given if k in _accepted_keywords(fn)}
    call = functools.partial(fn, response, answer, **kwargs)
    if timeout_s is None:
        try:
            value, error = call(), None
        except Exception as e:  # noqa: BLE001
            value, error = None, e
    else:
        finished, value, error = _call_with_timeout(call, timeout_s)
        if not finished:
            raise RewardError(f"{who} timed out after {timeout_s} s (response starts {response[:120]!r})")
    if error is not None:
        raise RewardError(f"{who} raised {type(error).__name__}: {error} "
                          f"(response starts {response[:120]!r})") from error
    return finite_reward(value, who)


def score_responses(fn: RewardFn, samples: Sequence[PromptSample], responses: Sequence[str], *,
                    timeout_s: float | None = None) -> list[float]:
    """Rewards for responses[i] to samples[i] (a group repeats its sample), through safe_reward."""
    if len(samples) != len(responses):
        raise RewardError(f"score_responses: {len(samples)} samples but {len(responses)} responses")
    batch = getattr(fn, "score_batch", None)
    if callable(batch):  # a reward that scores a group at once (the LLM judge, mtrain/rollout/judge.py); it keeps
        # its own per-call timeout and turns a failed call into a counted 0, so reward.timeout_s does not wrap it
        values = batch(list(samples), list(responses))
        if len(values) != len(responses):
            raise RewardError(f"{type(fn).__name__}.score_batch returned {len(values)} rewards for "
                              f"{len(responses)} responses")
        return [finite_reward(v, f"{type(fn).__name__} on sample {s.index} (response {i})")
                for i, (s, v) in enumerate(zip(samples, values))]
    return [safe_reward(fn, r, s.answer, prompt=s.prompt, metadata=s.metadata, timeout_s=timeout_s,
                        sample_id=f"{s.index} (response {i})") for i, (s, r) in enumerate(zip(samples, responses))]


# Verifier rewards live in their own module; named here so reward.fn = "mtrain.data.rewards:math_verify_reward" works.
from mtrain.data.verifiers import code_exec_reward, math_verify_reward  # noqa: E402,F401
