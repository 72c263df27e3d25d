"""A one-line progress bar on stderr, redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from loadtests.records import RequestRecord


class Progress:
    def __init__(self, total: int, title: str, enabled: bool, stream: TextIO | None = None):
        self.total = total
        self.title = title
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.num_done = 0
        self.num_errors = 0
        self.num_tokens = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_errors += 0 if record.ok else 1
        self.num_tokens += record.num_output_tokens if record.ok else 0
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw >= 0.1 or self.num_done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line(now - self._start))
            self.stream.flush()

    def line(self, elapsed_s: float, width: int = 30) -> str:
        filled = width * self.num_done // max(self.total, 1)
        bar = "#" * filled + "." * (width - filled)
        rate = self.num_tokens / elapsed_s if elapsed_s > 0 else 0.0
        errors = f" {self.num_errors} err" if self.num_errors else ""
        return (
            f"{self.title} [{bar}] {self.num_done}/{self.total} req "
            f"{self.num_tokens} tok {rate:,.0f} tok/s {elapsed_s:.1f}s{errors}"
        )

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
