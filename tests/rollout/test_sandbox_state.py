"""The python sandbox keeps nothing between calls and bounds what a call writes; zombies never exhaust its uids;
the no-network mode. Real subprocesses, the real sandbox uids (this needs root for the parts that say so)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtrain.tools.python_tool import PythonTool
from mtrain.tools.sandbox import SandboxLimits, network_isolation_available, run_python, sandbox_python
from mtrain.tools.sandbox_fs import SHARED_TMP

REPO = str(Path(__file__).resolve().parents[2])  # the checkout under test, for the subprocesses
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=3, memory_mb=256, max_procs=16, max_output_chars=2000)
own_uid = pytest.mark.skipif(not sandbox_python()[1], reason="needs root and an interpreter other users may run "
                                                             "(the sandbox's own uid)")


def _sandbox_uid_files() -> list[str]:
    """Entries these tests' code creates in the shared temporary directories, owned by a sandbox uid (61000-61255;
    other sandboxes running on the host have their own names)."""
    out = []
    for root in SHARED_TMP:
        if os.path.isdir(root):
            for e in os.scandir(root):
                if not e.name.startswith(("left-", "dir-", "many-", "big-")):
                    continue
                try:
                    if 61000 <= e.stat(follow_symlinks=False).st_uid < 61256:
                        out.append(e.path)
                except OSError:
                    pass
    return out


WRITE = textwrap.dedent("""
    import os, tempfile, uuid
    tag = uuid.uuid4().hex
    for p in ("/tmp/left-" + tag, "/dev/shm/left-" + tag, os.path.join(tempfile.gettempdir(), "left-" + tag),
              os.path.expanduser("~/.cache") + "/left-" + tag):
        with open(p, "w") as f:
            f.write("secret")
    os.mkdir("/tmp/dir-" + tag)
    open("/tmp/dir-" + tag + "/inner", "w").write("secret")
    print(tag, tempfile.gettempdir(), os.environ["TMPDIR"] == os.environ["TEMP"] == os.environ["TMP"])
""")
READ = textwrap.dedent("""
    import glob, os
    found = [p for pat in ("/tmp/left-*", "/dev/shm/left-*", "/tmp/dir-*") for p in glob.glob(pat)
             if os.stat(p).st_uid >= 61000]
    print("found", found)
""")


@own_uid
def test_a_call_cannot_read_what_the_previous_call_wrote():
    before = set(_sandbox_uid_files())
    for _ in range(3):  # several rounds: the next call often gets the same uid
        w = run_python(WRITE, LIMITS)
        assert w.ok, w
        tag, tmpdir, same = w.stdout.split()
        assert "mtrain-sandbox-" in tmpdir and same == "True"  # tempfile and $TMP* point into the scratch dir
        for p in (f"/tmp/left-{tag}", f"/dev/shm/left-{tag}", f"/tmp/dir-{tag}"):
            assert not os.path.exists(p), f"{p} survived the call"
        r = run_python(READ, LIMITS)
        assert r.ok and r.stdout.strip() == "found []", r
    assert set(_sandbox_uid_files()) <= before


@own_uid
@pytest.mark.parametrize("code,limits", [
    ("import os\nfor i in range(10 ** 6):\n    open(f'/tmp/many-{os.getpid()}-{i}', 'w').close()",
     SandboxLimits(wall_s=20.0, cpu_s=15, max_files=300)),
    ("import os\nfor i in range(1000):\n    open(f'/dev/shm/big-{os.getpid()}-{i}', 'wb').write(b'x' * (4 << 20))",
     SandboxLimits(wall_s=20.0, cpu_s=15, max_disk_mb=32)),
    ("import os\nos.makedirs('a/b', exist_ok=True)\nfor i in range(10 ** 6):\n    open(f'a/b/{i}', 'w').close()",
     SandboxLimits(wall_s=20.0, cpu_s=15, max_files=300)),
])
def test_a_call_that_writes_too_much_is_stopped_and_leaves_nothing(code, limits):
    r = run_python(code, limits)
    assert r.over_disk and not r.ok and r.wall_s < 10, r
    assert _sandbox_uid_files() == []
    out = PythonTool(limits).call(_session(), {"code": "print('fine')"})  # the next call is served
    assert out == "fine"


def _session():
    from mtrain.tools.base import ToolSession
    s = ToolSession("s")
    s.state["python"] = {"calls": 0, "errors": 0}
    return s


NO_REAP = textwrap.dedent("""
    # The trainer as a parent that never reaps: a child subreaper (as PID 1 in a container without an init),
    # so the sandbox's orphans and their zombies are re-parented to this process.
    import ctypes, sys
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    from mtrain.tools import sandbox
    sandbox._UID_SLOTS = 4  # few uids, so that leaking one per call fails within a few calls
    code = '''
    import os, time
    for _ in range(5):                  # children that exit and are never waited for
        if os.fork() == 0:
            os._exit(0)
    if os.fork() == 0:                  # a double fork: the grandchild outlives its parent
        if os.fork() == 0:
            time.sleep(0.2)
            os._exit(0)
        os._exit(0)
    time.sleep(0.1)
    print("ok")
    '''
    limits = sandbox.SandboxLimits(wall_s=5.0, cpu_s=3, max_procs=16)
    for i in range(24):
        r = sandbox.run_python(code, limits)
        assert r.ok and r.stdout.strip() == "ok", (i, r)
    print("all calls ok")
