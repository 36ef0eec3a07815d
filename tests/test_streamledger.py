"""The executor's record of what its CUDA stream has queued and not yet run (`transport/streamledger.py`),
with stand-in events whose completion the test sets (a stream passes its events in recording order)."""

from __future__ import annotations

import os

from symbiosis.transport.streamledger import StreamLedger


class FakeEvent:
    made: list["FakeEvent"] = []  # every event made
    recorded: list["FakeEvent"] = []  # one entry per record(), in order

    def __init__(self):
        FakeEvent.made.append(self)
        self.passed = False

    def record(self, stream) -> None:
        FakeEvent.recorded.append(self)
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_callbacks_run_in_order_up_to_the_first_point_the_stream_has_not_passed():
    FakeEvent.made, FakeEvent.recorded = [], []
    ledger, ran = StreamLedger(FakeEvent), []
    for name in "abc":
        ledger.after("stream", lambda name=name: ran.append(name))
    a, b, c = FakeEvent.recorded
    assert ledger and ledger.run_passed() == 0 and ran == []
    b.passed = True  # the stream cannot be past b and not a: nothing runs out of order
    assert ledger.run_passed() == 0 and ran == []
    a.passed = True
    assert ledger.run_passed() == 2 and ran == ["a", "b"]
    ledger.after("stream", lambda: ran.append("d"))
    assert len(FakeEvent.made) == 3  # a passed event is recorded again rather than a new one made
    d = FakeEvent.recorded[-1]
    d.passed = True
    assert ledger.run_passed() == 0, "d was recorded after c, which the stream has not passed"
    c.passed = True
    assert ledger.run_passed() == 2 and ran == ["a", "b", "c", "d"]
    assert not ledger


def test_a_callback_that_adds_a_point_has_it_checked_in_the_same_pass():
    class Passed(FakeEvent):
        def query(self) -> bool:
            return True

    ledger, ran = StreamLedger(Passed), []
    ledger.after("stream", lambda: ledger.after("stream", lambda: ran.append("second")))
    assert ledger.run_passed() == 2 and ran == ["second"]


def test_pipelined_clients_sharing_the_stream_have_two_calls_each_waiting_there(checkpoints, monkeypatch):
    """The executor service's rule (`server.py`): while several pipelined clients have calls, each may have
    SHARED_STREAM_DEPTH queued on the stream and not yet run, so their calls interleave there; a lone client
    is not held back. Run on the CPU with the stream's driver calls stubbed and stand-in events."""
    import torch

    import symbiosis
    from symbiosis.transport import server as server_module
    from symbiosis.transport.doorbell import Doorbell, Request
    from symbiosis.transport.server import SHARED_STREAM_DEPTH, ExecutorServer, RemoteClient
    from symbiosis.transport.shm import SharedBuffer

    assert SHARED_STREAM_DEPTH == 2
    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="none")
    layer = "model.layers.0.mlp.up_proj"
    width = executor.layer_specs[layer].in_features
    ran: list[str] = []  # the order in which calls reach the stream, by their gates
    monkeypatch.setattr(server_module.streamops, "write", lambda *args: None)
    monkeypatch.setattr(server_module.streamops, "wait_geq", lambda stream, address, seq, device: ran.append(
        f"{names[address]}{seq}"))
    server = ExecutorServer(executor, "inproc://depth-test")
    server._ledger = StreamLedger(FakeEvent)
    FakeEvent.made, FakeEvent.recorded = [], []
    names, opened = {}, []
    for name in "AB":
        buffer, flags = SharedBuffer.create(1 << 16, torch.device("cpu")), SharedBuffer.create(8, torch.device("cpu"))
        doorbell = Doorbell.create()
        opened += [buffer, flags, doorbell]
        client_id = executor.register(executor.fingerprint, name)
        server.clients[client_id] = RemoteClient(b"", name, buffer, 0.0, doorbell, flags)
        names[flags.tensor.data_ptr()] = name
    try:
        a, b = server.clients
        calls = [Request(seq, "forward", layer, False, torch.float64, (3, width)) for seq in range(1, 6)]
        server.clients[a].pending.extend(calls)
        server._pump(a)  # alone: all five go on the stream
        assert ran == ["A1", "A2", "A3", "A4", "A5"] and server.clients[a].on_stream == 5
        for event in FakeEvent.recorded:
            event.passed = True
        assert server._ledger.run_passed() == 5 and server.clients[a].on_stream == 0
        ran.clear()
        FakeEvent.recorded = []
        for client_id in (a, b):
            server.clients[client_id].pending.extend(
                Request(seq, "forward", layer, False, torch.float64, (3, width)) for seq in range(6, 10))
        server._pump(a)
        server._pump(b)
        assert ran == ["A6", "A7", "B6", "B7"]  # two each while both have calls
        FakeEvent.recorded[0].passed = True  # the stream ran A6: A queues its next one
        server._ledger.run_passed()
        assert ran == ["A6", "A7", "B6", "B7", "A8"]
        for event in FakeEvent.recorded[1:3]:  # A7, B6
            event.passed = True
        server._ledger.run_passed()
        assert ran == ["A6", "A7", "B6", "B7", "A8", "A9", "B8"]
    finally:
        server._socket.close(linger=0)
        os.close(server._wake_read)
        os.close(server._wake_write)
        for shared in opened:
            shared.close()
