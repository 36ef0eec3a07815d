"""serve/generation.py: the engine's events reach the event loop in order, in bunches (one wake-up per bunch)."""

from __future__ import annotations

import asyncio
import threading

from symbiosis.serve.generation import _EventSink


def _on_a_thread(check) -> None:
    """`check()` on a thread of its own (after a browser test, Playwright's loop still counts as running in the main
    thread), its failure raised here."""
    failures = []

    def record() -> None:
        try:
            check()
        except BaseException as error:  # noqa: BLE001 -- raised again on the test's thread
            failures.append(error)
    checking = threading.Thread(target=record)
    checking.start()
    checking.join()
    if failures:
        raise failures[0]


def _sinks(count: int):
    """(a new loop, the calls that wake it, `count` queues on it, a sink for each)."""
    loop = asyncio.new_event_loop()
    wake_ups = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: (wake_ups.append(args), original(*args))[1]
    queues = [asyncio.Queue() for _ in range(count)]
    return loop, wake_ups, queues, [_EventSink(loop, queue, index) for index, queue in enumerate(queues)]


def test_events_from_the_engine_thread_arrive_in_order_with_one_wake_up_per_bunch():
    _on_a_thread(_check_delivery)


def _check_delivery() -> None:
    loop, wake_ups, queues, sinks = _sinks(3)
    try:

        def engine_step(step):  # one step: a token for every request
            for sink in sinks:
                sink.put(f"token {step}")
        engine = threading.Thread(target=lambda: [engine_step(step) for step in range(50)])
        engine.start()
        engine.join()  # the loop has not run meanwhile: everything is one bunch
        assert len(wake_ups) == 1

        async def read_all():
            return [[(await queue.get()) for _ in range(50)] for queue in queues]
        received = loop.run_until_complete(read_all())
        assert received == [[(index, f"token {step}") for step in range(50)] for index in range(3)]
        sinks[0].put("after")  # the inbox emptied: the next event wakes the loop again
        assert len(wake_ups) == 2 and loop.run_until_complete(queues[0].get()) == (0, "after")
    finally:
        loop.close()
    sinks[1].put("dropped")  # a closed loop: dropped, no error


def test_quiet_events_wait_for_a_flush_and_one_wake_up_serves_them_all():
    _on_a_thread(_check_quiet_delivery)


def _check_quiet_delivery() -> None:
    loop, wake_ups, queues, sinks = _sinks(2)
    try:
        for step in range(3):
            for sink in sinks:
                sink.put_quietly(f"token {step}")
        assert wake_ups == []  # nothing calls the loop until a flush
        sinks[0].flush()
        sinks[1].flush()  # the loop is called already: no second wake-up
        assert len(wake_ups) == 1
        received = [loop.run_until_complete(_take(queue, 3)) for queue in queues]
        assert received == [[(index, f"token {step}") for step in range(3)] for index in range(2)]
        sinks[0].flush()  # nothing waiting: no wake-up
        sinks[1].put_quietly("quiet")
        sinks[0].put("loud")  # a put that wakes takes the quiet one along
        assert len(wake_ups) == 2
        assert loop.run_until_complete(_take(queues[1], 1)) == [(1, "quiet")]
    finally:
        loop.close()


async def _take(queue: asyncio.Queue, count: int) -> list:
    return [await queue.get() for _ in range(count)]
