"""Work for a change of world done before the change, while training goes on.

Planning a change (where the next world's pieces go, and the plan that moves the state there) and
turning the plan into a worker's program of transfers (`reshard.schedule`,
`reshard.execute.compile_program`) is pure work on the model's logical tensors: a tenth to half a
second for a 100M-parameter model on a busy CPU, during which every worker of a change would stand
still. A worker that sees a change coming (its lookout thread sees a notice or a ready joiner:
`lookout.Lookout`; a joiner waits to be admitted: `worker.ElasticWorker.join`) hands
the work to `Ahead`, whose one thread does it while the step runs. At the boundary the change
takes the result, waiting for it if it is under way, or does the work itself if nobody foresaw
it.

The work is keyed by everything it depends on, and it is pure, so what was done ahead is what the
boundary would have done: a guess that turns out wrong costs background time, never a wrong plan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Ahead:
    """Results of pure work by key, each worked out once: in the background (`start`) or when
    first needed (`get`). Any thread may call its methods."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardshift-ahead")
        self._work: dict[Hashable, Future] = {}
        self._lock = threading.Lock()

    def start(self, key: Hashable, work: Callable[[], T]) -> None:
        """Do `work` in the background, unless `key`'s is done or under way. Work is done in the
        order it was started."""
        with self._lock:
            if key not in self._work:
                self._work[key] = self._pool.submit(work)

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key`'s work is done or under way."""
        with self._lock:
            return key in self._work

    def get(self, key: Hashable, work: Callable[[], T]) -> T:
        """`key`'s result: the one worked out ahead (waited for if still under way; the work's
        exception, if it raised one), else `work()`, done now and kept."""
        with self._lock:
            future = self._work.get(key)
            mine = future is None
            if mine:
                future = self._work[key] = Future()
        if mine:
            try:
                future.set_result(work())
            except BaseException as err:
                future.set_exception(err)
        return future.result()

    def forget(self) -> None:
        """Drop every result (the world changed: its keys will not come again). Work not begun is
        cancelled; work under way finishes, unheeded."""
        with self._lock:
            for future in self._work.values():
                future.cancel()
            self._work.clear()

    def close(self) -> None:
        self.forget()
        self._pool.shutdown(wait=False)
