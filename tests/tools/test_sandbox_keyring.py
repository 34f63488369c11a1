"""Kernel keyrings keep nothing between sandbox calls: a key stored by one call's code (ctypes add_key into the
user, user-session and session keyrings) is not read back by the next call on the same uid. Before the keyring
filter (mtrain/tools/sandbox_syscalls.py) the next call read "secret" back from @u and @us. Real sandboxed calls."""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import textwrap

import pytest

from mtrain.tools import sandbox
from mtrain.tools.sandbox import SandboxLimits, run_python, sandbox_python

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5, memory_mb=256, max_procs=8)
NRS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
RINGS = {"user": -4, "session": -3, "user-session": -5}  # KEY_SPEC_*_KEYRING


def _keyrings_reason() -> str | None:
    """Why keyring syscalls cannot be used here (None: they can). Asked in this process, outside any sandbox."""
    if platform.machine() not in NRS:
        return f"keyring syscall numbers known for x86_64 and aarch64 only, not {platform.machine()}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # KEYCTL_GET_KEYRING_ID(@u, create=0): ENOSYS without keyrings, EPERM/EACCES under a container's seccomp
    if libc.syscall(NRS[platform.machine()][1], 0, RINGS["user"], 0) < 0:
        e = ctypes.get_errno()
        return f"keyrings unavailable here: keyctl -> {errno.errorcode.get(e, e)}"
    return None


STORE_OR_READ = textwrap.dedent("""
    import ctypes, platform, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
    RINGS = {"user": -4, "session": -3, "user-session": -5}
    how, tag = sys.stdin.read().split()
    for name, ring in RINGS.items():
        desc = f"mtrain-{tag}-{name}".encode()
        if how == "store":
            k = libc.syscall(ADD_KEY, b"user", desc, b"secret", 6, ring)
            print(name, "stored" if k > 0 else f"refused:{ctypes.get_errno()}")
        else:
            k = libc.syscall(KEYCTL, 10, ring, b"user", desc, 0)      # KEYCTL_SEARCH
            buf = ctypes.create_string_buffer(64)
            n = libc.syscall(KEYCTL, 11, k, buf, 64) if k > 0 else -1  # KEYCTL_READ
            print(name, buf.raw[:n].decode() if n > 0 else f"none:{ctypes.get_errno()}")
""")


@pytest.mark.skipif(not sandbox_python()[1], reason="needs root and an interpreter other users may run (the "
                                                    "sandbox's own uid, which the next call gets again)")
def test_a_key_stored_by_one_call_is_not_read_by_the_next_on_the_same_uid(monkeypatch):
    reason = _keyrings_reason()
    if reason:
        pytest.skip(reason)
    # One sandbox uid: the next call surely gets the uid the first one stored its key under.
    monkeypatch.setattr(sandbox, "_UID_SLOTS", 1)
    tag = os.urandom(6).hex()
    stored = run_python(STORE_OR_READ, LIMITS, stdin=f"store {tag}")
    assert stored.ok and len(stored.stdout.split("\n")) >= 3, stored
    read = run_python(STORE_OR_READ, LIMITS, stdin=f"read {tag}")
    assert read.ok, read
    got = dict(line.split(" ", 1) for line in read.stdout.strip().split("\n"))
    assert set(got) == set(RINGS), read.stdout
    assert all(v.startswith("none:") for v in got.values()), (stored.stdout, read.stdout)


INT80_GETPID = textwrap.dedent("""
    # getpid through the i386 ABI (int 0x80, eax=20) from 64-bit code: a syscall under another ABI, whose
    # keyring calls have other numbers (286-288) than the native ones.
    import ctypes, mmap
    code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])   # mov eax, 20; int 0x80; ret
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    print(f())
""")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the i386 ABI exists on x86_64 only")
def test_syscalls_of_another_abi_are_refused_in_the_sandbox():
    """The filter refuses every syscall made through the i386 ABI (int 0x80), which would otherwise reach
    add_key / keyctl under their i386 numbers. Outside the sandbox the same code gets a pid."""
    import subprocess
    import sys
    outside = subprocess.run([sys.executable, "-c", INT80_GETPID], capture_output=True, text=True, timeout=60)
    if outside.returncode != 0 or int(outside.stdout) <= 0:
        pytest.skip(f"no i386 ABI on this kernel (int 0x80 getpid: {outside.stdout.strip() or outside.stderr[-200:]})")
    from mtrain.tools.sandbox_syscalls import syscall_filter_available
    if not syscall_filter_available():
        pytest.skip("no seccomp filter on this kernel: the sandbox runs without its syscall filter")
    r = run_python(INT80_GETPID, LIMITS)
    assert r.ok and int(r.stdout) == -errno.ENOSYS, r