""")


@own_uid
def test_zombies_left_by_the_sandbox_never_exhaust_its_uids():
    p = subprocess.run([sys.executable, "-c", NO_REAP], capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0 and "all calls ok" in p.stdout, p.stdout + p.stderr


CONNECT = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", int(sys.stdin.read())))
        print("connected")
    except OSError as e:
        print("refused", type(e).__name__)
""")


@pytest.mark.skipif(not network_isolation_available() or not sandbox_python()[1], reason="needs root")
def test_no_network_mode_cannot_reach_a_local_port():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = str(srv.getsockname()[1])
    try:
        with_net = run_python(CONNECT, LIMITS, stdin=port)
        assert with_net.stdout.strip() == "connected", with_net
        alone = run_python(CONNECT, SandboxLimits(**{**LIMITS.__dict__, "network": False}), stdin=port)
        assert alone.ok and alone.stdout.startswith("refused"), alone
    finally:
        srv.close()


def test_no_network_mode_without_root_is_one_clear_error():
    if network_isolation_available() and sandbox_python()[1]:
        pytest.skip("root: the mode is available")
    with pytest.raises(RuntimeError, match="network=False needs root"):
        run_python("print(1)", SandboxLimits(network=False))


BASE = ["model.hf_path=x", "data.task=arithmetic"]


def test_sandbox_config_keys_reach_the_python_tool():
    from mtrain.config import load_config
    from mtrain.rollout.agents.setup import build_tool
    cfg = load_config(None, BASE + ["multi_turn.tools=python", "multi_turn.sandbox_disk_mb=8",
                             "multi_turn.sandbox_max_files=50"] +
                      (["multi_turn.sandbox_network=false"] if os.geteuid() == 0 else []))
    tool = build_tool("python", cfg.multi_turn)
    assert (tool.limits.max_disk_mb, tool.limits.max_files) == (8, 50)
    assert tool.limits.network is (os.geteuid() != 0)


def test_bad_sandbox_values_are_one_config_line():
    from mtrain.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"multi_turn.sandbox_max_files: must be >= 1"):
        load_config(None, BASE + ["multi_turn.sandbox_max_files=0"])
    with pytest.raises(ConfigError, match=r"multi_turn.sandbox_disk_mb"):
        load_config(None, BASE + ["multi_turn.sandbox_disk_mb=-1"])


def test_an_api_key_on_the_command_line_is_refused_with_the_remedy(tmp_path):
    """Sandboxed code (any local process) reads /proc/PID/cmdline: `mtrain serve ... serve.api_key=...` stops
    before anything starts, naming $MTRAIN_API_KEY; the key from the environment works."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model:\n  hf_path: /nonexistent\n")
    p = subprocess.run([sys.executable, "-m", "mtrain", "serve", str(cfg), "serve.api_key=hunter2"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode != 0
    assert "serve.api_key: a secret on the command line" in p.stderr and "MTRAIN_API_KEY" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


DEEP = textwrap.dedent("""
    import os, sys
    where = sys.stdin.read().strip() or "."
    os.chdir(where)
    top = os.path.abspath("deep-" + str(os.getpid()))
    os.mkdir(top)
    os.chdir(top)
    for _ in range(3000):   # deeper than Python's recursion limit: a recursive walk or rmtree raises
        os.mkdir("d")
        os.chdir("d")
    os.symlink("/etc", "link")   # never followed by the clean-up
    print(top)
