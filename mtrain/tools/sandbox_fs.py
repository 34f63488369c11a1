"""The sandbox's files: private temporary directories per call, what a call has written, and removing it.

A call's code may write in two kinds of place: its scratch directory (cwd, $HOME, and $TMPDIR / $TEMP / $TMP /
$XDG_* pointed inside it, so `tempfile` and well-behaved libraries stay there), and the host's shared temporary
directories (`SHARED_TMP`: /tmp, /dev/shm, ... are world-writable, any uid may create files there). With a uid of
its own (root) everything the call created in the shared directories is found by owner: `written()` counts it
(with the scratch directory) while the call runs, so a call that fills /dev/shm (memory) or creates a million
files is stopped, and `remove_owned()` deletes it after the call, so the next call (often the same uid) cannot
read it. Without root the call's files in the shared directories cannot be told from the trainer's: only the
scratch directory is counted and removed.

Trees are walked and removed by `_visit`: depth-first without recursion, holding one open folder at a time, never
following a symlink. A call's code may nest folders 100,000 deep (past Python's recursion limit, which `os.walk` and
`shutil.rmtree` hit at about 1,000, and past PATH_MAX, which any path-based walk hits): neither the counting nor
the clean-up may fail on what the code made.
"""
from __future__ import annotations

import os
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


def _owned_entries(uids: int | set[int]):
    """(path, lstat) of every entry owned by `uids` (one or several) in the shared directories. Only folders the
    uid could write in are searched (world-writable ones, and its own): it cannot have created anything anywhere
    else."""
    uids = {uids} if isinstance(uids, int) else uids
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
                if st.st_uid in uids:
                    yield e.path, st
                    continue  # the caller walks an owned folder as a whole
                if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    todo.append(e.path)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _blocks(st: os.stat_result) -> int:
    return st.st_blocks * 512 if st.st_blocks else st.st_size


def _open_dir(name: str, dir_fd: int | None, st: os.stat_result, remove: bool) -> int | None:
    """An fd of folder `name` (relative to `dir_fd`), checked to be the folder `st` describes (not a symlink or a
    folder swapped in since the lstat); None when it cannot be opened."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        if not remove:
            return None
        try:  # a folder the code made unreadable (mode 000) without root: make it ours to empty
            os.chmod(name, 0o700, dir_fd=dir_fd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            return None
    except OSError:
        return None
    got = os.fstat(fd)
    if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        return None
    return fd


def _visit(path: str, st: os.stat_result, *, remove: bool, limit: int | None = None) -> tuple[int, int]:
    """(bytes, entries) of the file or folder tree at `path` (lstat `st`); remove=True also deletes it, files
    first, each folder once emptied. Depth-first without recursion, one open folder at a time: going down opens
    the child relative to the parent, going up opens ".." and checks it is the folder we came from (a tree moved
    while a running call is counted ends the walk there). `limit`: stop counting past this many entries."""
    total, count = _blocks(st), 1
    if not stat.S_ISDIR(st.st_mode):
        if remove:
            try:
                os.unlink(path)
            except OSError:
                pass
        return total, count
    fd = _open_dir(path, None, st, remove)
    if fd is None:
        return total, count
    idents = [(st.st_dev, st.st_ino)]  # per level: the folder's identity, its names not yet seen, its own name
    try:
        todo, names = [os.listdir(fd)], [path]
        while todo:
            if limit is not None and count > limit:
                break
            if todo[-1]:
                name = todo[-1].pop()
                try:
                    s = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                total, count = total + _blocks(s), count + 1
                if not stat.S_ISDIR(s.st_mode):
                    if remove:
                        try:
                            os.unlink(name, dir_fd=fd)
                        except OSError:
                            pass
                    continue
                child = _open_dir(name, fd, s, remove)
                if child is None:
                    continue
                os.close(fd)
                fd = child
                try:
                    listing = os.listdir(fd)
                except OSError:
                    listing = []
                idents.append((s.st_dev, s.st_ino))
                todo.append(listing)
                names.append(name)
                continue
            todo.pop()
            idents.pop()
            name = names.pop()
            if not todo:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            ps = os.fstat(fd)
            if (ps.st_dev, ps.st_ino) != idents[-1]:
                break  # moved under us (only a running call can): stop here
            if remove:
                try:
                    os.rmdir(name, dir_fd=fd)
                except OSError:
                    pass
    finally:
        os.close(fd)
    if remove:
        try:
            os.rmdir(path)
        except OSError:
            pass
    return total, count


def remove_tree(path: str | Path) -> bool:
    """Delete a file or a folder tree of any depth without following symlinks; True when it is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    _visit(str(path), st, remove=True)
    return not os.path.lexists(path)


