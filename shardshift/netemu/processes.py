"""Commands behind link emulation (network.py): running `ip` / `tc`, listing and deleting
namespaces, and the process-wide teardown registry that atexit and the SIGTERM / SIGINT handlers
use. Starting, watching and stopping the ranks is `shardshift.launch`'s."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
from typing import Protocol

from shardshift.files import pid_alive
from shardshift.netemu.shaping import DEFAULT_PREFIX, check_prefix, parse_network_name

COMMAND_TIMEOUT_S = 60.0
KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL when a network stops its processes


class Closable(Protocol):
    name: str

    def close(self, raise_on_leftovers: bool = True) -> None: ...


# Networks of this process not yet torn down, by id. The one piece of global state here, and on
# purpose: atexit and signal handlers are process-wide and must reach every live network.
_LIVE: dict[int, Closable] = {}
_LOCK = threading.RLock()
_PREVIOUS_HANDLERS: dict[int, object] = {}


def list_namespaces() -> list[str]:
    out = run_command(["ip", "netns", "list"], what="list namespaces").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete the namespaces of networks with this prefix whose owner process is gone (killed
    before it could tear down). Live networks, in this process or another, are left alone."""
    check_prefix(prefix)
    stale = []
    for ns in list_namespaces():
        parsed = parse_network_name(ns, prefix)
        if parsed is not None and parsed[1] != os.getpid() and not pid_alive(parsed[1]):
            stale.append(ns)
    if stale:
        run_command(["ip", "-force", "-batch", "-"], what="delete stale namespaces",
                    check=False, input="".join(f"netns del {ns}\n" for ns in stale))
    return stale


def run_command(argv: list[str], *, what: str, input: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(argv, input=input, capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"could not {what}: `{' '.join(argv)}` failed: {err}") from err
    if check and result.returncode != 0:
        raise RuntimeError(
            f"could not {what}: `{' '.join(argv)}` exited {result.returncode}: "
            f"{result.stderr.strip()} (link emulation needs root and iproute2 with netns, veth, "
            f"bridge, HTB and u32 support)")
    return result


def register(net: Closable) -> None:
    with _LOCK:
        _LIVE[id(net)] = net
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                # An ignored signal stays ignored (e.g. SIGINT in a background job).
                if signal.getsignal(sig) not in (_on_signal, signal.SIG_IGN):
                    _PREVIOUS_HANDLERS[sig] = signal.getsignal(sig)
                    signal.signal(sig, _on_signal)


def unregister(net: Closable) -> None:
    with _LOCK:
        _LIVE.pop(id(net), None)
        if not _LIVE and threading.current_thread() is threading.main_thread():
            for sig, previous in list(_PREVIOUS_HANDLERS.items()):
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, previous)
                del _PREVIOUS_HANDLERS[sig]


def close_all() -> None:
    with _LOCK:
        nets = list(_LIVE.values())
    for net in nets:
        try:
            net.close(raise_on_leftovers=False)
        except Exception as err:  # at exit or in a signal handler: report, go on with the rest
            print(f"shardshift emulate: teardown of {net.name} failed: {err}", file=sys.stderr)


def _on_signal(signum: int, frame) -> None:
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    close_all()  # restores the previous handlers once no network is left
    if callable(previous):
        previous(signum, frame)  # e.g. Python's SIGINT handler raises KeyboardInterrupt
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die of the signal, as without us


atexit.register(close_all)