""")


@own_uid
@pytest.mark.parametrize("where", ["", "/tmp", "/dev/shm"])
def test_deeply_nested_folders_are_removed_and_the_uid_released(where):
    """Model code nesting 3,000 folders (scratch, /tmp, /dev/shm): the call returns, its trees go, its uid is free
    again, and the next call is served. Before: RecursionError out of the clean-up, the uid and tree leaked."""
    from mtrain.tools import sandbox
    before = set(_sandbox_uid_files())
    limits = SandboxLimits(wall_s=20.0, cpu_s=10, max_files=100_000)
    r = run_python(DEEP, limits, stdin=where)
    assert r.ok and "/deep-" in r.stdout, r
    assert sandbox._uids_in_use == set()
    assert not os.path.lexists(r.stdout.strip()) and set(_sandbox_uid_files()) <= before
    assert os.path.isfile("/etc/passwd")  # the symlink's target is untouched
    assert PythonTool(LIMITS).call(_session(), {"code": "print('fine')"}) == "fine"


PLANTED = textwrap.dedent("""
    # A trainer that died mid-call left files of every sandbox uid in /dev/shm; a new trainer process starts.
    import os, sys
    from mtrain.tools import sandbox
    for uid in range(sandbox._UID_BASE, sandbox._UID_BASE + sandbox._UID_SLOTS):
        p = f"/dev/shm/left-planted-{uid}"
        open(p, "w").write("secret")
        os.chown(p, uid, uid)
    r = sandbox.run_python(sys.argv[1], sandbox.SandboxLimits(wall_s=5.0, cpu_s=3))
    print(r.stdout.strip())
""")


@own_uid
def test_a_tree_left_by_a_uid_is_removed_before_that_uid_is_handed_out():
    """What idle sandbox uids own in the shared temporary directories is removed before a process hands out its
    first uid: no call reads what a dead trainer's calls left."""
    try:
        p = subprocess.run([sys.executable, "-c", PLANTED, READ], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=REPO))
        assert p.returncode == 0 and p.stdout.strip() == "found []", p.stdout + p.stderr
    finally:
        for e in os.scandir("/dev/shm"):
            if e.name.startswith("left-planted-"):
                os.unlink(e.path)


SYSV = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    KEY, SIZE = 0x6d747231, 1 << 20
    if sys.argv[-1] == "write" or sys.stdin.read().strip() == "write":
        shm = libc.shmget(KEY, SIZE, 0o1000 | 0o666)            # IPC_CREAT
        q = libc.msgget(KEY, 0o1000 | 0o666)
        if shm >= 0:  # refused (ENOSYS) under the sandbox's syscall filter
            ctypes.memmove(libc.shmat(shm, None, 0), b"secret", 6)
        print("made", shm >= 0, q >= 0)
    else:
        shm, q = libc.shmget(KEY, 0, 0), libc.msgget(KEY, 0)
        print("found", shm >= 0, q >= 0)
""")


@own_uid
def test_sysv_ipc_made_by_a_call_is_gone_for_the_next():
    """SysV shared memory and message queues outlive their process on a host; in the call's own IPC namespace
    they end with it (before: 400 MB of shared memory stayed in RAM and the next call read it back). Where the
    sandbox's syscall filter runs, they cannot even be made (shmget, msgget: ENOSYS)."""
    from mtrain.tools.sandbox_syscalls import syscall_filter_available
    w = run_python(SYSV, LIMITS, stdin="write")
    made = str(not syscall_filter_available())
    assert w.ok and w.stdout.split() == ["made", made, made], w
    r = run_python(SYSV, LIMITS, stdin="read")
    assert r.ok and r.stdout.split() == ["found", "False", "False"], r


NAMELESS = textwrap.dedent("""
    import os, sys, time
    kind = sys.stdin.read().strip()
    keep = []
    for i in range(40):          # 40 x 4 MB, each on no path: past the 32 MB bound
        if kind == "memfd":
            fd = os.memfd_create(f"m{i}")
        else:
            fd = os.open(f"gone-{i}", os.O_CREAT | os.O_RDWR)
            os.unlink(f"gone-{i}")
        os.write(fd, b"x" * (4 << 20))
        keep.append(fd)
        time.sleep(0.02)
    time.sleep(2)
    print("not stopped")
""")


@pytest.mark.parametrize("kind", ["memfd", "unlinked"])
def test_files_without_a_name_count_toward_the_write_bound(kind):
    """A memfd or a file unlinked while open is on no path: counted through the processes' open files (before:
    160 MB held without the call being stopped)."""
    r = run_python(NAMELESS, SandboxLimits(wall_s=20.0, cpu_s=10, max_disk_mb=32, max_file_mb=8), stdin=kind)
    assert r.over_disk and "not stopped" not in r.stdout, r
    assert PythonTool(LIMITS).call(_session(), {"code": "print('fine')"}) == "fine"
