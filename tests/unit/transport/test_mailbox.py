"""The I/O thread's mailbox: posts from any thread wake it; a post that races the reader's end does nothing."""

from __future__ import annotations

import select
import threading

from symbiosis.transport.mailbox import Mailbox


def test_posts_wake_the_reader_in_order_and_a_post_after_close_is_dropped():
    box = Mailbox()
    threads = [threading.Thread(target=box.post, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert select.select([box.fd], [], [], 1)[0] == [box.fd]
    assert sorted(box.take()) == list(range(8))
    assert select.select([box.fd], [], [], 0)[0] == []
    for _ in range(100_000):  # more wake-ups than a pipe holds: a full pipe wakes the reader already
        box.post()
    box.close()
    box.post()  # the server's stop() racing the I/O thread's own end: no error, no write to a closed descriptor
    box.post("late")
