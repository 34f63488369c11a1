"""The sandbox's syscall filter: kernel keyrings, SysV IPC and io_uring, which outlive a call or escape its bounds.

Kernel keyrings outlive processes and are not per IPC namespace: the user keyring (@u) and user-session keyring
(@us) of a uid live as long as the kernel, so a key one call adds there is read back by the next call that gets
the same sandbox uid (measured before this filter: `add_key(..., KEY_SPEC_USER_KEYRING)` in one call,
`keyctl(KEYCTL_SEARCH)` + `KEYCTL_READ` in the next returned the payload). The per-uid persistent keyring
(`KEYCTL_GET_PERSISTENT`) lasts days. Without root the code shares the trainer's uid, so @u and @us are the
trainer user's own; and every child inherits the trainer's session keyring, whose keys it possesses.

SysV shared memory, message queues and semaphores are memory on no path and in no process: a segment attached,
filled and detached stays allocated until removed (measured: 40 x 4 MB attached, filled and detached in one call
went past a 32 MB write bound unstopped). The call's IPC namespace (root) ends them with the call, but nothing
bounds them while it runs; without root they outlive it. io_uring's registered files hold files the call closed
in no fd table, mapping or path (measured: 40 x 4 MB memfds registered with IORING_REGISTER_FILES_UPDATE, then
closed, went past a 32 MB bound unstopped; up to RLIMIT_NOFILE files per ring, RLIMIT_NOFILE rings).

So each call's processes get a seccomp filter, installed between fork and exec and inherited by every process
they start, that answers with ENOSYS (as a kernel built without the feature does):
- the three keyring syscalls (add_key, request_key, keyctl): nothing is stored, nothing is read, and no
  request-key upcall (which the kernel runs as root) is started;
- the three SysV IPC constructors (shmget, msgget, semget): no object is made, so none is filled, kept or read;
- io_uring (io_uring_setup, io_uring_enter, io_uring_register): no ring, so no registered file.
Python's standard library uses none of them (multiprocessing's shared memory and semaphores are POSIX: files in
/dev/shm, which the write bound counts). Syscalls of another ABI than the native one (i386 on x86_64, arm32 on
aarch64, x32) are refused as a whole: they reach the same code under other numbers. The filter comes with
PR_SET_NO_NEW_PRIVS (which a filter needs without CAP_SYS_ADMIN): a setuid program the code runs gains nothing.

Blocking rather than clearing: clearing @u, @us and the persistent keyring after each call needs a process of
the call's uid (a fork + exec per call) and misses a key a call shares with a concurrent call by granting
"other" permissions; the filter costs a few syscalls per call and leaves nothing to clear.

Available on x86_64 and aarch64 Linux with seccomp filters (`seccomp(SECCOMP_GET_ACTION_AVAIL)` answers); elsewhere
`syscall_filter_available()` is False and the sandbox runs without it (docs/design-tools.md says what is then
not isolated).
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct

# Per architecture: AUDIT_ARCH_* (seccomp_data.arch), (add_key, request_key, keyctl), (shmget, msgget, semget,
# io_uring_setup, io_uring_enter, io_uring_register), seccomp.
# x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: include/uapi/asm-generic/unistd.h.
_ARCH = {
    "x86_64": (0xC000003E, (248, 249, 250), (29, 68, 64, 425, 426, 427), 317),
    "aarch64": (0xC00000B7, (217, 218, 219), (194, 186, 190, 425, 426, 427), 277),
}
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the native arch value, numbers with this bit set
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_GET_ACTION_AVAIL = 2
_KEYCTL_JOIN_SESSION_KEYRING = 1
_RET_ALLOW = 0x7FFF0000
_RET_ENOSYS = 0x00050000 | errno.ENOSYS  # SECCOMP_RET_ERRNO | ENOSYS
# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _program(arch: int, refused: tuple[int, ...]) -> bytes:
    """The filter: struct sock_filter {u16 code; u8 jt; u8 jf; u32 k} x N. seccomp_data: nr at 0, arch at 4."""
    ins = [(_LD_W_ABS, 0, 0, 4)]
    # jump offsets count from the next instruction; layout: 0 load arch, 1 arch?, 2 load nr, 3 x32?,
    # 4.. the refused numbers, then ALLOW, then ENOSYS (at 5 + n)
    ins.append((_JEQ_K, 0, 3 + len(refused), arch))  # another ABI: ENOSYS
    ins.append((_LD_W_ABS, 0, 0, 0))
    ins.append((_JGE_K, len(refused) + 1, 0, _X32_BIT))  # x32 numbers: ENOSYS
    for i, nr in enumerate(refused):
        ins.append((_JEQ_K, len(refused) - i, 0, nr))  # a refused syscall: ENOSYS
    ins.append((_RET_K, 0, 0, _RET_ALLOW))
    ins.append((_RET_K, 0, 0, _RET_ENOSYS))
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


_prepared: tuple[ctypes.Array, _SockFprog] | None = None
_available: bool | None = None


def syscall_filter_available() -> bool:
    """Can this process's children get the filter? (Known architecture; the kernel has seccomp filters and the
    errno action: asked without installing anything.) Computed once."""
    global _available, _prepared
    if _available is None:
        spec = _ARCH.get(platform.machine())
        ok = False
        if spec is not None:
            action = ctypes.c_uint32(_RET_ENOSYS & 0xFFFF0000)
            ok = _libc.syscall(spec[3], _SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(action)) == 0
        if ok:  # built once, in the parent: the child only makes the two prctl calls
            code = _program(spec[0], spec[1] + spec[2])
            buf = ctypes.create_string_buffer(code, len(code))
            _prepared = (buf, _SockFprog(len(code) // 8, ctypes.addressof(buf)))
        _available = ok
    return _available


def install_syscall_filter() -> None:
    """In the child, between fork and exec: from here on, this process and all it starts get ENOSYS from the
    keyring syscalls, the SysV IPC constructors and io_uring. Raises OSError when the kernel refuses
    (syscall_filter_available() said it would not)."""
    if _prepared is None:
        raise OSError(errno.ENOSYS, "sandbox: syscall filter not prepared (syscall_filter_available() first)")
    # A new anonymous session keyring first: the inherited one is the trainer's, and a process possesses the keys
    # of its session keyring (/proc/keys shows it their descriptions without any syscall). Its failure (a quota)
    # leaves only that: the filter below still refuses every keyring syscall.
    _libc.syscall(_ARCH[platform.machine()][1][2], _KEYCTL_JOIN_SESSION_KEYRING, None)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: prctl(PR_SET_NO_NEW_PRIVS) failed")
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(_prepared[1]), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: prctl(PR_SET_SECCOMP) failed")
