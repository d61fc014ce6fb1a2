"""Printing that outlives its reader: once the terminal is closed (SIGHUP) or the pipe's reader
is gone, a write fails with an OSError. A job stopping on a signal must still finish its step,
save and exit with its own status, so the line is dropped, and the stream is pointed at
``/dev/null`` (else the flush at interpreter exit fails again and Python exits with 120).

`say` prints a line; `ProgressLine` keeps one progress line on stderr, rewritten in place."""

from __future__ import annotations

import os
import sys
import time


def say(text: str, stream: str = "stdout") -> None:
    """Print `text` to ``sys.<stream>`` ("stdout" or "stderr") and flush, best effort."""
    try:
        print(text, file=getattr(sys, stream), flush=True)
    except OSError:
        setattr(sys, stream, open(os.devnull, "w"))


class ProgressLine:
    """A line on stderr, rewritten in place (at most ten times a second): the current phase's
    name, the bytes done of `total` and the rate since the phase began. Silent unless `enabled`
    (default: when stderr is a terminal); a failed write silences it. As a context manager, it
    clears its line on exit."""

    def __init__(self, total: int, enabled: bool | None = None, name: str = "") -> None:
        self.total = total
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.name, self.done, self.started, self.shown = name, 0, time.monotonic(), 0.0

    def phase(self, name: str) -> None:
        """Start phase `name`: count from 0 again."""
        self.name, self.done, self.started = name, 0, time.monotonic()

    def advance(self, nbytes: int) -> None:
        """Count `nbytes` more done."""
        self.update(self.done + nbytes, self.total)

    def update(self, done: int, total: int) -> None:
        """`done` bytes of `total` are done (the form of a ``progress(done, total)`` callback)."""
        self.done, self.total = done, total
        now = time.monotonic()
        if self.enabled and now - self.shown >= 0.1:
            self.shown = now
            rate = self.done / 1e6 / max(now - self.started, 1e-9)
            percent = 100 * self.done / max(self.total, 1)
            self._show(f"{self.name}: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB ({percent:.0f}%), "
                       f"{rate:.1f} MB/s")

    def close(self) -> None:
        """Clear the line, if one was shown."""
        if self.enabled and self.shown:
            self._show("")

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _show(self, text: str) -> None:
        try:
            sys.stderr.write(f"\r{text:<79}\r" if text else "\r" + " " * 79 + "\r")
            sys.stderr.flush()
        except OSError:
            self.enabled = False
