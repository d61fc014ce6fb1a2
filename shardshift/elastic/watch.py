"""Leaving a broken world at once: a worker's watch for the crash record of the world it trains in.

A survivor of a crash can be blocked in a collective or a transfer on another survivor, which has
seen the crash and left the world to recover: gloo cannot cancel that wait, and it would last
until ``--timeout``. So every worker watches, from a thread of its own, for the coordinator's crash
record of its world (`protocol.CrashRecord`); once the record is there, and the worker has not
begun to recover, the thread severs this process's connections of that world (`comm.sever`): its
pending collective or transfer fails at once, whichever peer it waits for, and the worker recovers
(`recovery.CrashRecovery`). The bound is the watch's period (`WATCH_S`) after the record.
"""

from __future__ import annotations

import threading

from shardshift.comm.sever import sever_connections
from shardshift.elastic.protocol import JobStore

WATCH_S = 0.05  # how often the watch looks for a crash record


class BrokenWorldWatch:
    """Severs this process's connections of a world as soon as a crash of that world is recorded
    (module docstring). The main thread `arm`s it for the world it trains in and `disarm`s it before
    it builds anything of another world (recovering, or changing world); the thread acts only while
    it is armed, and the two never overlap (one lock), so no connection of a next world is cut."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.store = JobStore.connect(address, timeout_s)  # a client of its own: not the main thread's
        host, _, port = address.rpartition(":")
        self.keep = [(host, int(port))]  # every store client of this process talks to it
        self.lock = threading.Lock()
        self.armed: int | None = None  # the epoch watched
        self.store_gone = threading.Event()  # the job's store stopped answering: the coordinator is gone
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="shardshift-watch", daemon=True).start()

    def arm(self, epoch: int) -> None:
        with self.lock:
            self.armed = epoch

    def disarm(self) -> None:
        with self.lock:
            self.armed = None

    def close(self) -> None:
        self.disarm()
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(WATCH_S):
            epoch = self.armed
            try:
                if epoch is None or not self.store.has_crash(epoch):
                    continue
            except (RuntimeError, OSError):  # the coordinator is gone (`orphaned`)
                self.store_gone.set()
                return
            with self.lock:
                if self.armed == epoch:
                    sever_connections(self.keep)
                    self.armed = None
