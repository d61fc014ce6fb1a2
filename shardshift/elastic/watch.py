"""Leaving a broken world at once: a worker's watch for the crash records of the world it trains in,
or of the change of world it is making.

A survivor of a crash can be blocked in a collective or a transfer on another survivor, which has
seen the crash and left the world to recover: gloo cannot cancel that wait, and it would last
until ``--timeout``. So every worker watches, from a thread of its own, for the coordinator's crash
records (`protocol.CrashRecord`) of the epochs it is armed for: the world it trains in, or, while
the state moves, the change's (`moving`). Once a record is there, and the worker has not begun to
recover, the thread severs this process's connections (`comm.sever`) but those of its long-lived
store clients: its pending collective, transfer or rendezvous (whose store client is made for it,
after the watch was armed) fails at once, whichever peer it waits for, and the worker recovers
(`recovery.CrashRecovery`, `moving.move`). The bound is the watch's period (`WATCH_S`) after the
record.
"""

from __future__ import annotations

import threading

from shardshift.comm.sever import sever_connections, store_sockets
from shardshift.elastic.protocol import JobStore

WATCH_S = 0.05  # how often the watch looks for a crash record


class BrokenWorldWatch:
    """Severs this process's connections as soon as a crash is recorded for an epoch it is armed for
    (module docstring). The main thread `arm`s it for the world it trains in (or the change it
    makes) and `disarm`s it before it builds anything of another world; the thread acts only while
    it is armed, and the two never overlap (one lock), so no connection of a next world is cut."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.store = JobStore.connect(address, timeout_s)  # a client of its own: not the main thread's
        host, _, port = address.rpartition(":")
        self.address = (host, int(port))
        self.kept: frozenset[int] = frozenset()  # the store clients' sockets that are never severed
        self.lock = threading.Lock()
        self.armed: tuple[int, ...] = ()  # the epochs watched
        self.store_gone = threading.Event()  # the job's store stopped answering: the coordinator is gone
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="shardshift-watch", daemon=True).start()

    def keep_store_clients(self) -> None:
        """Never sever the connections to the store that this process has now (its long-lived clients:
        the main thread's, the heartbeat's, the lookout's, this watch's)."""
        self.kept |= store_sockets(self.address)

    def arm(self, *epochs: int) -> None:
        """Watch `epochs`; the store clients made from now on (a rendezvous's) are severed with the rest."""
        self.keep_store_clients()
        with self.lock:
            self.armed = epochs

    def disarm(self) -> None:
        with self.lock:
            self.armed = ()

    def close(self) -> None:
        self.disarm()
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(WATCH_S):
            epochs = self.armed
            try:
                if not any(self.store.has_crash(epoch) for epoch in epochs):
                    continue
            except (RuntimeError, OSError):  # the coordinator is gone (`orphaned`)
                self.store_gone.set()
                return
            with self.lock:
                if self.armed == epochs:
                    sever_connections(keep_sockets=self.kept)
                    self.armed = ()
