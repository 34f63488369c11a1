"""Run untrusted Python (a model's tool call) in a subprocess with hard limits, and leave nothing behind.

Each call gets:
- a fresh scratch directory (the working directory, $HOME, and $TMPDIR/$TEMP/$TMP/$XDG_* inside it), deleted
  afterwards (mtrain/tools/sandbox_fs.py);
- an environment of PATH/LANG/HOME and those directories only: none of the trainer's variables (tokens, keys);
- `python -I` (isolated mode: no PYTHON* variables, no user site, no script directory on sys.path);
- rlimits set in the child before exec: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size
  (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps; and processes (RLIMIT_NPROC);
- a bound on what it writes at once (max_disk_mb, max_files: scratch directory, and with its own uid its files in
  /tmp, /dev/shm, ...; plus files its processes hold open after unlinking them, and memfds), counted while it
  runs; beyond it the call is killed;
- a seccomp filter answering the keyring syscalls, the SysV IPC constructors and io_uring with ENOSYS (keys
  outlive processes and are per uid, not per namespace; SysV memory and a ring's registered files are on no path
  and in no fd table, so no bound sees them: mtrain/tools/sandbox_syscalls.py), with no_new_privs (a setuid
  program gains nothing);
- its own session / process group, killed as a whole on every exit path (normal end, wall-clock timeout,
  output overflow, too much written, the caller cancelled);
- when we run as root: an IPC namespace of its own (SysV shared memory, semaphores, message queues, POSIX message
  queues end with the call), and a uid of its own (not in /etc/passwd, one per concurrent call), so RLIMIT_NPROC counts
  only this call's processes (a fork bomb hits the cap at once), the code cannot write the trainer's files, and
  after the call every process still owned by that uid is killed, even one that left the process group with
  setsid(); its files in the shared temporary directories are deleted and the zombies it left that are ours
  to wait for are reaped (zombies never make a uid look busy). Optionally (network=False, root only) a network
  namespace of its own: no interface but a loopback that is down. Without root the sandbox keeps the caller's
  uid: RLIMIT_NPROC then counts all the user's processes (we set it to the current count + max_procs), only the
  process group is killed, and files it leaves in /tmp outside its scratch directory are not found.

What it does NOT isolate (docs/design-tools.md, "What the sandbox does not isolate"): the network unless
network=False; reading world-readable files, other processes' command lines included (/proc/PID/cmdline:
never put a secret on a command line); CPU and memory pressure on the host beyond the per-process limits.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mtrain.tools.sandbox_fs import chown_tree, nameless_bytes, private_dirs, remove_owned, remove_tree, written
from mtrain.tools.sandbox_syscalls import install_syscall_filter, syscall_filter_available

_UID_BASE = 61000  # sandbox uids: _UID_BASE + slot (unused by distributions: 60000-64999 is "dynamic" space)
_UID_SLOTS = 256
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_uids_clean: set[int] | None = None  # uids seen to own nothing in the shared temporary directories (None: not swept)
_MSGQUEUE_BYTES = 819200  # RLIMIT_MSGQUEUE of a call: Linux's default (800 KiB of POSIX message queues per uid)
_DISK_POLL_S = 0.05  # how often a running call's written bytes and files are counted


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock limit of the whole call
    cpu_s: int = 5  # CPU seconds of the interpreter (RLIMIT_CPU: SIGXCPU, then SIGKILL)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_procs: int = 16  # processes the call may have at once (RLIMIT_NPROC)
    max_output_chars: int = 4000  # stdout and stderr each, truncated beyond this
    max_file_mb: int = 16  # largest file the code may write
    max_disk_mb: int = 64  # all it writes at once (scratch dir + its files in /tmp, /dev/shm, ...): killed beyond
    max_files: int = 1000  # files and folders it may have at once (same places)
    network: bool = True  # False: a network namespace of its own (no interface but a down loopback); needs root

    def __post_init__(self) -> None:
        if not isinstance(self.network, bool):
            raise ValueError(f"SandboxLimits.network must be true or false, got {self.network!r}")
        for name in ("wall_s", "cpu_s", "memory_mb", "max_procs", "max_output_chars", "max_file_mb", "max_disk_mb",
                     "max_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {v!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by us (timeout)
    timed_out: bool
    truncated: bool
    wall_s: float
    over_disk: bool = False  # killed for writing more than max_disk_mb / max_files

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.over_disk


def _count_processes_of(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def processes_of_uid(uid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    out.append(int(d))
            except OSError:
                pass
    return out


def processes_in_group(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(d))
    return out


def _world_executable(path: str) -> bool:
    """Can any user run this file? (every folder on the way o+x, the file o+x): the sandbox uid must."""
    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & 0o001:
            return False
        return all(p.stat().st_mode & 0o001 for p in real.parents)
    except OSError:
        return False


def sandbox_python(python: str | None = None) -> tuple[str, bool]:
    """(interpreter, own_uid): the interpreter the sandbox runs and whether it gets a uid of its own.

    A separate uid needs root and an interpreter other users can execute. The interpreter is run by its real path:
    a venv's `bin/python` is a symlink whose folder may sit under /root (mode 0700), out of the sandbox uid's
    reach, while the binary it points to usually is not (the code then sees that interpreter's standard library,
    not the venv's packages). Otherwise the system python3 if there is one, else the caller's interpreter under
    the caller's uid (weaker: see the module docstring)."""
    if python is not None:
        real = os.path.realpath(python)
        return (real, True) if os.geteuid() == 0 and _world_executable(real) else (python, False)
    if os.geteuid() != 0:
        return sys.executable, False
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(cand)
        if os.path.exists(real) and _world_executable(real):
            return real, True
    return sys.executable, False


def _acquire_uid(own_uid: bool) -> int | None:
    """A free sandbox uid: one without any process first; else one whose only processes are zombies (they hold
    nothing but a pid entry; a parent that never reaps must not use up the uids)."""
    if not own_uid:
        return None
    with _uid_lock:
        # Offset by pid so sandboxes of several trainer processes on one host do not share uids.
        start = (os.getpid() * 7) % _UID_SLOTS
        order = [_UID_BASE + (start + k) % _UID_SLOTS for k in range(_UID_SLOTS)]
        for free in (lambda pids: not pids, lambda pids: not _live(pids)):
            for uid in order:
                if uid not in _uids_in_use and free(processes_of_uid(uid)) and _clean(uid):
                    _uids_in_use.add(uid)
                    return uid
    raise RuntimeError(f"sandbox: all {_UID_SLOTS} sandbox uids are busy")


def _clean(uid: int) -> bool:
    """Does `uid` own nothing in the shared temporary directories? Before this process hands out its first uid,
    what every idle sandbox uid left there is removed (a trainer that died mid-call: the next call of any uid must
    not read it); a uid whose clean-up failed after a call is checked again before its next use, and skipped while
    anything of it is left. Cleaned on every release."""
    global _uids_clean
    if _uids_clean is None:
        slots = set(range(_UID_BASE, _UID_BASE + _UID_SLOTS))
        idle = slots - _uids_with_live_processes()
        _uids_clean = idle - remove_owned(idle)
    if uid not in _uids_clean:
        if remove_owned(uid):
            return False
        _uids_clean.add(uid)
    return True


def _uids_with_live_processes() -> set[int]:
    """Uids owning a process that is not a zombie (one pass over /proc)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                uid = os.stat(f"/proc/{d}").st_uid
            except OSError:
                continue
            if _state(int(d)) not in ("Z", "X", None):
                out.add(uid)
    return out


def _live(pids: list[int]) -> list[int]:
    """Without the zombies: a zombie holds no resource of the uid but its pid entry, and is not ours to wait for
    unless it is our child (`_reap`)."""
    return [p for p in pids if _state(p) not in ("Z", "X", None)]


def _reap(uid: int) -> None:
    """Wait for the zombies of `uid` whose parent we are. A sandbox process that forks and never waits leaves
    zombies; once the sandbox is killed they are re-parented to init, or to us when the trainer is PID 1 (a
    container without an init) or a subreaper. Only pids of the sandbox uid are waited for, never the trainer's
    own children."""
    me = os.getpid()
    for pid in processes_of_uid(uid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _release_uid(uid: int | None, clean: bool) -> None:
    if uid is not None:
        with _uid_lock:
            _uids_in_use.discard(uid)
            if not clean and _uids_clean is not None:  # checked again (skipped while anything is left) first
                _uids_clean.discard(uid)


def _kill_all(pgid: int, uid: int | None, deadline_s: float = 5.0) -> None:
    """SIGKILL the process group (and every process of the sandbox uid) until none is left: a fork bomb forks
    between our scan and our kill, so one pass is not enough."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if uid is not None:
            for pid in processes_of_uid(uid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        left = processes_in_group(pgid) + (processes_of_uid(uid) if uid is not None else [])
        # zombies of our own direct child are reaped by Popen.wait; others are reparented to init and reaped there
        left = [p for p in left if _state(p) not in ("Z", "X", None)]
        if not left or time.monotonic() > end:
            return
        time.sleep(0.01)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_libc = ctypes.CDLL(None, use_errno=True)


def network_isolation_available() -> bool:
    """A network namespace of its own needs CAP_SYS_ADMIN: root (the sandbox's own uid needs it too)."""
    return os.geteuid() == 0 and hasattr(_libc, "unshare")


def _child_setup(limits: SandboxLimits, uid: int | None, nproc: int, filtered: bool) -> None:
    # Runs in the child between fork and exec: only async-signal-safe-ish calls, no Python-level locks.
    os.setsid()
    if not limits.network and _libc.unshare(_CLONE_NEWNET) != 0:  # before setuid: needs CAP_SYS_ADMIN
        raise OSError(ctypes.get_errno(), "sandbox: unshare(CLONE_NEWNET) failed")
    # With a uid of its own (root): an IPC namespace of its own, so SysV shared memory, semaphores and message
    # queues (and POSIX message queues) the call makes die with its last process; the next call sees none.
    if uid is not None and _libc.unshare(_CLONE_NEWIPC) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: unshare(CLONE_NEWIPC) failed")
    mem = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = int(limits.cpu_s)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    fsize = limits.max_file_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # POSIX message queues are memory on no path the write bound walks (the call's IPC namespace has its own
    # mqueue mount): their bytes per uid are capped here, not inherited from a trainer that may have raised it.
    hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)[1]
    mq = _MSGQUEUE_BYTES if hard == resource.RLIM_INFINITY else min(_MSGQUEUE_BYTES, hard)  # never raised
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (mq, mq))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setuid(uid)  # after it we could no longer lower limits of our choosing
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    # keyrings, SysV IPC and io_uring refused from here on (sandbox_syscalls.py); after setuid, so that the fresh
    # session keyring it joins is the sandbox uid's
    if filtered:
        install_syscall_filter()