def written(scratch: Path, uid: int | None, max_files: int | None = None) -> tuple[int, int]:
    """(bytes, files and folders) the call has written so far: its scratch tree, plus (own uid) its entries in the
    shared temporary directories. Bytes are allocated blocks, so a sparse 10 GB file counts what it uses.
    max_files: stop counting once past it (the answer is already "too many")."""
    total, count = _visit(str(scratch), os.lstat(scratch), remove=False, limit=max_files)
    if uid is not None:
        for path, st in _owned_entries(uid):
            if max_files is not None and count > max_files:
                break
            if path == str(scratch):  # the scratch directory itself sits in /tmp: counted above
                continue
            b, c = _visit(path, st, remove=False, limit=None if max_files is None else max_files - count)
            total, count = total + b, count + c
    return total, count


def nameless_bytes(pids: list[int], uid: int | None = None) -> int:
    """Bytes held by files of `pids` that have no name any more: a file unlinked while open, a memfd (memory),
    whether held by an open fd (/proc/PID/fd) or only by a mapping whose fd was closed (/proc/PID/maps; Python's
    mmap.mmap keeps an fd, ctypes' mmap + close does not). Each file is counted once, by device and inode; the
    path-based count cannot see any of them. uid: count mapped files of that owner only (the call's own uid), so
    a system library replaced on disk while the call runs is not the call's."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def count(st: os.stat_result) -> None:
        nonlocal total
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += _blocks(st)

    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            p = f"/proc/{pid}/fd/{fd}"
            try:
                if not os.readlink(p).endswith(" (deleted)"):  # memfds read "/memfd:NAME (deleted)"
                    continue
                count(os.stat(p))  # the open file itself
            except OSError:
                continue
        unstatted = _mapped_nameless(pid, uid, count)  # first: count() adds to total as it goes
        total += unstatted
    return total


def _mapped_nameless(pid: int, uid: int | None, count) -> int:
    """Mappings of files without a name (`... (deleted)` in /proc/PID/maps): counted through
    /proc/PID/map_files/START-END, the mapped file itself (root: it needs CAP_SYS_ADMIN). Where that cannot be
    read (without root), the mapped length is returned instead, per file (a file larger than what is mapped of it
    counts only its mapped part there)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = [ln for ln in f if ln.endswith(" (deleted)\n")]
    except OSError:
        return 0
    fallback: dict[tuple[str, str], int] = {}
    for ln in lines:
        fields = ln.split(maxsplit=5)  # range perms offset dev inode path
        if len(fields) < 6:
            continue
        try:
            st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")
        except PermissionError:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            key = (fields[3], fields[4])
            fallback[key] = fallback.get(key, 0) + end - start
            continue
        except OSError:
            continue
        if uid is None or st.st_uid == uid:
            count(st)
    return sum(fallback.values())


def remove_owned(uids: int | set[int]) -> set[int]:
    """Delete every entry `uids` own in the shared temporary directories (after the call: none of its processes
    is left to race us). Returns the uids that still own something (empty: they left nothing)."""
    left = set()
    for path, st in list(_owned_entries(uids)):
        _visit(path, st, remove=True)
        if os.path.lexists(path):
            left.add(st.st_uid)
    return left
