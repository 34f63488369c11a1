"""The sandbox's files: private temporary directories per call, what a call has written, and removing it.

A call's code may write in two kinds of place: its scratch directory (cwd, $HOME, and $TMPDIR / $TEMP / $TMP /
$XDG_* pointed inside it, so `tempfile` and well-behaved libraries stay there), and the host's shared temporary
directories (`SHARED_TMP`: /tmp, /dev/shm, ... are world-writable, any uid may create files there). With a uid of
its own (root) everything the call created in the shared directories is found by owner: `written()` counts it
(with the scratch directory) while the call runs, so a call that fills /dev/shm (memory) or creates a million
files is stopped, and `remove_owned()` deletes it after the call, so the next call (often the same uid) cannot
read it. Without root the call's files in the shared directories cannot be told from the trainer's: only the
scratch directory is counted and removed.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

# World-writable places a process of any uid can create files in (the ones that exist are used).
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock", "/var/lock")


def private_dirs(scratch: Path) -> dict[str, str]:
    """Create the call's temporary and XDG directories under `scratch`; the environment variables naming them."""
    names = {"TMPDIR": "tmp", "XDG_RUNTIME_DIR": "run", "XDG_CACHE_HOME": ".cache", "XDG_CONFIG_HOME": ".config",
             "XDG_DATA_HOME": ".local/share", "XDG_STATE_HOME": ".local/state"}
    env = {}
    for var, rel in names.items():
        d = scratch / rel
        d.mkdir(parents=True, mode=0o700, exist_ok=True)
        env[var] = str(d)
    env["TEMP"] = env["TMP"] = env["TMPDIR"]
    return env


def chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.chown(dirpath, uid, uid)
        for n in filenames:
            os.chown(os.path.join(dirpath, n), uid, uid)


def _shared_roots() -> list[str]:
    return [r for r in SHARED_TMP if os.path.isdir(r) and not os.path.islink(r)]


def _owned_entries(uid: int):
    """(path, lstat) of every entry owned by `uid` in the shared directories. Only folders the uid could write in
    are searched (world-writable ones, and its own): it cannot have created anything anywhere else."""
    seen: set[tuple[int, int]] = set()
    todo = _shared_roots()
    while todo:
        d = todo.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid == uid:
                    yield e.path, st
                    continue  # the caller walks an owned folder as a whole
                if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    todo.append(e.path)


def _tree_size(path: str, st: os.stat_result) -> tuple[int, int]:
    """(bytes, entries) of a file or a folder tree, links not followed."""
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512 if st.st_blocks else st.st_size, 1
    total, count = 0, 1
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            try:
                s = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            total += s.st_blocks * 512 if s.st_blocks else s.st_size
            count += 1
    return total, count


def written(scratch: Path, uid: int | None) -> tuple[int, int]:
    """(bytes, files and folders) the call has written so far: its scratch tree, plus (own uid) its entries in the
    shared temporary directories. Bytes are allocated blocks, so a sparse 10 GB file counts what it uses."""
    total, count = _tree_size(str(scratch), os.lstat(scratch))
    if uid is not None:
        for path, st in _owned_entries(uid):
            if path == str(scratch):  # the scratch directory itself sits in /tmp: counted above
                continue
            b, c = _tree_size(path, st)
            total, count = total + b, count + c
    return total, count


def remove_owned(uid: int) -> int:
    """Delete every entry `uid` owns in the shared temporary directories (after the call: none of its processes
    is left to race us). Returns how many top-level entries went."""
    n = 0
    for path, st in list(_owned_entries(uid)):
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            n += 1
        except OSError:
            pass
    return n
