"""The error the HF config mapping raises, apart so that every module of the mapping (hf_config, hf_rope) can raise
it without importing the others."""
from __future__ import annotations


class ModelConfigError(ValueError):
    """A HF config field that mtrain cannot map faithfully onto Megatron-core (the message names it)."""
