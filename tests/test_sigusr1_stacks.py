"""SIGUSR1 stack dumps (mtrain/debug_signals.py) and the hang watchdog that sends them (benchmarks/hang_dump.sh).

Real subprocesses and real signals: what matters is that a signaled process prints its stacks and goes on, and that
the watchdog signals only the processes that registered the handler (SIGUSR1 kills any other).
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

WAITER = textwrap.dedent("""
    import sys
    from mtrain.debug_signals import install_stack_dump_signal
    install_stack_dump_signal()
    def waiting_for_the_signal():
        print("ready", flush=True)
        sys.stdin.readline()  # blocked in a C read, as a hung rank is: the signal interrupts it, PEP 475 resumes it
    waiting_for_the_signal()
    print("exited normally", flush=True)
""")


def test_sigusr1_prints_stacks_and_the_process_goes_on():
    p = subprocess.Popen([sys.executable, "-c", WAITER], env=ENV, cwd=REPO, text=True, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGUSR1)
    time.sleep(0.5)  # the dump is written by the handler, at once; then let the process go
    out, err = p.communicate("go\n", timeout=20)
    assert p.returncode == 0, err
    assert "exited normally" in out
    assert "Current thread" in err and "waiting_for_the_signal" in err, err


LOADER_WITH_OWN_HANDLER = textwrap.dedent("""
    import os, signal, time
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))  # a handler the process set before importing us
    import mtrain.rollout.sglang_loader  # noqa: F401 -- registers the dump only where SIGUSR1 is unhandled
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.2)
    print("own handler ran" if got else "own handler did not run", flush=True)
""")


def test_sglang_loader_keeps_an_existing_sigusr1_handler():
    r = subprocess.run([sys.executable, "-c", LOADER_WITH_OWN_HANDLER], env=ENV, cwd=REPO, text=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "own handler ran" in r.stdout
    assert "Current thread" not in r.stderr


def test_sglang_loader_import_registers_the_dump():
    code = ("import os, signal, time\nimport mtrain.rollout.sglang_loader\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\ntime.sleep(0.2)\nprint('alive', flush=True)")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=REPO, text=True, capture_output=True, timeout=60)
    assert r.returncode == 0 and "alive" in r.stdout, r.stderr  # SIGUSR1's default action would have killed it
    assert "Current thread" in r.stderr


@pytest.mark.skipif(shutil.which("ps") is None, reason="needs procps")
def test_hang_dump_signals_only_handlers_of_the_run(tmp_path):
    log, stacks = tmp_path / "train.log", tmp_path / "stacks.txt"
    log.write_text("step 0\n")
    with open(log, "a") as f:
        # a worker (matching args, handler), a launcher (matching args, excluded), a scheduler title without handler
        worker = subprocess.Popen([sys.executable, "-c", WAITER, "-m", "mtrain", "train"], env=ENV, cwd=REPO,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True)
        launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "torchrun", "-m", "mtrain",
                                     "train"], stderr=f)
        sched = subprocess.Popen(["bash", "-c", "exec -a sglang::scheduler_TP0 sleep 30"])
    try:
        assert worker.stdout.readline().strip() == "ready"
        env = {**os.environ, "HANG_DUMP_IDLE": "1", "HANG_DUMP_POLL": "0.5", "HANG_DUMP_WAIT": "1",
               "HANG_DUMP_MAX": "1", "PATH": "/usr/bin:/bin"}  # no py-spy: keeps the test short
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(REPO / "benchmarks/hang_dump.sh"), str(log), str(stacks), str(os.getpid())],
                           env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t0 < 15
        text = stacks.read_text()
        assert f"sent to {worker.pid}" in text and f"NOT sent to {sched.pid}" in text, text
        assert f"sent to {launcher.pid}" not in text
        assert "waiting_for_the_signal" in text.split("after the signal")[1]  # the worker's stacks, from the log
        assert launcher.poll() is None and sched.poll() is None  # nobody was killed
        out, _ = worker.communicate("go\n", timeout=20)
        assert worker.returncode == 0 and "exited normally" in out
    finally:
        for p in (worker, launcher, sched):
            p.kill()
            p.wait()
