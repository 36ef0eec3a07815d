"""Hand-over from any thread to the server's I/O thread: a queue, and a pipe whose read end the I/O thread
polls beside its sockets, so a call finished on the batcher thread wakes it at once (only the I/O thread
touches the ZeroMQ socket)."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Iterator


class Mailbox:
    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self.fd, self._write_fd = os.pipe()  # poll `fd` for readable: something was posted
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)  # a full pipe wakes the reader already
        self._lock = threading.Lock()  # a post never writes to a closed (and maybe reused) descriptor
        self._closed = False

    def post(self, item: Any = None) -> None:
        """From any thread. None only wakes the reader (say, to see that it should stop). After `close` (the
        reader is gone: a stop that raced the reader's own end) it does nothing."""
        if item is not None:
            self._items.put(item)
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass

    def take(self) -> Iterator[Any]:
        """On the I/O thread: what was posted since the last call, oldest first."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.fd)
            os.close(self._write_fd)
