"""Files we write get the permissions the user's umask gives (0644 under the usual 022), not mkstemp's 0600.

Temp-file-then-rename writes (config.yaml, metrics.jsonl, plots) start from `tempfile.mkstemp`, which creates
the file readable by its owner only; a run directory shared with a team, or read by a web server plotting the
run, then shows nothing. `chmod_umask(path)` gives such a file the mode a plain `open(path, "w")` would have;
`replace_text(path, text)` is the whole temp-file-then-rename write of a text file.
"""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()


def umask() -> int:
    """The process umask (read by setting it and setting it back: POSIX has no read-only call)."""
    with _lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def chmod_umask(path: str | os.PathLike, executable: bool = False) -> None:
    os.chmod(path, (0o777 if executable else 0o666) & ~umask())


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` (UTF-8) through a temp file in its folder and a rename: a crash leaves either the old
    file or the new one, never half of one; the new file gets the umask's mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        chmod_umask(tmp)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
