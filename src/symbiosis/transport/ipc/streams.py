"""The executor's side of pipelined calls: the rules of its one CUDA stream.

A pipelined client (a process on the executor's GPU) queues each call on its own stream and does not wait
(`pipelined.py`). The executor's stream waits for the call's input flag right before the call's GEMM, and
writes its output flag after it (`streamops`); `StreamLedger` records what the stream has been given and
not yet run.

While several pipelined clients have calls, each may have SHARED_STREAM_DEPTH queued on the stream and not
yet run there. The stream runs calls in the order they were queued, each behind its input's flag: a client
whose CPU is far ahead of its GPU would otherwise queue a burst of calls (up to a doorbell ring) that all
wait, one after the other, for its GPU, with every other client's ready calls stuck behind them. Two keep a
call of each client queued while its previous one runs (hiding the I/O thread's time per call), and
interleave the clients' calls so that each has the others' GEMMs' time to produce its next input.
Inference calls are not held: they go first (as in the batching policies), and a decoding client's calls,
each needing the one before, would otherwise wait behind every training client's queued calls in turn
(decode under four fine-tuning tenants took 1.71x its time alone, docs/PERFORMANCE.md section 4).

A pipelined client that leaves or dies may have calls queued on the stream waiting for inputs that never
come: its input flag is set far ahead from a stream of its own, and its buffers stay mapped until the
stream is past them.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable

import torch

from symbiosis.transport.ipc import streamops
from symbiosis.transport.ipc.streamledger import StreamLedger

log = logging.getLogger("symbiosis.executor")
SHARED_STREAM_DEPTH = 2


class StreamRules:
    """What the I/O thread asks before and after a pipelined client's call (`client` is the server's record:
    `flags`, `buffer`, `pending`, `on_stream`)."""

    def __init__(self, device: torch.device):
        self.available = streamops.available(device)  # this executor can serve pipelined clients
        self.device_index = device.index
        # The stream the executor computes on (its threads' current stream).
        self.torch_stream = torch.cuda.current_stream(device) if self.available else None
        self.stream = self.torch_stream.cuda_stream if self.torch_stream is not None else None
        # Pipelined calls queued and not yet run by the stream, and departed clients' buffers to unmap once
        # it is past their calls.
        self.ledger = StreamLedger(torch.cuda.Event)
        self.side_stream = streamops.side_stream(device.index) if self.available else None

    def __bool__(self) -> bool:
        """Whether the stream has pipelined calls queued and not yet run."""
        return bool(self.ledger)

    def run_passed(self) -> int:
        return self.ledger.run_passed()

    def holds(self, client, clients) -> bool:
        """Whether the client's next taken call must wait: it has SHARED_STREAM_DEPTH calls on the stream, and
        another pipelined client has calls too (inference calls are never held)."""
        if client.flags is None or client.on_stream < SHARED_STREAM_DEPTH or client.pending[0].inference:
            return False
        busy = 0
        for other in clients:
            busy += other.flags is not None and bool(other.pending or other.on_stream)
            if busy > 1:
                return True
        return False

    def gate(self, client, seq: int) -> Callable[[], None] | None:
        """What the stream the call's GEMM runs on must wait for first: its input flag."""
        if client.flags is None:
            return None
        return partial(self._wait_input, client.flags.tensor.data_ptr(), seq)

    def _wait_input(self, address: int, seq: int) -> None:
        # Called by the thread about to run the call, on the stream it will run on: the executor's, or the
        # stream of its own that a layer on another GPU of this process runs on (executor/peers.py), which must
        # see the flag itself (an event of the executor's stream recorded before this wait would not carry it).
        stream = self.stream if self.torch_stream is None else \
            torch.cuda.current_stream(self.torch_stream.device).cuda_stream
        streamops.wait_geq(stream, address, seq, self.device_index)

    def answered(self, client, seq: int, ran: Callable[[], None]) -> None:
        """Behind the call's output copy (or at once, for a failed call): its output flag; `ran` once the
        stream has run it."""
        try:
            streamops.write(self.stream, client.flags.tensor.data_ptr() + 4, seq, self.device_index)
            self.ledger.after(self.torch_stream, ran)
            client.on_stream += 1
        except RuntimeError as e:
            log.error("could not release client %s's stream: %s", client.name, e)

    def let_pass(self, client) -> None:
        """A pipelined client left (or died): its queued calls must not wait for inputs that never come."""
        try:
            streamops.release(self.side_stream, client.flags.tensor.data_ptr(), client.doorbell.seq,
                              self.device_index)
        except RuntimeError as e:
            log.error("could not release the executor's stream from %s's flags: %s", client.name, e)
        for shared in (client.buffer, client.flags):
            self.ledger.after(self.torch_stream, shared.close)
