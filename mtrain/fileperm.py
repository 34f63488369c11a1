"""Files we write get the permissions the user's umask gives (0644 under the usual 022), not mkstemp's 0600.

Temp-file-then-rename writes (config.yaml, metrics.jsonl, plots) start from `tempfile.mkstemp`, which creates
the file readable by its owner only; a run directory shared with a team, or read by a web server plotting the
run, then shows nothing. `chmod_umask(path)` gives such a file the mode a plain `open(path, "w")` would have.
"""
from __future__ import annotations

import os
import threading

_lock = threading.Lock()


def umask() -> int:
    """The process umask (read by setting it and setting it back: POSIX has no read-only call)."""
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def chmod_umask(path: str | os.PathLike, executable: bool = False) -> None:
    os.chmod(path, (0o777 if executable else 0o666) & ~umask())
