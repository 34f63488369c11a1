"""Memory a call holds on no path stays within its write bound: files mapped and then closed (a memfd, a file
unlinked while open: on no path and in no fd table, only in a mapping) are counted through /proc/PID/maps; SysV
shared memory (attached, filled, detached: in no process at all) and io_uring's registered files (closed, held by
the ring) cannot be made. Before: 40 x 4 MB of each went past a 32 MB bound with the call running on. Real
sandboxed calls."""
from __future__ import annotations

import textwrap

import pytest

from mtrain.tools.sandbox import SandboxLimits, run_python

HOLD = textwrap.dedent("""
    import ctypes, os, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = libc.shmat.restype = ctypes.c_void_p
    kind, MB4 = sys.stdin.read().strip(), 4 << 20
    if kind == "uring":                      # a ring whose 40 registered slots get memfds that are then closed
        libc.syscall.restype = ctypes.c_long
        ring = libc.syscall(425, 8, (ctypes.c_uint8 * 120)())          # io_uring_setup (x86_64 and aarch64)
        if ring < 0:
            print("io_uring_setup refused", ctypes.get_errno())
            sys.exit()
        libc.syscall(427, ring, 2, (ctypes.c_int * 40)(*[-1] * 40), 40)  # IORING_REGISTER_FILES, empty slots
    class Update(ctypes.Structure):          # struct io_uring_files_update
        _fields_ = [("offset", ctypes.c_uint32), ("resv", ctypes.c_uint32), ("fds", ctypes.c_uint64)]
    for i in range(40):                      # 40 x 4 MB, past the 32 MB bound
        if kind == "sysv":                   # attach, fill, detach: the segment stays, in no process
            shm = libc.shmget(0, MB4, 0o1000 | 0o600)
            if shm < 0:
                print("shmget refused", ctypes.get_errno())
                break
            a = libc.shmat(shm, None, 0)
            ctypes.memset(a, 1, MB4)
            libc.shmdt(ctypes.c_void_p(a))
        elif kind == "uring":
            fd = os.memfd_create(f"u{i}")
            os.write(fd, b"x" * MB4)
            one = (ctypes.c_int * 1)(fd)
            libc.syscall(427, ring, 6, ctypes.byref(Update(i, 0, ctypes.addressof(one))), 1)  # FILES_UPDATE
            os.close(fd)                     # only the ring holds it now
        else:
            if kind == "memfd":
                fd = os.memfd_create(f"m{i}")
            else:
                fd = os.open(f"gone-{i}", os.O_CREAT | os.O_RDWR)
                os.unlink(f"gone-{i}")
            os.ftruncate(fd, MB4)
            a = libc.mmap(None, MB4, 3, 1, fd, 0)   # PROT_READ | PROT_WRITE, MAP_SHARED
            os.close(fd)                            # only the mapping holds it now (mmap.mmap would keep an fd)
            ctypes.memset(a, 1, MB4)
        time.sleep(0.02)
    time.sleep(2)
    print("not stopped")
""")


@pytest.mark.parametrize("kind", ["memfd", "unlinked", "sysv", "uring"])
def test_memory_on_no_path_and_in_no_fd_stays_within_the_write_bound(kind):
    r = run_python(HOLD, SandboxLimits(wall_s=20.0, cpu_s=10, max_disk_mb=32, max_file_mb=8), stdin=kind)
    if kind in ("sysv", "uring"):
        from mtrain.tools.sandbox_syscalls import syscall_filter_available
        if not syscall_filter_available():
            pytest.skip("no seccomp filter here: the sandbox cannot refuse SysV IPC or io_uring")
        call = {"sysv": "shmget", "uring": "io_uring_setup"}[kind]
        assert r.stdout.startswith(f"{call} refused 38"), r  # ENOSYS: as a kernel without the feature
    else:
        assert r.over_disk and "not stopped" not in r.stdout, r
    assert run_python("print('fine')", SandboxLimits()).stdout == "fine\n"
