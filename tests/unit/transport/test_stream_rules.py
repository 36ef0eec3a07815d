"""The executor service's rules for pipelined clients' calls on its CUDA stream, run on the CPU: the ledger of
what the stream has queued and not run (`transport/streamledger.py`, with stand-in events whose completion
the test sets; a stream passes its events in recording order), the depth each client may have there, the
release of a departed client's calls, and where MPS is looked for."""

from __future__ import annotations

import os

import pytest
import torch
import zmq

from symbiosis.transport.ipc.streamledger import StreamLedger


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


@pytest.fixture
def stub_server(checkpoints, monkeypatch):
    """An executor service on the CPU with two attached "pipelined" clients A and B: their flags are host
    memory, the stream's driver calls are stubbed and logged, its events are stand-ins the test passes.
    Yields (server, {name: client id}, gates: calls in the order their gates were queued, writes)."""
    import torch

    import symbiosis
    from symbiosis.transport.ipc import streams as streams_module
    from symbiosis.transport.ipc.doorbell import Doorbell
    from symbiosis.transport.clients import RemoteClient
    from symbiosis.transport.server import ExecutorServer
    from symbiosis.transport.ipc.shm import SharedBuffer

    path, _ = checkpoints("llama")
    executor = symbiosis.Executor.from_pretrained(path, dtype=torch.float64, policy="none")
    names, gates, writes = {}, [], []
    monkeypatch.setattr(streams_module.streamops, "write", lambda stream, address, value, device: writes.append(
        (stream, address, value)))
    monkeypatch.setattr(streams_module.streamops, "wait_geq", lambda stream, address, seq, device: gates.append(
        f"{names[address]}{seq}"))
    server = ExecutorServer(executor, "inproc://stub-server")
    server._streams.ledger = StreamLedger(FakeEvent)
    server._streams.side_stream = "side"
    FakeEvent.made, FakeEvent.recorded = [], []
    ids, opened = {}, []
    for name in "AB":
        (buffer, buffer_fd), (flags, flags_fd) = SharedBuffer.sealed(1 << 16), SharedBuffer.sealed(8)
        doorbell, client_ends = Doorbell.pair()
        for fd in (buffer_fd, flags_fd, *client_ends):
            os.close(fd)
        opened += [buffer, flags, doorbell]
        ids[name] = executor.register(executor.fingerprint, name)
        server.clients[ids[name]] = RemoteClient(b"", "admin", name, buffer, 0.0, doorbell, flags)
        server._doorbells[doorbell.request_fd] = ids[name]
        server._poller.register(doorbell.request_fd, zmq.POLLIN)
        names[flags.tensor.data_ptr()] = name
    yield server, ids, gates, writes
    server._socket.close(linger=0)
    server._finished.close()
    for shared in opened:
        try:
            shared.close()
        except OSError:
            pass  # a doorbell the server closed already


def _calls(server, client_id: str, seqs, inference: bool = False) -> None:
    from symbiosis.transport.ipc.doorbell import Request

    layer = "model.layers.0.mlp.up_proj"
    width = server.executor.layer_specs[layer].in_features
    server.clients[client_id].pending.extend(Request(seq, "forward", layer, inference, torch.float64, (3, width))
                                             for seq in seqs)
    server._calls.pump(client_id)


def test_pipelined_clients_sharing_the_stream_have_two_calls_each_waiting_there(stub_server):
    """The executor service's rule (`ipc/streams.py`): while several pipelined clients have calls, each may have
    SHARED_STREAM_DEPTH queued on the stream and not yet run, so their calls interleave there; a lone client
    is not held back."""
    from symbiosis.transport.ipc.streams import SHARED_STREAM_DEPTH

    server, ids, gates, _ = stub_server
    a, b = ids["A"], ids["B"]
    assert SHARED_STREAM_DEPTH == 2
    _calls(server, a, range(1, 6))  # alone: all five go on the stream
    assert gates == ["A1", "A2", "A3", "A4", "A5"] and server.clients[a].on_stream == 5
    for event in FakeEvent.recorded:
        event.passed = True
    assert server._streams.ledger.run_passed() == 5 and server.clients[a].on_stream == 0
    gates.clear()
    FakeEvent.recorded = []
    server.clients[b].pending.append(None)  # B has a call taken (not yet pumped): A is not alone
    _calls(server, a, range(6, 10))
    assert gates == ["A6", "A7"]
    server.clients[b].pending.clear()
    _calls(server, b, range(6, 10))
    assert gates == ["A6", "A7", "B6", "B7"]
    FakeEvent.recorded[0].passed = True  # the stream ran A6: A queues its next one
    server._streams.ledger.run_passed()
    assert gates == ["A6", "A7", "B6", "B7", "A8"]
    for event in FakeEvent.recorded[1:3]:  # A7, B6
        event.passed = True
    server._streams.ledger.run_passed()
    assert gates == ["A6", "A7", "B6", "B7", "A8", "A9", "B8"]


def test_a_decoding_clients_inference_calls_are_not_held_behind_the_training_calls(stub_server):
    """Inference calls go on the stream as they come, however many of the client's are there; a training
    client sharing the stream keeps its depth."""
    server, ids, gates, _ = stub_server
    a, b = ids["A"], ids["B"]
    _calls(server, b, range(1, 4))  # B trains: alone, all three go
    _calls(server, a, range(1, 5), inference=True)
    assert gates == ["B1", "B2", "B3", "A1", "A2", "A3", "A4"]
    _calls(server, b, range(4, 6))  # B is past the depth while A's calls are on the stream
    _calls(server, a, range(5, 7), inference=True)
    assert gates[7:] == ["A5", "A6"]
    _calls(server, a, [7])  # a training call of A's is held like any other
    assert gates[9:] == []


def test_a_departed_pipelined_client_lets_the_stream_pass_its_calls(stub_server):
    """A pipelined client that leaves with calls queued on the stream: its input flag is set far ahead from
    the side stream (so those calls' waits end, and the calls behind them run), and its buffer and flags
    stay mapped until the stream is past its last call."""
    server, ids, gates, writes = stub_server
    a = ids["A"]
    client = server.clients[a]
    _calls(server, a, range(1, 4))
    writes.clear()
    client.doorbell.seq = 3  # as if the executor had taken them from the ring
    server._drop(a)
    assert writes == [("side", client.flags.tensor.data_ptr(), 3 + (1 << 20))]
    assert client.buffer.tensor is not None and client.flags.tensor is not None  # the stream may still read them
    for event in FakeEvent.recorded[:3]:
        event.passed = True
    server._streams.ledger.run_passed()
    assert client.buffer.tensor is not None, "closed before the stream was past the calls"
    for event in FakeEvent.recorded[3:]:
        event.passed = True
    server._streams.ledger.run_passed()
    assert client.buffer.tensor is None and client.flags.tensor is None


def test_mps_is_found_where_cuda_looks_for_its_pipe(tmp_path, monkeypatch):
    from symbiosis.transport.clients import mps_running

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").touch()  # the daemon's control pipe
    assert mps_running()
