"""Write a checkpoint directory all-or-nothing.

Every converter writes into `<out>.tmp-<pid>` next to the destination and renames it to `<out>`
only when everything is on disk. A crash (or an exception) therefore never leaves a half-written
checkpoint at `<out>` that a later run could mistake for a good one. A leftover `.tmp-<pid>`
directory from a killed process is harmless: nothing reads it, and the next run uses its own pid.

`<out>` is refused when it already holds a checkpoint (HF or Megatron) unless `overwrite=True`;
then the old directory is moved aside, the new one renamed in, and only then the old one deleted,
so at every instant one complete checkpoint exists under one of the two names.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import OutputExistsError

# Files whose presence means "this directory is a checkpoint": HF (config.json, *.safetensors,
# the index) and Megatron dist checkpoints (metadata.json, common.pt).
_CHECKPOINT_MARKERS = ("config.json", "metadata.json", "common.pt", "model.safetensors.index.json")


def checkpoint_marker(path: Path) -> str | None:
    """The first file in `path` that marks it as a checkpoint, or None."""
    if not path.is_dir():
        return None
    for marker in _CHECKPOINT_MARKERS:
        if (path / marker).exists():
            return marker
    for child in sorted(path.iterdir()):
        if child.suffix == ".safetensors":
            return child.name
    return None


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Raise OutputExistsError unless `path` may be (re)written; return it as a Path.

    Allowed: `path` does not exist, is an empty directory, or (with overwrite) holds a checkpoint.
    A non-empty directory that is NOT a checkpoint is refused even with overwrite: replacing it
    would delete files that the converter did not write.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output {out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    marker = checkpoint_marker(out)
    if marker is None:
        raise OutputExistsError(
            f"refusing to write into {out}: it is a non-empty directory that does not hold a checkpoint "
            "(choose another output directory)"
        )
    if not overwrite:
        raise OutputExistsError(
            f"refusing to write into {out}: it already holds a checkpoint ({marker}); "
            "pass --force (overwrite=True) to replace it"
        )
    return out


class AtomicDir:
    """A temp directory that becomes `out` on commit() and disappears on abort()."""

    def __init__(self, out: str | os.PathLike, overwrite: bool = False):
        self.out = check_output_dir(out, overwrite)
        self.overwrite = overwrite
        self.path = self.out.with_name(f"{self.out.name}.tmp-{os.getpid()}")
        if self.path.exists():  # our own pid's leftover: a previous attempt in this process
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        self.done = False

    def commit(self) -> Path:
        if self.done:
            raise RuntimeError(f"{self.out}: output directory already committed or aborted")
        # Check again: another process may have written `out` while we were converting.
        check_output_dir(self.out, self.overwrite)
        old = None
        if self.out.exists():
            if any(self.out.iterdir()):
                old = self.out.with_name(f"{self.out.name}.old-{os.getpid()}")
                if old.exists():
                    shutil.rmtree(old)
                os.rename(self.out, old)
            else:
                self.out.rmdir()
        os.rename(self.path, self.out)
        self.done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        if not self.done:
            shutil.rmtree(self.path, ignore_errors=True)
            self.done = True


@contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp directory to write into; it becomes `path` when the block ends without error.

    On an exception the temp directory is removed and `path` is left as it was.
    """
    staging = AtomicDir(path, overwrite)
    try:
        yield staging.path
    except BaseException:
        staging.abort()
        raise
    staging.commit()
