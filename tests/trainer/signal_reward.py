"""A reward with signal for tiny random models: the share of digits in the response (exact match is ~never hit)."""


def digit_share(response: str, answer, **_) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)
