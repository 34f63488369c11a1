"""An LLM judge as a reward: a model of its own, on an engine of its own, reads (prompt, response, answer) through a
template and its verdict text becomes the reward (docs/design-judge.md).

The judge's engine is never in the rollout pool, so no weight sync ever reaches it, and the judge's tokens live only
here: `JudgeReward` returns floats, nothing of the judge's generation enters a training batch. A judge call that
fails (times out, is refused by the engine, is too long, or answers something the parser cannot read) is rewarded
0 and counted in the step's metrics (`pop_metrics`); it never raises into the group it scores.

`JudgeReward` is a reward function in the sense of mtrain/data/rewards.py: callable one response at a time
(multi-turn rollouts, `safe_reward`) and, through `score_batch`, a whole group at once (`score_responses` dispatches
to it), which is where batching happens.
"""
from __future__ import annotations

import itertools
import re
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

from mtrain.data.rewards import RewardFn, safe_reward
from mtrain.rollout.protocol import Request, RolloutEngine, SamplingParams
from mtrain.rollout.special_text import defuse, special_texts

_FIELD = re.compile(r"\{(prompt|response|answer)\}")
COUNTERS = ("calls", "unparsed", "timeouts", "errors", "too_long")


def render(template: str, prompt: Any, response: str, answer: Any, specials: Sequence[str] = ()) -> str:
    """The template with {prompt} {response} {answer} filled in one pass: braces inside the filled text (a response
    that writes "{answer}") stay as written, and so do other braces of the template. `specials`: the judge
    tokenizer's special-token texts (`special_texts`), defused in the filled text (`defuse`)."""
    values = {"prompt": prompt_text(prompt), "response": response, "answer": _answer_text(answer)}
    if specials:
        values = {k: defuse(v, specials) for k, v in values.items()}
    return _FIELD.sub(lambda m: values[m.group(1)], template)


def prompt_text(prompt: Any) -> str:
    """A sample's prompt as text: a string as is; chat messages as their last user turn (the question)."""
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return users[-1] if isinstance(users[-1], str) else str(users[-1])
    return str(prompt)


def _answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    if isinstance(answer, (list, tuple)):
        return " or ".join(str(a) for a in answer)
    return str(answer)


