"""What the executor's stream has been given and not yet run, in order, with what to do once it has.

The executor's I/O thread queues pipelined calls on one CUDA stream and never waits for it; it still needs
to know when the stream is past a point: to let a client queue more calls (`server.py` bounds how many each
may have waiting there), and to unmap a departed client's buffers only once no queued work can touch them.
Each point is an event recorded on the stream; the stream passes them in the order they were recorded, so
`run_passed` checks the oldest first and stops at the first the stream has not reached.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol


class StreamEvent(Protocol):  # torch.cuda.Event, or a stand-in in tests
    def record(self, stream) -> None: ...
    def query(self) -> bool: ...


class StreamLedger:
    def __init__(self, new_event: Callable[[], StreamEvent]):
        self._new_event = new_event
        self._points: deque[tuple[StreamEvent, Callable[[], None]]] = deque()  # oldest first
        self._spare: list[StreamEvent] = []  # passed events, recorded again (making one costs a driver call)

    def __bool__(self) -> bool:
        return bool(self._points)

    def after(self, stream, then: Callable[[], None]) -> None:
        """Call `then` (from `run_passed`) once `stream` has run everything queued on it so far."""
        event = self._spare.pop() if self._spare else self._new_event()
        event.record(stream)
        self._points.append((event, then))

    def run_passed(self) -> int:
        """Run the callbacks of the points the stream has passed, oldest first; how many ran. A callback
        may add points (they are checked in this same pass)."""
        ran = 0
        while self._points and self._points[0][0].query():
            event, then = self._points.popleft()
            self._spare.append(event)
            then()
            ran += 1
        return ran
