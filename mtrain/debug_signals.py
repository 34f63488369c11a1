"""`kill -USR1 PID` prints every thread's Python stack of a running process to its stderr; the process goes on.

For hangs (a rank stuck in a collective, a scheduler stuck in a weight load): the stack is printed by faulthandler's
C-level handler, so it also works while the main thread is blocked inside a C call (NCCL, CUDA, a lock), where a
Python-level signal handler would never run. benchmarks/hang_dump.sh sends the signal to a hung run's processes.
"""
from __future__ import annotations

import faulthandler
import signal

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # None on Windows: nothing is installed there


def install_stack_dump_signal(*, only_if_default: bool = False) -> bool:
    """Register the SIGUSR1 stack dump; True when registered.

    only_if_default: leave SIGUSR1 alone when a Python handler is set already (a process we only visit, such as an
    SGLang scheduler importing our loader, may use it for its own purpose). faulthandler's own handler is set with
    sigaction, not signal.signal, so getsignal() still reads SIG_DFL after it: a second call re-registers, harmlessly.
    """
    if STACK_SIGNAL is None:
        return False
    if only_if_default and signal.getsignal(STACK_SIGNAL) != signal.SIG_DFL:
        return False
    # fd 2, not sys.stderr: the process's real stderr (a torchrun worker's goes to the launcher's, which run scripts
    # tee into train.log), even where sys.stderr was replaced by an object without fileno(). chain=False: SIGUSR1's
    # default action is to terminate, which must not follow the dump.
    faulthandler.register(STACK_SIGNAL, file=2, all_threads=True, chain=False)
    return True
