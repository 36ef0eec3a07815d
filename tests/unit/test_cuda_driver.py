"""The driver calls of cuda_driver.py against torch's own: a copy, an event's order across streams, a graph launch,
and the primary context on a thread that has made no CUDA call."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from symbiosis import cuda_driver

pytestmark = pytest.mark.gpu


def test_a_copy_queued_behind_a_wait_lands_after_it_and_the_event_says_when():
    source = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    target = torch.zeros(1 << 20, device="cuda")
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)  # the copy below waits behind it
    cuda_driver.copy_to_device(target.data_ptr(), source.data_ptr(), source.nbytes, side.cuda_stream)
    event = cuda_driver.Event()
    event.record(side.cuda_stream)
    assert not event.done()
    event.wait(other.cuda_stream)  # `other`'s work after this sees the copy
    with torch.cuda.stream(other):
        doubled = target * 2
    other.synchronize()
    assert event.done() and torch.equal(doubled.cpu(), source * 2)


def test_a_graph_launched_through_the_driver_runs_what_was_recorded():
    x, y = torch.ones(1024, device="cuda"), torch.zeros(1024, device="cuda")
    capture = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        graph.capture_begin()
        y.copy_(x * 3)
        graph.capture_end()
    x.fill_(5)
    stream = torch.cuda.Stream()
    cuda_driver.launch_graph(graph.raw_cuda_graph_exec(), stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(y.cpu(), torch.full((1024,), 15.0))


def test_the_primary_context_is_made_current_on_a_thread_without_one_and_taken_back():
    context, seen = cuda_driver.PrimaryContext(0), {}

    def work():
        current = ctypes.c_void_p()
        cuda_driver.driver().cuCtxGetCurrent(ctypes.byref(current))
        seen["before"] = current.value
        with context.current():
            event = cuda_driver.Event()  # needs a context
            event.record(0)
            seen["done"] = event.wait(0) is None
            del event  # (destroyed in the context it was made in)
        cuda_driver.driver().cuCtxGetCurrent(ctypes.byref(current))
        seen["after"] = current.value

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"before": None, "done": True, "after": None}
