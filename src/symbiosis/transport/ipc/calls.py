"""The `ipc://` call path on the executor's side: a client's doorbell requests, taken from its control block,
submitted in order, answered in place.

A client's taken calls are submitted one at a time: a call once the one before it is answered. A pipelined
client's calls then reach the executor's stream in order, each behind its input's flag; its later calls
depend on its earlier outputs, so any other order could leave the stream waiting for a flag that can only
come after it (`streams.py` says when a call must wait its turn on the stream).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from functools import partial
from typing import Callable

import torch

from symbiosis.errors import BadCall, SymbiosisError
from symbiosis.transport import wire
from symbiosis.transport.ipc.doorbell import Request
from symbiosis.transport.ipc.streams import StreamRules

log = logging.getLogger("symbiosis.executor")


class DoorbellCalls:
    """`clients`: the server's records by id (`doorbell`, `buffer`, `flags`, `pending`, `in_batcher`, ...).
    `submit(client, header, tensor, gate)`: hands a call to the executor; its result comes back to `finish`."""

    def __init__(self, clients: dict, streams: StreamRules,
                 submit: Callable[[object, dict, torch.Tensor, Callable | None], None]):
        self.clients, self.streams, self.submit = clients, streams, submit

    def take(self, client_id: str) -> bool:
        """The client's new requests (its request pipe is readable); False if its process closed the pipe."""
        client = self.clients[client_id]
        requests = client.doorbell.take_requests()
        if client.doorbell.peer_gone:
            return False
        if requests:
            client.last_seen = time.monotonic()
            client.pending.extend(requests)
            self.pump(client_id)
        return True

    def pump(self, client_id: str) -> None:
        """Submit the client's next taken calls while it has none in the executor."""
        client = self.clients.get(client_id)
        while client is not None and client.pending and not client.in_batcher:
            if self.streams.holds(client, self.clients.values()):
                return  # pumped again when the stream has run one (_ran)
            request: Request = client.pending.popleft()
            header = {"op": request.op, "layer": request.layer, "inference": request.inference,
                      "client": client_id, "seq": request.seq}
            try:
                if request.malformed:
                    raise BadCall(request.malformed)
                tensor = client.buffer.view(request.dtype, list(request.shape))
                client.in_batcher = True  # until finish answers it
                self.submit(client, header, tensor, self.streams.gate(client, request.seq))
            except Exception as error:  # refused before it was queued
                client.in_batcher = False
                if not isinstance(error, SymbiosisError):
                    log.exception("doorbell call of %s failed", client_id)
                self.answer(client_id, client, request.seq, error)

    def finish(self, client_id: str, seq: int, future: Future) -> None:
        """A call's result goes into the client's shared buffer, in place of its input."""
        client = self.clients.get(client_id)
        if client is None:
            return  # the client left (or died) while its call ran: nobody to answer
        client.in_batcher = False
        try:
            result = future.result()
            client.buffer.view(result.dtype, list(result.shape)).copy_(result)
        except Exception as error:
            return self.answer(client_id, client, seq, error)
        self.answer(client_id, client, seq)

    def answer(self, client_id: str, client, seq: int, error: BaseException | None = None) -> None:
        if client.flags is not None:  # behind the output copy on the stream, or at once for a failed call
            self.streams.answered(client, seq, partial(self._ran, client_id))
        client.doorbell.answer(seq, None if error is None else wire.error_reply(None, error))

    def _ran(self, client_id: str) -> None:
        client = self.clients.get(client_id)
        if client is not None:
            client.on_stream -= 1
            self.pump(client_id)
