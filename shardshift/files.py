"""Small facts about files and processes that several writers rely on: a file or a directory synced
so that what was written, renamed or created in it survives a crash, and whether a process (the
owner of a partial directory or a stale lock) is still alive."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """Make what was written to file `path`, or renamed and created in directory `path`, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