def _read_capped(stream, cap: int, box: list) -> None:
    data = stream.read(cap + 1)
    box.append(data)
    while stream.read(1 << 16):  # drain the rest so the child never blocks on a full pipe
        pass


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: str = "",
               python: str | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; blocking (call it from a worker thread in async code).
    python: the interpreter (default: `sandbox_python()`); the code sees only its standard library and
    whatever that interpreter has installed system-wide."""
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    python, own_uid = sandbox_python(python)
    if not limits.network and not (own_uid and network_isolation_available()):
        raise RuntimeError("sandbox: network=False needs root and an interpreter other users may run "
                           "(a network namespace of its own); run as root, or allow the network")
    uid = _acquire_uid(own_uid)
    scratch, proc = None, None
    try:  # from here on the uid is released on every path, a failed mkdtemp (a full /tmp) included
        scratch = Path(tempfile.mkdtemp(prefix="mtrain-sandbox-"))
        # The interpreter reads its source as UTF-8 whatever the trainer's locale. A lone surrogate (JSON's
        # "\ud800" in a tool call's arguments decodes to one) cannot be encoded: written as the escape it came
        # from, so a string literal keeps its meaning and anything else is the model's SyntaxError, not a crash.
        (scratch / "main.py").write_text(code, encoding="utf-8", errors="backslashreplace")
        tmp_env = private_dirs(scratch)
        if uid is not None:
            chown_tree(scratch, uid)
            nproc = limits.max_procs
        else:
            nproc = _count_processes_of(os.getuid()) + limits.max_procs
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch), "PYTHONDONTWRITEBYTECODE": "1",
               **tmp_env}
        filtered = syscall_filter_available()
        start = time.monotonic()
        proc = subprocess.Popen([python, "-I", "main.py"], cwd=scratch, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                                preexec_fn=lambda: _child_setup(limits, uid, nproc, filtered))
        cap = int(limits.max_output_chars) * 4  # bytes: UTF-8 needs up to 4 per character
        out_box: list = []
        err_box: list = []
        readers = [threading.Thread(target=_read_capped, args=(proc.stdout, cap, out_box), daemon=True),
                   threading.Thread(target=_read_capped, args=(proc.stderr, cap, err_box), daemon=True)]
        for t in readers:
            t.start()
        try:
            proc.stdin.write(stdin.encode("utf-8", errors="backslashreplace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        timed_out, over_disk = False, False
        deadline = start + limits.wall_s
        max_bytes = int(limits.max_disk_mb) << 20
        while True:  # wait, watching what the call writes (a file count or /dev/shm has no rlimit)
            try:
                proc.wait(timeout=max(0.0, min(_DISK_POLL_S, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                pass
            b, n = written(scratch, uid, limits.max_files)
            if b <= max_bytes:  # plus files open but unlinked, and memfds (memory): on no path, so counted by fd
                b += nameless_bytes(processes_of_uid(uid) if uid is not None else processes_in_group(proc.pid), uid)
            if b > max_bytes or n > limits.max_files:
                over_disk = True
                break
            if time.monotonic() >= deadline:
                timed_out = True
                break
        _kill_all(proc.pid, uid)  # the group outlives the main process when it forked
        proc.wait()
        for t in readers:
            t.join(timeout=2.0)
        wall = time.monotonic() - start
        out_b = out_box[0] if out_box else b""
        err_b = err_box[0] if err_box else b""
        mc = int(limits.max_output_chars)
        out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
        truncated = len(out) > mc or len(err) > mc or len(out_b) > cap or len(err_b) > cap
        return SandboxResult(stdout=out[:mc], stderr=err[:mc],
                             exit_code=None if timed_out or over_disk else proc.returncode,
                             timed_out=timed_out, truncated=truncated, wall_s=wall, over_disk=over_disk)
    finally:
        if proc is not None and proc.poll() is None:  # an exception between Popen and wait
            _kill_all(proc.pid, uid)
            proc.wait()
        clean = False
        try:  # nothing of the uid runs any more: its files and zombies can go
            clean = remove_tree(scratch) if scratch is not None else True
            if uid is not None:
                clean = not remove_owned(uid) and clean
                _reap(uid)
        finally:  # whatever the clean-up met, the uid is free again (and checked before it is reused)
            _release_uid(uid, clean)
