"""The polls of `retrieve_future` waiting for an answer (serve/tinker/api.py `Waiters`): handed the committed answer
from another thread, each poll of a request; after their hold, nothing; none left behind however a poll ends."""

from __future__ import annotations

import asyncio
import threading

from symbiosis.serve.tinker.api import Waiters

DONE = {"status": "done", "content_type": "json", "result": b"{}"}


def _left_waiting(scenario) -> dict:
    """`await scenario(waiters)` on a loop of its own, in a thread of its own (a test before may leave this thread's
    loop marked running: Playwright's sync API does); the polls still registered after it."""
    async def main():
        waiters = Waiters()
        waiters.loop = asyncio.get_running_loop()
        await scenario(waiters)
        return waiters._waiting

    left = []
    thread = threading.Thread(target=lambda: left.append(asyncio.run(main())))
    thread.start()
    thread.join(60)
    assert left, "the scenario did not finish"
    return left[0]


def test_every_poll_of_a_request_is_handed_its_answer_from_another_thread():
    async def scenario(waiters):
        polls = [asyncio.create_task(waiters.wait("r1", 10)) for _ in range(2)]
        other = asyncio.create_task(waiters.wait("r2", 10))
        await asyncio.sleep(0)  # the polls wait
        threading.Thread(target=waiters.answered, args=("r1", DONE)).start()
        assert await asyncio.gather(*polls) == [DONE, DONE]
        assert not other.done()  # another request's poll goes on waiting
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)

    assert _left_waiting(scenario) == {}


def test_a_poll_past_its_hold_gets_nothing_and_an_answer_for_no_poll_is_dropped():
    async def scenario(waiters):
        assert await waiters.wait("r1", 0.01) is None
        waiters.answered("r1", DONE)  # nobody waits: the next poll reads the database
        await asyncio.sleep(0.01)

    assert _left_waiting(scenario) == {}


def test_a_burst_of_answers_from_another_thread_reaches_every_poll():
    """A round's answers come together from the trainer's thread (one wake-up of the loop for them all)."""
    async def scenario(waiters):
        polls = [asyncio.create_task(waiters.wait(f"r{i}", 10)) for i in range(64)]
        await asyncio.sleep(0)

        def answer_all():
            for i in range(64):
                waiters.answered(f"r{i}", {**DONE, "result": str(i).encode()})
        threading.Thread(target=answer_all).start()
        results = await asyncio.wait_for(asyncio.gather(*polls), 10)
        assert [r["result"] for r in results] == [str(i).encode() for i in range(64)]

    assert _left_waiting(scenario) == {}
