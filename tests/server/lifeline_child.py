"""The target of the child processes in the lifeline test: an engine child's parent guard
(`hipfire_serve.server.lifeline`) without the engine, so the child starts in a fraction of a
second."""

from __future__ import annotations

import os
import time

from hipfire_serve.server.lifeline import watch_parent


def sleep_watching_parent(lifeline, parent_pid: int) -> None:
    watch_parent(lifeline, parent_pid)
    os.write(1, f"watching {os.getpid()}\n".encode())  # one write: children share the pipe
    time.sleep(120)