class JudgeReward:
    """The judge's verdicts as rewards. engine: any RolloutEngine holding the judge's weights (already loaded);
    tokenizer: the judge's (encode/decode); parser: verdict text -> reward in [0, 1] or None (judge_verdict.py).
    base_fn: reward.fn, added to weight * verdict when combine == "sum"."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, *, template: str, parser: Callable[[str], float | None],
                 batch_size: int = 32, timeout_s: float = 60.0, max_new_tokens: int = 16, max_prompt_len: int = 2048,
                 combine: str = "judge", weight: float = 1.0, base_fn: RewardFn | None = None,
                 base_timeout_s: float | None = None, chat: bool = False) -> None:
        if combine == "sum" and base_fn is None:
            raise ValueError("combine='sum' needs base_fn (reward.fn)")
        self.engine, self.tokenizer, self.template, self.parser = engine, tokenizer, template, parser
        self.batch_size, self.timeout_s = int(batch_size), float(timeout_s)
        self.max_new_tokens, self.max_prompt_len = int(max_new_tokens), int(max_prompt_len)
        self.combine, self.weight, self.base_fn, self.base_timeout_s = combine, float(weight), base_fn, base_timeout_s
        self.chat = chat
        self.specials = special_texts(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self._params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0,
                                      stop_token_ids=(int(eos),) if isinstance(eos, int) else ())
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._verdict_sum = 0.0
        self._ids = itertools.count()
        self.last_errors: list[str] = []  # the latest failed calls' one-line reasons (also printed)
        self.last_verdicts: list[str] = []  # the latest batch's verdict texts ("" for a failed call)

    # ---------------------------------------------------------------- reward-function interface
    def __call__(self, response: str, answer: Any, prompt: Any = None, metadata: dict | None = None) -> float:
        return self._combined([prompt], [response], [answer], [metadata])[0]

    def score_batch(self, samples: Sequence[Any], responses: Sequence[str]) -> list[float]:
        """Rewards for responses[i] to samples[i] (objects with .prompt, .answer, .metadata: PromptSample)."""
        return self._combined([s.prompt for s in samples], list(responses), [s.answer for s in samples],
                              [getattr(s, "metadata", None) for s in samples])

    def _combined(self, prompts, responses, answers, metas) -> list[float]:
        verdicts = self.judge(prompts, responses, answers)
        if self.combine == "judge":
            return [self.weight * v for v in verdicts]
        base = [safe_reward(self.base_fn, r, a, prompt=p, metadata=m, timeout_s=self.base_timeout_s,
                            sample_id=f"judged response {i}")
                for i, (p, r, a, m) in enumerate(zip(prompts, responses, answers, metas))]
        return [b + self.weight * v for b, v in zip(base, verdicts)]

    # ---------------------------------------------------------------- judging
    def judge(self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]) -> list[float]:
        """The verdict reward of each (prompt, response, answer), in [0, 1]; 0 for every failed call (counted)."""
        rewards: list[float] = []
        verdicts: list[str] = []
        for start in range(0, len(responses), self.batch_size):
            chunk = range(start, min(start + self.batch_size, len(responses)))
            r, v = self._judge_chunk([render(self.template, prompts[i], responses[i], answers[i], self.specials)
                                       for i in chunk])
            rewards += r
            verdicts += v
        self.last_verdicts = verdicts
        return rewards

    def _judge_chunk(self, texts: list[str]) -> tuple[list[float], list[str]]:
        batch = next(self._ids)
        pending: list[tuple[int, str, Any]] = []  # (index, rid, future)
        rewards = [0.0] * len(texts)
        verdicts = [""] * len(texts)
        errors: list[str] = []
        counts = dict.fromkeys(COUNTERS, 0)
        counts["calls"] = len(texts)
        for i, text in enumerate(texts):
            ids = self.encode(text)
            if len(ids) > self.max_prompt_len:
                counts["too_long"] += 1
                errors.append(f"judge call {i}: prompt of {len(ids)} tokens exceeds "
                              f"reward.judge.max_prompt_len={self.max_prompt_len}; rewarded 0")
                continue
            rid = f"judge-{batch}-{i}."  # the dot ends the rid, so aborting it as a prefix hits this call only
            try:
                pending.append((i, rid, self.engine.submit(Request(rid=rid, prompt_ids=ids, params=self._params))))
            except Exception as e:  # noqa: BLE001 - an engine that refuses at submission, not in its future
                counts["errors"] += 1
                errors.append(f"judge call {i} ({rid}): engine error {type(e).__name__}: {e}; rewarded 0")
        deadline = time.monotonic() + self.timeout_s  # one deadline per call: the calls of a chunk run together
        for i, rid, fut in pending:
            try:
                completion = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                self.engine.abort(rid)
                counts["timeouts"] += 1
                errors.append(f"judge call {i} ({rid}): no verdict within reward.judge.timeout_s={self.timeout_s} s; "
                              "aborted, rewarded 0")
                continue
            except Exception as e:  # noqa: BLE001 - an engine refusal of one call must not fail the group
                counts["errors"] += 1
                errors.append(f"judge call {i} ({rid}): engine error {type(e).__name__}: {e}; rewarded 0")
                continue
            if completion.finish_reason == "abort":
                counts["errors"] += 1
                errors.append(f"judge call {i} ({rid}): aborted by the engine; rewarded 0")
                continue
            verdicts[i] = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
            try:
                score = self.parser(verdicts[i])
            except Exception as e:  # noqa: BLE001 - a user parser that raises is an unparsed verdict
                score = None
                errors.append(f"judge call {i}: parser raised {type(e).__name__}: {e}")
            if score is None:
                counts["unparsed"] += 1
                continue
            rewards[i] = score
        for line in errors[:3]:
            print(f"mtrain: {line}", flush=True)
        if len(errors) > 3:
            print(f"mtrain: ... and {len(errors) - 3} more failed judge calls in this batch", flush=True)
        with self._lock:
            for k, n in counts.items():
                self._counts[k] += n
            self._verdict_sum += sum(rewards)
            self.last_errors = errors
        return rewards, verdicts

    def encode(self, text: str) -> list[int]:
        """The judge prompt's token ids: the filled template as is, or as one user turn of the chat template."""
        if self.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer transformers: a BatchEncoding
        return list(self.tokenizer.encode(text))

    def pop_metrics(self) -> dict[str, float]:
        """judge/* counters since the last call (for the step's metrics), then reset."""
        with self._lock:
            counts, total = dict(self._counts), self._verdict_sum
            self._counts = dict.fromkeys(COUNTERS, 0)
            self._verdict_sum = 0.0
        out = {f"judge/{k}": float(n) for k, n in counts.items()}
        out["judge/mean_verdict"] = total / counts["calls"] if counts["calls"] else 0.0
        return out

    def shutdown(self) -> None:
        self.engine.shutdown()
