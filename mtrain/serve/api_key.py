"""The OpenAI front's API key: from the config, from the environment, or made fresh (serve.api_key, api_key_env)."""
from __future__ import annotations

import os


def api_key_of(cfg) -> tuple[str | None, str]:
    """(key, its source). None means FrontServer makes a fresh one."""
    if cfg.serve.api_key is not None:
        return cfg.serve.api_key, "serve.api_key"
    env = os.environ.get(cfg.serve.api_key_env)
    if env:
        return env, f"${cfg.serve.api_key_env}"
    return None, "none given (serve.api_key_env unset): a fresh one for this run, printed below"
