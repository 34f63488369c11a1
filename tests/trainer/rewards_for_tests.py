"""Reward functions the trainer tests point `reward.fn` at (loaded by file path, as users do).

CALLS records every (answer, reward) the run scored, so a test can recompute which groups were uniform
from the rewards themselves instead of trusting the trainer's own count.
"""
CALLS: list[tuple[str, float]] = []


def odd_answers_only(response: str, answer, **_) -> float:
    """digit share for odd answers, 0 for even ones: every even-answer group is uniform (DAPO drops it)."""
    value = sum(c.isdigit() for c in response) / max(len(response), 1) if int(str(answer)) % 2 else 0.0
    CALLS.append((str(answer), value))
    return value


def constant(response: str, answer, **_) -> float:
    CALLS.append((str(answer), 0.5))
    return 0.5


def raises(response: str, answer, **_) -> float:
    raise ZeroDivisionError("reward backend exploded")


def not_a_number(response: str, answer, **_):
    return "1.0"


def right_answer_plus_first_sample(response: str, answer, trajectory=None, **_) -> float:
    """1 for the right answer, +1 for the first sample of each group: never a uniform group (a learning signal in
    every step, whatever the policy samples)."""
    return float(str(answer) in response) + float(trajectory is not None and trajectory.rid.endswith("-0-"))
