"""A worker thread that does its owner's work whenever there is some: the engine's steps, the training passes."""

from __future__ import annotations

import threading
from typing import Callable


class Worker:
    """Calls `work()` on a daemon thread while `has_work()` (checked under `lock`, which the owner holds to change
    what `has_work` reads, then `wake`s the worker); `stop()` lets the current call finish and ends the thread."""

    def __init__(self, name: str, has_work: Callable[[], bool], work: Callable[[], object]):
        self.name, self.has_work, self.work = name, has_work, work
        self.lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    @property
    def stopping(self) -> bool:
        """Whether `stop()` was called: a `work()` that waits for more may stop waiting."""
        return self._stopping

    def wake(self) -> None:
        with self.lock:
            self.lock.notify()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self.lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._stopping and not self.has_work():
                    self.lock.wait()
                if self._stopping:
                    return
            self.work()
