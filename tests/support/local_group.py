"""An in-process stand-in for a process group's point-to-point methods, for executor unit tests.

`LocalGroup.world(n)` gives n group objects that live in one process; each rank runs in its own
thread. `send([t], dst, tag)` / `recv([t], src, tag)` return works with `wait(timeout)`, and
messages match first-in first-out per (src, dst, tag), like gloo's. Sends are rendezvous: a send
completes only once its receive is posted and the data copied, which is stricter than gloo (that
may buffer), so an executor that deadlocks on a real group also deadlocks here. `allgather` is
provided for the plan check of runner.py.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from datetime import timedelta


class _Work:
    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else 60.0
        if not self._event.wait(seconds):
            raise RuntimeError(f"local p2p timed out after {seconds:.1f} s")
        return True


class _Wire:
    """Shared by the ranks of one world: pending sends and receives per (src, dst, tag)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lock = threading.Lock()
        self.sends: dict[tuple, deque] = defaultdict(deque)
        self.recvs: dict[tuple, deque] = defaultdict(deque)
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n

    def match(self, key: tuple) -> None:
        while self.sends[key] and self.recvs[key]:
            data, send_work = self.sends[key].popleft()
            target, recv_work = self.recvs[key].popleft()
            if target.numel() != data.numel():
                raise AssertionError(f"{key}: {data.numel()} elements sent, {target.numel()} expected")
            target.copy_(data)
            send_work._event.set()
            recv_work._event.set()


class LocalGroup:
    def __init__(self, wire: _Wire, rank: int) -> None:
        self._wire, self._rank = wire, rank

    @classmethod
    def world(cls, n: int) -> list[LocalGroup]:
        wire = _Wire(n)
        return [cls(wire, r) for r in range(n)]

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._wire.n

    def send(self, tensors, dst: int, tag: int) -> _Work:
        work, key = _Work(), (self._rank, dst, tag)
        with self._wire.lock:
            self._wire.sends[key].append((tensors[0].clone(), work))
            self._wire.match(key)
        return work

    def recv(self, tensors, src: int, tag: int) -> _Work:
        work, key = _Work(), (src, self._rank, tag)
        with self._wire.lock:
            self._wire.recvs[key].append((tensors[0], work))
            self._wire.match(key)
        return work

    def allgather(self, outputs, inputs) -> _Work:
        wire = self._wire
        wire.slots[self._rank] = inputs[0].clone()
        wire.barrier.wait(60)
        for r, out in enumerate(outputs[0]):
            out.copy_(wire.slots[r])
        wire.barrier.wait(60)
        work = _Work()
        work._event.set()
        return work


def run_ranks(n: int, fn, timeout_s: float = 60.0) -> list:
    """[fn(group, rank) for each rank], each rank in its own thread; re-raises the first error."""
    groups = LocalGroup.world(n)
    results: list = [None] * n
    errors: list = []

    def body(r: int) -> None:
        try:
            results[r] = fn(groups[r], r)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks still running after {timeout_s} s (deadlock?)")
    return results
