"""Run a `shardshift` command as ``python -m shardshift ARGV`` would, without a fresh interpreter.

Most tests run commands only to read what they print and write. A fresh interpreter would import
torch and the training code again (about 3 s of CPU per command); here the command runs in a fork
of the test session's fork server (`support.dist`), which imported them once. The command itself
runs exactly as from the shell: ``shardshift/__main__.py`` with that command line, environment
and working directory, its launcher forking its ranks as usual.

Tests of the launcher itself (signals, kills, start-up without torch) start real processes
instead: they are about the process a user starts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence

from support.dist import context


def forbid_processes(monkeypatch) -> None:
    """Run as a user's shell would: not as a rank of a job; and fail if any process is started."""
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)

    def no_process(*args, **kwargs):
        raise AssertionError("bad input reached the launcher: a process would have been started")

    monkeypatch.setattr("shardshift.launch.start_ranks", no_process)
    monkeypatch.setattr("shardshift.elastic.coordinator.launch_elastic", no_process)


def _run(argv: list[str], env: dict[str, str], cwd: str | None, out: str, err: str) -> None:
    """In the fork: a session of its own, SIGTERM when the fork server goes, then the command."""
    from shardshift.launch import become_command, die_with_parent

    os.setsid()
    die_with_parent(os.getppid())
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        become_command(argv, env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd)


def run_shardshift(argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                   cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "shardshift", *argv], capture_output=True, text=True, ...)``,
    run as the module docstring says. Past `timeout` the command's whole session is killed and
    `subprocess.TimeoutExpired` raised, as `subprocess.run` does."""
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory(prefix="test-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = context().Process(target=_run, args=(argv, dict(env if env is not None else os.environ),
                                                    None if cwd is None else str(cwd), out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join(30)
            raise subprocess.TimeoutExpired(["shardshift", *argv], timeout)
        with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
            return subprocess.CompletedProcess([sys.executable, "-m", "shardshift", *argv], proc.exitcode,
                                               f_out.read(), f_err.read())


def coordinator_address(lines: Iterable[str], until: str) -> str | None:
    """The HOST:PORT an elastic job's coordinator printed, read from its output `lines` up to the
    first line that starts with `until` (e.g. ``"step     2"``); None if it printed none."""
    address = None
    for line in lines:
        if (found := re.search(r"coordinator at (\S+?:\d+):", line)) is not None:
            address = found.group(1)
        if line.startswith(until):
            break
    return address
