"""A one-line progress bar on stderr, drawn only when stderr is a terminal (CI logs stay clean)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("conformance", total=40) as bar: bar.advance(note="test_x")``.

    Silent unless ``stream.isatty()``; the last line is cleared on exit so later output starts on a clean line.
    """

    def __init__(self, phase: str, total: int | None = None, stream=None, width: int = 28):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.phase = phase
        self.total = total
        self.done = 0
        self.width = width
        self.start = time.perf_counter()

    def set_total(self, total: int) -> None:
        self.total = total
        self.draw()

    def advance(self, step: int = 1, note: str = "") -> None:
        self.done += step
        self.draw(note)

    def draw(self, note: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if self.total:
            filled = min(self.width, self.width * self.done // self.total)
            bar = "#" * filled + "." * (self.width - filled)
            line = f"{self.phase} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note}"
        else:
            line = f"{self.phase} {self.done} {elapsed:5.1f}s {note}"
        self.stream.write("\r" + line[:110].ljust(110))
        self.stream.flush()

    def __enter__(self) -> Progress:
        self.draw()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 110 + "\r")
            self.stream.flush()
