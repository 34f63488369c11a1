"""Paths as users write them: `~` expanded, and the folder a path that does not exist yet would be made in.

Kept at the bottom layer so that the config loader (every path key), the command line's own path arguments and the
preflight checks share one rule each.
"""
from __future__ import annotations

import os
from pathlib import Path


def user_path(value: str) -> str:
    """`~` and `~user` expanded as a shell would (a shell leaves `--out=~/x`, a quoted '~/x' and a YAML value as
    they are, and Python would make a folder named `~`); anything else returned unchanged. A module name
    (`package.module:function`) never starts with `~`, so a key that takes a module or a file may go through it."""
    return os.path.expanduser(value)


def nearest_existing(path: str | os.PathLike) -> Path:
    """The path itself when it exists, else its nearest existing parent: where making it would start. A relative path
    ends at '.', which exists."""
    path = Path(path)
    return next(p for p in (path, *path.parents) if p.exists())
