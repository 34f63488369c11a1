"""The trainer tests' reward: re-exported from the package (tests load it by file path, like a user's reward)."""
from mtrain.data.rewards import digit_share_reward as digit_share  # noqa: F401
