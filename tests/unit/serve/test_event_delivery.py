"""serve/generation.py: the engine's events reach the event loop in order, in bunches (one wake-up per bunch)."""

from __future__ import annotations

import asyncio
import threading

from symbiosis.serve.generation import _EventSink


def test_events_from_the_engine_thread_arrive_in_order_with_one_wake_up_per_bunch():
    # on a thread of its own: after a browser test, Playwright's loop still counts as running in the main thread
    failures = []
    checking = threading.Thread(target=_record, args=(failures,))
    checking.start()
    checking.join()
    if failures:
        raise failures[0]


def _record(failures: list) -> None:
    try:
        _check_delivery()
    except BaseException as error:  # noqa: BLE001 -- raised again on the test's thread
        failures.append(error)


def _check_delivery() -> None:
    loop = asyncio.new_event_loop()
    wake_ups = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *args: (wake_ups.append(args), original(*args))[1]
    try:
        queues = [asyncio.Queue() for _ in range(3)]
        sinks = [_EventSink(loop, queue, index) for index, queue in enumerate(queues)]

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
