"""Workers stop when their launcher dies.

torchrun starts each worker in a session of its own, so a SIGKILL to torchrun (an OOM killer, `kill -9`, a lost
node agent) reaches no worker: they would keep training and writing checkpoints with nobody to collect them, and
a relaunch would race them. A daemon thread compares the parent pid with the one seen at start (Linux gives an
orphan a new parent) and ends the process at once. os._exit rather than an exception: the main thread may be
inside a collective that never returns. A checkpoint being written at that moment stays a `.partial_step_N`
directory, which is never loaded (mtrain.trainer.checkpoint renames a save into place only once complete).

prctl(PR_SET_PDEATHSIG) was not used: it fires when the parent *thread* that forked us exits, not the process.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

# Exit status when the worker is not its group's leader (else the group's SIGKILL ends it first).
EXIT_PARENT_DIED = 143  # as if terminated by SIGTERM (128 + 15): the launcher's death ended this worker


def _end_own_children() -> None:
    """Processes this worker started (Megatron's checkpoint writers, multiprocessing's resource tracker) go too.

    Under torchrun a worker leads a process group of its own (start_new_session), so one killpg reaches every
    descendant; started any other way (a shell, pytest), only multiprocessing's children are ours to end."""
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)  # this process included: it was about to exit anyway
    for child in multiprocessing.active_children():
        child.kill()


def stop_with_parent(poll_s: float = 0.5) -> threading.Thread | None:
    """Start the watch (call once per process). Returns the thread, or None when not a torchrun worker or there is
    no parent to watch (pid 1: already orphaned)."""
    parent = os.getppid()
    # Only torchrun's workers: a single `mtrain train` started with nohup must outlive the shell that started it.
    if parent == 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    rank = os.environ.get("RANK", "0")

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                sys.stderr.write(f"mtrain: rank {rank}: the launcher (pid {parent}) is gone: stopping this worker\n")
                sys.stderr.flush()
                try:
                    _end_own_children()
                finally:
                    os._exit(EXIT_PARENT_DIED)

    t = threading.Thread(target=watch, name="mtrain-parent-watch", daemon=True)
    t.start()
    return t
