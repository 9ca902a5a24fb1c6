"""Progress of a long run on stderr: which model and peer, what phase, time so far. On a
terminal it rewrites one line; elsewhere (logs, CI) it prints one line per phase."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.rewrite = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()
        self.where = ""
        self.width = 0

    def model(self, index: int, count: int, name: str) -> None:
        self.where = f"model {index + 1}/{count} {name}"
        self._show(self.where)

    def phase(self, peer: str, what: str) -> None:
        self._show(f"{self.where} · {peer} · {what}")

    def note(self, text: str) -> None:
        """A line that stays (skipped peers, shrunk sizes)."""
        if self.enabled:
            self._clear()
            print(text, file=self.stream, flush=True)

    def done(self) -> None:
        if self.enabled:
            self._clear()

    def _show(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.perf_counter() - self.start:6.1f}s] {text}"
        if self.rewrite:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)

    def _clear(self) -> None:
        if self.rewrite and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.width = 0
