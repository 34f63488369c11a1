"""A reward that hangs forever on rank 1 after its first 16 calls (the first step's groups): a hung rank in the
middle of a background rollout (rollout.async=one_step), for tests/trainer/test_async_failure.py."""
import os
import time

from mtrain.data.rewards import digit_share_reward

_calls = 0


def hang_on_rank1(response, answer=None, **kw):
    global _calls
    _calls += 1
    if os.environ.get("RANK") == "1" and _calls > 16:
        while True:
            time.sleep(1)
    return digit_share_reward(response, answer, **kw)
