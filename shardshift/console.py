"""Printing that outlives its reader: once the terminal is closed (SIGHUP) or the pipe's reader
is gone, a write fails with an OSError. A job stopping on a signal must still finish its step,
save and exit with its own status, so the line is dropped, and the stream is pointed at
``/dev/null`` (else the flush at interpreter exit fails again and Python exits with 120)."""

from __future__ import annotations

import os
import sys


def say(text: str, stream: str = "stdout") -> None:
    """Print `text` to ``sys.<stream>`` ("stdout" or "stderr") and flush, best effort."""
    try:
        print(text, file=getattr(sys, stream), flush=True)
    except OSError:
        setattr(sys, stream, open(os.devnull, "w"))
