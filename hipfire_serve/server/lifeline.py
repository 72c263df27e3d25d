"""Ties an engine child process to its server, so that the child never outlives it.

Two guards, because each misses a case of the other:
- on Linux the kernel sends the child SIGKILL when its parent goes (`PR_SET_PDEATHSIG`), which
  works even for a child that is stopped or stuck in a C call holding the GIL. The kernel counts
  the parent as gone when the *thread* that started the child ends, so the server starts its
  children from its long-lived event-loop thread;
- everywhere, a thread of the child waits on a pipe whose other end only the server holds: the
  end closes when the server process ends, however it ends, and the child exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def watch_parent(lifeline: Connection, parent_pid: int) -> None:
    """Called first thing in the child: exits it as soon as the parent is gone."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)  # the parent went before the guard was set
    threading.Thread(
        target=_exit_at_eof, args=(lifeline,), name="hipfire-parent-watch", daemon=True
    ).start()


def _exit_at_eof(lifeline: Connection) -> None:
    # The server never writes: returning from recv in any way means its end has closed.
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(0)
