"""The error every config problem raises, apart so that any check (config_checks, engine_args, preflight) can raise
it without importing the others."""
from __future__ import annotations


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the dotted key."""
